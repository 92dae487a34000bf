"""The search loop with a fake trial runner: seeding, pruning, failures as data, re-measurement, resume."""

from __future__ import annotations

import itertools
import logging
import os
import socket
import subprocess
from dataclasses import replace

import optuna
import pytest

from autotune.costs import Profile
from autotune.errors import UsageError
from autotune.model_file import load_model_file
from autotune.plan import plan
from autotune.schedules import Schedule
from autotune.search import SearchOptions, SearchSpace, remeasure_reserve, rule_of_thumb, run_search
from autotune.search_space import _shifted
from autotune.simulate import simulate
from tests.conftest import RECIPES
from tests.fakes import COSTS, SimulatedRunner, synthetic_profile


def profile() -> Profile:
    return synthetic_profile()



@pytest.fixture
def spec():
    return load_model_file(RECIPES / "gpt.py")  # any spec: the fake runner never uses it


def search(spec, tmp_path, runner, **options):
    p = profile()
    opts = SearchOptions(gpus=2, batch_size=32, **{"n_trials": 8, "seed": 1, **options})
    planned = plan(p, gpus=2, batch_size=32, memory_limit_bytes=opts.memory_limit_bytes)
    return run_search(spec, p, planned, opts, study_name="s", storage=f"sqlite:///{tmp_path / 's.db'}",
                      runner=runner)


def test_shifted_keeps_every_stage_non_empty():
    assert _shifted((3, 3, 2), [1, -1]) == (4, 1, 3)
    assert _shifted((1, 1, 1), [5, 5]) == (1, 1, 1)
    assert _shifted((4, 4), [-9]) == (1, 7)


def test_rule_of_thumb_is_uniform_1f1b_with_4x_stages():
    c = rule_of_thumb(8, 2, 32)
    assert (c.schedule, c.n_microbatches, c.layers_per_stage) == (Schedule.ONE_F_ONE_B, 8, (4, 4))


def test_space_round_trips_planned_candidates():
    p = profile()
    space = SearchSpace(p, SearchOptions(gpus=2, batch_size=32))
    for planned in plan(p, gpus=2, batch_size=32, memory_limit_bytes=None)[:10]:
        params = space.params_for(planned.candidate)
        assert params is not None
        trial = optuna.trial.FixedTrial(params)
        assert space.suggest(trial) == planned.candidate


def test_search_chooses_the_fastest_measured_and_respects_budget(spec, tmp_path):
    runner = SimulatedRunner()
    result = search(spec, tmp_path, runner)
    assert result.launched == len(runner.calls) == 8
    ok = [r for r in result.records if r.outcome == "ok"]
    fastest = min(ok, key=lambda r: r.step_time_ms)
    assert result.best.candidate == fastest.candidate
    assert result.records[0].phase == "default" and result.records[0].candidate == rule_of_thumb(8, 2, 32)
    assert any(r.phase == "remeasure" for r in result.records)


class UnluckyFirstRun(SimulatedRunner):
    """The simulator's runs, but the first run of `unlucky` comes out 40 % slow (a busy machine)."""

    def __init__(self, unlucky):
        super().__init__()
        self.unlucky = unlucky

    def __call__(self, spec, candidate, options):
        measured = super().__call__(spec, candidate, options)
        if candidate == self.unlucky and self.calls.count(candidate) == 1:
            slow = measured.step_time_ms * 1.4
            measured = replace(measured, step_time_ms=slow, step_times_ms=(slow,),
                               throughput_samples_per_s=candidate.global_batch_size / slow * 1000)
        return measured


def test_the_candidate_predicted_fastest_gets_a_second_run_after_an_unlucky_first(spec, tmp_path):
    p = profile()
    best = plan(p, gpus=2, batch_size=32, memory_limit_bytes=None)[0].candidate  # the planner's best: seeded
    runner = UnluckyFirstRun(best)
    result = search(spec, tmp_path, runner, n_trials=12)
    runs = [r for r in result.records if r.candidate == best and r.launched]
    assert len(runs) >= 2 and runs[1].phase == "remeasure", [(r.phase, r.candidate.key) for r in result.records]
    assert runs[1].step_time_ms == pytest.approx(runs[0].step_time_ms / 1.4)


def test_no_extra_rerun_when_the_measured_leaders_are_the_predicted_fastest(spec, tmp_path):
    result = search(spec, tmp_path, SimulatedRunner(), n_trials=12)
    remeasured = {r.candidate.key for r in result.records if r.phase == "remeasure"}
    assert len(remeasured) <= 3


def test_a_third_of_the_budget_re_runs_the_leaders_in_up_to_two_rounds(spec, tmp_path):
    assert [remeasure_reserve(n, 3) for n in (3, 4, 5, 6, 12, 20, 50)] == [0, 1, 1, 2, 4, 6, 6]
    result = search(spec, tmp_path, SimulatedRunner(), n_trials=12)
    reruns = [r for r in result.records if r.phase == "remeasure" and r.launched]
    assert len(reruns) >= 4 and sum(r.launched for r in result.records) == 12
    assert len({r.candidate.key for r in reruns}) >= 2  # side by side: the choice is made among them


def test_failed_trials_are_recorded_and_the_search_goes_on(spec, tmp_path):
    kinds = itertools.cycle(["oom", "error", "timeout", None])
    runner = SimulatedRunner(fail=lambda c: next(kinds))
    result = search(spec, tmp_path, runner)
    outcomes = {r.outcome for r in result.records}
    assert {"oom", "error", "timeout"} <= outcomes
    assert result.best is not None
    failed = [r for r in result.records if r.outcome == "error"]
    assert failed and failed[0].reason == "rank 1: injected error"
    study = optuna.load_study(study_name="s", storage=f"sqlite:///{tmp_path / 's.db'}")
    states = {t.state for t in study.trials}
    assert optuna.trial.TrialState.FAIL in states


def test_memory_limit_prunes_before_launch(spec, tmp_path):
    runner = SimulatedRunner()
    p = profile()
    lean = min(simulate(p, pc.candidate, with_timeline=False).peak_memory_bytes[0]
               for pc in plan(p, gpus=2, batch_size=32, memory_limit_bytes=None))
    result = search(spec, tmp_path, runner, memory_limit_bytes=lean + 1)
    pruned = [r for r in result.records if r.outcome == "pruned" and "limit" in r.reason]
    assert all(max(simulate(p, c, with_timeline=False).peak_memory_bytes) <= lean + 1 for c in runner.calls)
    assert pruned  # the rule-of-thumb default alone needs more than the leanest candidate
    assert all(max(r.predicted_peak_memory_bytes) > lean + 1 for r in pruned)
    assert not any(r.launched for r in pruned)


class LuckyFirstRun(SimulatedRunner):
    """The rule-of-thumb default's first run is lucky (0.3 x its simulated step time) and its later runs slow (3 x):
    the fastest single run of the search is then a run of a candidate that does not win on its median."""

    def __call__(self, spec, candidate, options):
        measured = super().__call__(spec, candidate, options)
        if candidate != rule_of_thumb(8, 2, 32) or measured.status != "ok":
            return measured
        factor = 0.3 if self.calls.count(candidate) == 1 else 3.0
        step = measured.step_time_ms * factor
        return replace(measured, step_time_ms=step, step_times_ms=(step,),
                       throughput_samples_per_s=candidate.global_batch_size / step * 1000)


def test_best_trial_is_a_run_of_the_chosen_candidate_live_and_stored(spec, tmp_path):
    from autotune.search import load_search

    result = search(spec, tmp_path, LuckyFirstRun())
    default = rule_of_thumb(8, 2, 32)
    fastest_run = min((r for r in result.records if r.outcome == "ok"), key=lambda r: r.step_time_ms)
    assert fastest_run.candidate == default != result.best.candidate  # the trap is set
    by_number = {r.number: r for r in result.records}
    assert by_number[result.best_trial].candidate == result.best.candidate
    assert by_number[result.best_trial].outcome == "ok" and by_number[result.best_trial].launched
    stored, _ = load_search(f"sqlite:///{tmp_path / 's.db'}", "s")
    assert stored.best_trial == result.best_trial


def test_interrupted_search_resumes_without_losing_trials(spec, tmp_path):
    first = search(spec, tmp_path, SimulatedRunner(interrupt_after=3))
    assert first.interrupted and first.launched == 4
    done = [r.number for r in first.records if r.launched and r.outcome == "ok"]
    with pytest.raises(UsageError, match="--resume"):
        search(spec, tmp_path, SimulatedRunner())
    runner = SimulatedRunner()
    second = search(spec, tmp_path, runner, resume=True)
    assert [r.number for r in second.records if r.number in done and r.outcome == "ok"] == done
    interrupted = [r for r in second.records if r.outcome == "interrupted"]
    assert len(interrupted) == 1 and interrupted[0].launched
    assert second.launched == 8  # the budget counts the launches before the interruption
    assert len(runner.calls) == 8 - 4


def test_trials_enqueued_but_never_asked_are_not_records_and_resume_counts_each_trial_once(spec, tmp_path):
    from autotune.search import load_search

    storage = f"sqlite:///{tmp_path / 's.db'}"
    first = search(spec, tmp_path, SimulatedRunner(interrupt_after=3))
    # A seed or re-measurement enqueued but never asked (the budget or Ctrl-C cut it short) waits in the storage.
    params = SearchSpace(profile(), SearchOptions(gpus=2, batch_size=32)).params_for(rule_of_thumb(8, 2, 32))
    optuna.load_study(study_name="s", storage=storage).enqueue_trial(params, user_attrs={"phase": "seed"})
    stored, _ = load_search(storage, "s")
    assert [r.number for r in stored.records] == [r.number for r in first.records]
    assert not any(r.outcome == "interrupted" and not r.launched for r in stored.records)
    second = search(spec, tmp_path, SimulatedRunner(), resume=True)
    numbers = [r.number for r in second.records]
    asked = optuna.load_study(study_name="s", storage=storage).get_trials(
        states=(optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED, optuna.trial.TrialState.FAIL)
    )
    assert sorted(numbers) == sorted(set(numbers)) == sorted(t.number for t in asked)


def test_a_trial_left_running_by_a_crash_is_failed_on_resume(spec, tmp_path):
    search(spec, tmp_path, SimulatedRunner(interrupt_after=2))
    study = optuna.load_study(study_name="s", storage=f"sqlite:///{tmp_path / 's.db'}")
    crashed = study.ask()  # as if the tuner died (SIGKILL) in the middle of this trial: its process is gone
    dead = subprocess.Popen(["true"])
    dead.wait()
    crashed.set_user_attr("owner", {"worker": "w", "host": socket.gethostname(), "pid": dead.pid})
    crashed.set_user_attr("launched", True)
    result = search(spec, tmp_path, SimulatedRunner(), resume=True)
    record = next(r for r in result.records if r.number == crashed.number)
    assert record.outcome == "interrupted" and "died" in record.reason and "worker w" in record.reason
    assert study.trials[crashed.number].state == optuna.trial.TrialState.FAIL


def test_a_search_joining_a_study_leaves_another_live_searchs_trial_alone(spec, tmp_path):
    # Issue 16: a search starting on a study failed every RUNNING trial, a live search's too, which then crashed.
    search(spec, tmp_path, SimulatedRunner(interrupt_after=2))
    study = optuna.load_study(study_name="s", storage=f"sqlite:///{tmp_path / 's.db'}")
    running = study.ask()  # another search's trial, running now: its process lives
    running.set_user_attr("owner", {"worker": "other", "host": socket.gethostname(), "pid": os.getppid()})
    running.set_user_attr("launched", True)
    result = search(spec, tmp_path, SimulatedRunner(), resume=True, worker="me")
    assert study.trials[running.number].state == optuna.trial.TrialState.RUNNING
    assert next(r for r in result.records if r.number == running.number).outcome == "interrupted"
    assert sum(r.launched and r.worker == "me" for r in result.records) == 8  # its own budget, not the study's


def test_load_search_rebuilds_the_result_from_storage(spec, tmp_path):
    from autotune.search import load_search

    result = search(spec, tmp_path, SimulatedRunner())
    loaded, prof = load_search(f"sqlite:///{tmp_path / 's.db'}", "s")
    setup = loaded.setup
    assert loaded.best.candidate == result.best.candidate
    assert [r.outcome for r in loaded.records] == [r.outcome for r in result.records]
    assert prof.n_layers == len(COSTS) and setup["gpus"] == 2 and setup["batch_size"] == 32


def test_one_stage_pipelines_only_take_single_stage_schedules_and_float32():
    # At pp = 1 GPipe and 1F1B are the same run: only 1F1B is offered; no split, no wire dtype is asked.
    space = SearchSpace(profile(), SearchOptions(gpus=2, batch_size=32))
    assert list(space.choices[(1, 2, 1)]) == [Schedule.ONE_F_ONE_B]
    params = {"layout": "pp1xdp2", "schedule_pp1xdp2": "1F1B", "n_microbatches_pp1xdp2_1F1B": 4,
              "activation_checkpointing": False, "data_parallel": "replicate"}
    candidate = space.suggest(optuna.trial.FixedTrial(params))
    assert (candidate.n_stages, candidate.wire_dtype) == (1, "float32")
    assert space.params_for(candidate) == params
    assert space.params_for(replace(candidate, schedule=Schedule.GPIPE)) is None


def test_replicas_are_searched_replicated_and_sharded_with_and_without_resharding():
    """With dp > 1 the space asks how the replicas hold their stages (pure FSDP at pp = 1 included); with dp = 1 it
    does not ask; --data-parallel narrows it; the precision is the search's on every candidate."""
    space = SearchSpace(profile(), SearchOptions(gpus=2, batch_size=32, precision="bf16"))
    base = {"layout": "pp1xdp2", "schedule_pp1xdp2": "1F1B", "n_microbatches_pp1xdp2_1F1B": 4,
            "activation_checkpointing": False}
    seen = set()
    for value in ("replicate", "shard", "shard-reshard"):
        c = space.suggest(optuna.trial.FixedTrial({**base, "data_parallel": value}))
        seen.add((c.data_parallel_mode, c.reshard_after_forward, c.precision))
        assert space.params_for(c) == {**base, "data_parallel": value}
    assert seen == {("replicate", False, "bf16"), ("shard", False, "bf16"), ("shard", True, "bf16")}
    pipeline = space.suggest(optuna.trial.FixedTrial(
        {"layout": "pp2xdp1", "schedule_pp2xdp1": "1F1B", "n_microbatches_pp2xdp1_1F1B": 4, "split": "uniform",
         "shift1_of_2": 0, "activation_checkpointing": False, "wire_dtype": "float32"}))
    assert (pipeline.data_parallel_mode, pipeline.precision) == ("replicate", "bf16")
    assert "data_parallel" not in space.params_for(pipeline)
    assert space.params_for(replace(pipeline, precision="fp32")) is None  # another precision: outside this search
    only_shard = SearchSpace(profile(), SearchOptions(gpus=2, batch_size=32, data_parallel_modes=("shard",)))
    sharded = only_shard.suggest(optuna.trial.FixedTrial({**base, "data_parallel": "shard"}))
    assert sharded.sharded
    assert only_shard.params_for(replace(sharded, data_parallel_mode="replicate")) is None


def test_only_runnable_combinations_are_asked():
    # Each layout offers the schedules that run there, each schedule the micro-batch counts it accepts there.
    space = SearchSpace(profile(), SearchOptions(gpus=2, batch_size=32))
    at_pp2 = space.choices[(2, 1, 1)]
    assert at_pp2[Schedule.ONE_F_ONE_B] == [2, 4, 8, 16, 32]  # 1F1B needs a micro-batch per stage at least
    assert at_pp2[Schedule.GPIPE] == [1, 2, 4, 8, 16, 32]
    assert at_pp2[Schedule.DUAL_PIPE_V] == [4, 8, 16, 32]  # at least 2 x pp
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    for _ in range(200):
        space.suggest(study.ask())  # never raises InvalidCandidateError


def test_the_balanced_base_is_the_planners_split_checkpointing_included():
    from autotune.costs import LayerCost, Profile
    from autotune.partition import balanced_split

    # Forward-heavy layers cost more once checkpointed (their forward runs twice): the checkpointed split differs.
    layers = [LayerCost(forward_ms=f, backward_input_ms=b / 2, backward_weight_ms=b / 2, saved_bytes=10,
                        output_bytes=10, parameter_bytes=10) for f, b in [(4, 1)] * 4 + [(0.5, 4.5)] * 4]
    p = Profile.from_layer_costs(layers, micro_batch_size=4)
    space = SearchSpace(p, SearchOptions(gpus=2, batch_size=32, layouts=((2, 1),)))
    params = {"layout": "pp2xdp1", "schedule_pp2xdp1": "1F1B", "n_microbatches_pp2xdp1_1F1B": 4, "split": "balanced",
              "shift1_of_2": 0, "wire_dtype": "float32"}
    plain = space.suggest(optuna.trial.FixedTrial({**params, "activation_checkpointing": False}))
    ckpt = space.suggest(optuna.trial.FixedTrial({**params, "activation_checkpointing": True}))
    costs = p.layer_costs(8)
    assert plain.layers_per_stage == balanced_split(costs, Schedule.ONE_F_ONE_B, 2, 2)
    assert ckpt.layers_per_stage == balanced_split(costs, Schedule.ONE_F_ONE_B, 2, 2, checkpointing=True)
    assert ckpt.layers_per_stage != plain.layers_per_stage
    assert space.params_for(ckpt) == {**params, "activation_checkpointing": True}


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_sampler_is_not_asked_three_times_per_run(spec, tmp_path, seed):
    # Issue 13: a search logged 343 Optuna trials for 8 real runs (repeats and invalid combinations).
    runner = SimulatedRunner()
    p = profile()
    opts = SearchOptions(gpus=2, batch_size=32, n_trials=8, seed=seed)
    result = run_search(spec, p, plan(p, gpus=2, batch_size=32, memory_limit_bytes=None), opts, study_name="s",
                        storage=f"sqlite:///{tmp_path / 's.db'}", runner=runner)
    assert result.launched == len(runner.calls) == 8
    assert len(result.records) < 3 * result.launched
    assert not [r for r in result.records if r.reason.startswith("invalid")]


def test_at_pp_1_gpipe_and_1f1b_are_one_candidate():
    from autotune.schedules import schedules_for

    assert schedules_for(1, list(Schedule)) == [Schedule.ONE_F_ONE_B]
    assert schedules_for(1, [Schedule.GPIPE, Schedule.V_HALF]) == [Schedule.GPIPE]
    assert schedules_for(2, [Schedule.GPIPE, Schedule.ONE_F_ONE_B]) == [Schedule.GPIPE, Schedule.ONE_F_ONE_B]
    planned = plan(profile(), gpus=2, batch_size=32, memory_limit_bytes=None, prune_within=None)
    at_pp1 = {p.candidate.schedule for p in planned if p.candidate.pipeline_degree == 1}
    assert at_pp1 == {Schedule.ONE_F_ONE_B}


def test_a_ctrl_c_that_python_swallowed_still_stops_the_search(spec, tmp_path):
    # A Ctrl-C that lands in a garbage-collector callback is "ignored" by Python; the search must stop all the same.
    import signal

    inner = SimulatedRunner()

    def swallowing(spec_, candidate, options):
        if len(inner.calls) == 2:
            try:
                signal.raise_signal(signal.SIGINT)  # the handler runs as this call returns
            except KeyboardInterrupt:
                pass  # as a weakref callback's "Exception ignored in ..."
        return inner(spec_, candidate, options)

    result = search(spec, tmp_path, swallowing)
    assert result.interrupted and len(inner.calls) == 3


def test_a_worker_joining_a_study_chooses_by_its_own_side_by_side_reruns(spec, tmp_path):
    # Issue 16: every worker's config is drawn from the whole study, and the leaders are re-measured side by side on
    # the hardware of the worker that writes. Worker b's machine is 2x slower than a's, and 3x on a's best: b re-runs
    # the leaders and chooses by its own runs, not by the medians of both machines' runs.
    first = search(spec, tmp_path, SimulatedRunner(), worker="a")
    fastest = first.best.candidate

    class SlowerForB(SimulatedRunner):
        def __call__(self, spec, candidate, options):
            m = super().__call__(spec, candidate, options)
            if m.step_time_ms is None:
                return m
            step = m.step_time_ms * (3.0 if candidate == fastest else 2.0)
            return replace(m, step_time_ms=step, step_times_ms=(step,),
                           throughput_samples_per_s=candidate.global_batch_size / step * 1000)

    second = search(spec, tmp_path, SlowerForB(), resume=True, worker="b")
    remeasured = [r for r in second.records if r.worker == "b" and r.phase == "remeasure" and r.launched]
    assert {r.candidate.key for r in remeasured} >= {fastest.key}, "b re-ran the study's best"
    assert second.best.candidate != fastest  # on b's machine another leader is faster
    b_runs = {r.candidate.key: r.step_time_ms for r in remeasured}
    assert second.best.step_time_ms == min(b_runs.values())  # its step time is b's own measurement

    # Issue 26: the report of a shared study says per worker what it measured, and which runs chose the config.
    from autotune.report.document import build_document
    from autotune.report.facts import gather_facts
    from autotune.report.markdown import render_markdown
    from autotune.search import load_search

    assert second.chosen_by == "b" and first.workers == () and first.chosen_by is None
    a, b = second.workers
    assert (a.worker, b.worker) == ("a", "b") and a.host == b.host == socket.gethostname()
    assert (a.launched, b.launched) == (8, len([r for r in second.records if r.worker == "b" and r.launched]))
    assert a.leaders[0].candidate == a.choice == fastest and b.choice == second.best.candidate
    assert b.remeasured == len(remeasured)
    url = f"sqlite:///{tmp_path / 's.db'}"
    as_b, _ = load_search(url, "s", worker="b")
    assert (as_b.chosen_by, as_b.best.candidate, as_b.workers) == ("b", second.best.candidate, second.workers)
    assert load_search(url, "s", config=second.best.candidate)[0].chosen_by == "b"  # the worker whose choice it is
    every, _ = load_search(url, "s")
    assert every.chosen_by is None and every.workers == second.workers
    with pytest.raises(UsageError, match="no worker 'c' launched runs in study 's'; its workers: a, b"):
        load_search(url, "s", worker="c")
    markdown = render_markdown(build_document(gather_facts(as_b, profile=profile(), memory_limit_bytes=None), []))
    section = markdown.split("## Workers", 1)[1].split("\n## ", 1)[0]
    assert "chosen by worker **b**'s side-by-side re-runs of the leaders (trials " in section
    assert f"| a | {socket.gethostname()} | 8 |" in section and f"`{fastest.key}`" in section
    markdown = render_markdown(build_document(gather_facts(every, profile=profile(), memory_limit_bytes=None), []))
    assert "every run of the study, every worker's together" in markdown and "| worker |" in markdown


def test_the_rank_order_is_a_parameter_only_where_the_layout_spans_nodes():
    p = profile()
    space = SearchSpace(p, SearchOptions(gpus=4, batch_size=32, gpus_per_node=2))
    planned = plan(p, gpus=4, batch_size=32, memory_limit_bytes=None, gpus_per_node=2)
    orders = {pc.candidate.rank_order for pc in planned if pc.candidate.data_parallel_degree == 2}  # pp 2 x dp 2
    assert orders == {"pp-inner", "dp-inner"}  # the planner ranks both at pp 2 x dp 2 over two nodes of 2
    for c in (pc.candidate for pc in planned):
        params = space.params_for(c)
        assert params is not None and space.suggest(optuna.trial.FixedTrial(params)) == c
        assert ("rank_order" in params) == (c.pipeline_degree == c.data_parallel_degree == 2)
    one_node = SearchSpace(p, SearchOptions(gpus=4, batch_size=32))
    dp_inner = next(pc.candidate for pc in planned if pc.candidate.rank_order == "dp-inner")
    assert one_node.params_for(dp_inner) is None  # on one node dp-inner is the same run as pp-inner: not asked
    assert "rank_order" not in one_node.params_for(replace(dp_inner, rank_order="pp-inner"))


def test_a_search_over_two_nodes_measures_both_rank_orders(spec, tmp_path):
    p = profile()
    opts = SearchOptions(gpus=4, batch_size=32, n_trials=4, seed=1, gpus_per_node=2, layouts=((2, 2),))
    planned = plan(p, gpus=4, batch_size=32, memory_limit_bytes=None, gpus_per_node=2, layouts=((2, 2),))
    runner = SimulatedRunner()
    result = run_search(spec, p, planned, opts, study_name="s", storage=f"sqlite:///{tmp_path / 's.db'}",
                        runner=runner)
    assert {c.rank_order for c in runner.calls} == {"pp-inner", "dp-inner"}
    first, twin = [r for r in result.records if r.phase == "rank-order"]  # the planner's best, in both orders
    assert first.launched and twin.launched and first.candidate == planned[0].candidate
    assert twin.candidate == replace(first.candidate, rank_order=twin.candidate.rank_order) != first.candidate


class _RecordingRunner(SimulatedRunner):
    def __init__(self, profile: Profile) -> None:
        super().__init__(profile)
        self.options = []

    def __call__(self, spec, candidate, options):
        self.options.append(options)
        return super().__call__(spec, candidate, options)


def test_each_trial_gets_a_bound_from_its_prediction_unless_one_is_given(spec, tmp_path):
    from autotune.costs import LayerCost
    from autotune.trial.launch import TRIAL_TIMEOUT_FLOOR_S, trial_timeout_s

    # The synthetic model 2000 times slower: steps of tens of seconds, as a large batch on CPU.
    slow = Profile.from_layer_costs(
        [LayerCost(forward_ms=2000 * c, backward_input_ms=2000 * c, backward_weight_ms=2000 * c, saved_bytes=1000,
                   output_bytes=100, parameter_bytes=400) for c in COSTS],
        micro_batch_size=4, input_bytes=100,
    )

    def run(folder, **options):
        (tmp_path / folder).mkdir()
        runner = _RecordingRunner(slow)
        opts = SearchOptions(gpus=2, batch_size=32, **{"n_trials": 8, "seed": 1, **options})
        run_search(spec, slow, plan(slow, gpus=2, batch_size=32, memory_limit_bytes=None), opts, study_name="s",
                   storage=f"sqlite:///{tmp_path / folder / 's.db'}", runner=runner)
        return runner

    derived = run("derived", wire_dtypes=("bfloat16",))
    assert any(c.wire_dtype == "bfloat16" for c in derived.calls)
    for candidate, options in zip(derived.calls, derived.options):
        assert options.measure_wire_error == (candidate.wire_dtype == "bfloat16")
        predicted_s = simulate(slow, candidate, with_timeline=False).step_time_ms / 1000
        assert predicted_s > 10
        assert options.timeout_s == trial_timeout_s(options, predicted_s) > TRIAL_TIMEOUT_FLOOR_S

    fixed = run("fixed", trial_timeout_s=42.0)
    assert fixed.options and all(o.timeout_s == 42.0 for o in fixed.options)


def test_each_kind_of_parallelism_the_planner_offers_is_measured(spec, tmp_path):
    """Pipeline or FSDP: the planner's best of each kind of parallelism (pipeline, data parallel, FSDP...) is run,
    even when the simulator predicts it slower than the prune margin allows, so the report compares them by runs."""
    runner = SimulatedRunner()
    search(spec, tmp_path, runner, prune_margin=0.0)
    planned = {p.candidate.parallelism for p in plan(profile(), gpus=2, batch_size=32, memory_limit_bytes=None)}
    assert len(planned) >= 2
    assert planned <= {c.parallelism for c in runner.calls}


def test_tensor_parallel_layouts_are_asked_beside_the_others_by_their_own_name():
    """With tp 2 allowed on 2 GPUs the space adds pp 1 x dp 1 x tp 2 ("pp1xdp1xtp2"); tp 1 layouts keep their names
    (a study from before tp resumes); a tp candidate round-trips and is outside a space without tp."""
    space = SearchSpace(profile(), SearchOptions(gpus=2, batch_size=32, tensor_parallel_degrees=(1, 2)))
    assert space.layouts == [(2, 1, 1), (1, 2, 1), (1, 1, 2)]
    params = {"layout": "pp1xdp1xtp2", "schedule_pp1xdp1xtp2": "1F1B", "n_microbatches_pp1xdp1xtp2_1F1B": 4,
              "activation_checkpointing": False}
    candidate = space.suggest(optuna.trial.FixedTrial(params))
    assert (candidate.pipeline_degree, candidate.data_parallel_degree, candidate.tensor_parallel_degree) == (1, 1, 2)
    assert candidate.world_size == 2 and candidate.parallelism == "tensor parallel"
    assert space.params_for(candidate) == params
    assert SearchSpace(profile(), SearchOptions(gpus=2, batch_size=32)).params_for(candidate) is None


def test_the_planners_best_tp_candidate_is_seeded_and_run(spec, tmp_path):
    """Tensor parallel is a kind of parallelism of its own: the planner ranks tp 2 (each degree's cheapest point is
    simulated however slow) and the search runs its best, even predicted slower than the prune margin allows."""
    p = profile()
    runner = SimulatedRunner()
    opts = SearchOptions(gpus=2, batch_size=32, n_trials=8, seed=1, prune_margin=0.0, tensor_parallel_degrees=(1, 2))
    planned = plan(p, gpus=2, batch_size=32, memory_limit_bytes=None, tensor_parallel_degrees=(1, 2))
    assert any(x.candidate.tensor_parallel_degree == 2 for x in planned)
    run_search(spec, p, planned, opts, study_name="s", storage=f"sqlite:///{tmp_path / 's.db'}", runner=runner)
    assert any(c.tensor_parallel_degree == 2 for c in runner.calls)


def test_the_best_so_far_is_the_fastest_median_not_one_lucky_run():
    from types import SimpleNamespace

    from autotune.candidate import Measurement
    from autotune.records import TrialRecord, leaders_of
    from autotune.search import _Engine

    a, b = (p.candidate for p in plan(profile(), gpus=2, batch_size=32, memory_limit_bytes=None)[:2])

    def run(number, candidate, step_ms):
        return TrialRecord(number=number, candidate=candidate, outcome="ok", reason="", step_time_ms=step_ms,
                           throughput_samples_per_s=32 / step_ms * 1000, launched=True)

    def engine(records):  # the study's records and its runs, as SharedStudy derives both from the same trials
        runs = {}
        for r in records:
            if r.outcome == "ok":
                runs.setdefault(r.candidate.key, []).append(
                    Measurement(candidate=r.candidate, status="ok", step_time_ms=r.step_time_ms))
        return SimpleNamespace(records=records, leaders=lambda: leaders_of(runs))

    records = [run(0, a, 10.0), run(1, b, 14.0), run(2, a, 20.0), run(3, b, 14.5),
               TrialRecord(number=4, candidate=a, outcome="pruned", reason="")]
    best = _Engine.best_record(engine(records))  # what the bar shows and pruning measures against
    assert best.candidate == b and best.step_time_ms == pytest.approx(14.25)
    assert best.throughput_samples_per_s == pytest.approx(32 / 14.25 * 1000)
    assert _Engine.best_record(engine(records[:1])).candidate == a
    assert _Engine.best_record(engine(records[4:])) is None


def test_search_says_how_its_budget_divides_between_exploring_and_re_runs(spec, tmp_path, caplog):
    """--trials 8 is 6 runs found by the sampler and 2 re-runs of the leaders: the first line says both, so the
    8 trials a user asked for add up (it said "up to 6 trial runs")."""
    with caplog.at_level(logging.INFO, logger="autotune.search"):
        search(spec, tmp_path, SimulatedRunner())
    assert "searching: up to 6 trial runs, then 2 re-runs of the leaders side by side" in caplog.messages


def test_the_re_measure_line_names_only_the_leaders_the_runs_left_can_take(spec, tmp_path, caplog):
    """Two re-runs left for three leaders: the line said "re-measuring the 3 leaders side by side" and two ran (a
    user's Qwen2 search, 2026-12-07); it names the two the budget takes."""
    with caplog.at_level(logging.INFO, logger="autotune.search"):
        search(spec, tmp_path, SimulatedRunner())
    line = next(m for m in caplog.messages if m.startswith("re-measuring"))
    assert line.startswith("re-measuring the first 2 of the 3 leaders (the runs left) side by side"), line
