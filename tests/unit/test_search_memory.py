"""Lower-memory choices: dp x pp layouts and checkpointed variants in the planner, and a search whose memory limit
excludes 1F1B at its best B/M (fake runner: step time and peak memory by simulation)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from autotune.candidate import Candidate, pipeline_layouts
from autotune.costs import LayerProfile, Profile
from autotune.model_file import load_model_file
from autotune.plan import plan
from autotune.report.reasons import best_one_f_one_b, lower_memory_changes, memory_choice_reason
from autotune.schedules import SCHEDULES, SYNCHRONOUS_SCHEDULES, Schedule
from autotune.search import SearchOptions, run_search
from autotune.simulate import LinkModel, Predictor, simulate
from tests.conftest import RECIPES
from tests.fakes import SimulatedRunner

MiB = 2**20
SIZES = (1, 16)


def _layer(name: str, params: int, ms: tuple[float, float], saved: int, output: int) -> LayerProfile:
    """Times: a fixed part per micro-batch plus a part per sample (F = B = W); bytes: per sample."""
    t = tuple(ms[0] + ms[1] * m for m in SIZES)
    return LayerProfile(name=name, parameter_bytes=params, forward_ms=t, backward_input_ms=t, backward_weight_ms=t,
                        saved_bytes=tuple(saved * m for m in SIZES), output_bytes=tuple(output * m for m in SIZES))


def gpt_like() -> Profile:
    """Embedding, 8 transformer blocks (sequence 1024 x hidden 1024: 68 MiB saved per sample, 4 MiB sent), head;
    profiled at micro-batch sizes 1 and 16 on a GPU, so small micro-batches pay a fixed cost each."""
    blocks = [_layer(f"Block{i}", 200 * MiB, (0.4, 0.5), 68 * MiB, 4 * MiB) for i in range(8)]
    layers = [_layer("Embedding", 200 * MiB, (0.1, 0.02), 4 * MiB, 4 * MiB), *blocks,
              _layer("Head", 200 * MiB, (0.3, 0.6), 130 * MiB, 1 * MiB)]
    return Profile(micro_batch_sizes=SIZES, layers=tuple(layers), input_bytes=tuple(8192 * m for m in SIZES),
                   device="cuda")


def peak(profile: Profile, candidate: Candidate) -> int:
    return max(simulate(profile, candidate, with_timeline=False).peak_memory_bytes)


# --- planner -----------------------------------------------------------------------------------------------------


def test_layouts_are_every_pp_x_dp_the_model_and_batch_allow():
    assert pipeline_layouts(8, 256, 48) == [(8, 1), (4, 2), (2, 4), (1, 8)]
    assert pipeline_layouts(8, 12, 48) == [(8, 1), (4, 2), (2, 4)]  # dp 8 does not divide B = 12
    assert pipeline_layouts(8, 256, 3) == [(2, 4), (1, 8)]  # a 3-layer model has no 4- or 8-rank pipeline
    assert pipeline_layouts(6, 6, 10) == [(6, 1), (3, 2), (2, 3), (1, 6)]


def test_plan_ranks_data_parallel_layouts_with_micro_batches_per_replica():
    planned = plan(gpt_like(), gpus=2, batch_size=32, memory_limit_bytes=None, prune_within=None)
    layouts = {(p.candidate.pipeline_degree, p.candidate.data_parallel_degree) for p in planned}
    assert layouts == {(2, 1), (1, 2)}
    for p in planned:
        c = p.candidate
        assert c.micro_batch_size * c.n_microbatches * c.data_parallel_degree == 32
        assert len(p.estimate.peak_memory_bytes) == c.pipeline_degree
        if c.pipeline_degree == 1:  # no pipeline: one stage, no multi-stage schedule
            assert c.schedule in (Schedule.GPIPE, Schedule.ONE_F_ONE_B) and c.layers_per_stage == (10,)
    replicated = next(p for p in planned if p.candidate.data_parallel_degree == 2)
    assert replicated.estimate.allreduce_ms > 0


WHOLE_BACKWARD = tuple(s for s in SYNCHRONOUS_SCHEDULES if not SCHEDULES[s].splits_backward)
"""Schedules whose checkpointed twins save memory: a split backward's W recomputes the stage once per parameter group
and keeps most of it (simulate._weight_recompute_bytes), more than checkpointing drops."""


def test_plan_emits_checkpointed_twins_of_the_fastest_even_when_they_fit():
    profile = gpt_like()
    planned = plan(profile, gpus=2, batch_size=32, memory_limit_bytes=None, prune_within=None,
                   schedules=WHOLE_BACKWARD)
    keys = {p.candidate.key for p in planned}
    fastest = [p.candidate for p in planned if not p.candidate.activation_checkpointing][:8]
    for c in fastest:
        assert replace(c, activation_checkpointing=True).key in keys, c.key
    # The fastest pipelined one: with one stage and one micro-batch (dp 2 x m 1 now ranks first, its gradient sync
    # overlapped) the recompute rebuilds at the peak what checkpointing dropped, and saves nothing.
    pipelined = next(c for c in fastest if c.pipeline_degree > 1)
    twin = next(p for p in planned if p.candidate.key == pipelined.key + "+ckpt")
    assert max(twin.estimate.peak_memory_bytes) < peak(profile, pipelined)  # it saves memory
    assert twin.estimate.step_time_ms > planned[0].estimate.step_time_ms  # and costs the recompute


def test_a_tight_limit_ranks_the_checkpointed_twin_of_the_best():
    profile = gpt_like()
    # The best pipelined candidate (a checkpointed twin of dp 2 x m 1, which ranks first, saves nothing: above).
    best = next(p.candidate for p in plan(profile, gpus=2, batch_size=32, memory_limit_bytes=None,
                                          schedules=WHOLE_BACKWARD)
                if p.candidate.pipeline_degree > 1 and not p.candidate.activation_checkpointing)
    limit = peak(profile, best) - 1
    planned = plan(profile, gpus=2, batch_size=32, memory_limit_bytes=limit, prune_within=None,
                   schedules=WHOLE_BACKWARD)
    twin = next(p for p in planned if p.candidate.key == best.key + "+ckpt")
    assert twin.estimate.feasible
    original = next(p for p in planned if p.candidate.key == best.key)
    assert not original.estimate.feasible and planned.index(twin) < planned.index(original)


# --- search under a limit that excludes 1F1B at its best B/M ------------------------------------------------------

LOWER_MEMORY = ("V-Half", "V-Min", "activation checkpointing", "data-parallel", "data parallelism",
                "smaller micro-batches", "bfloat16", "the split")


@pytest.fixture
def spec():
    return load_model_file(RECIPES / "gpt.py")  # any spec: the simulated runner never uses it


def test_search_under_a_limit_below_1f1b_at_its_best_chooses_a_lower_memory_config(spec, tmp_path):
    profile = gpt_like()
    baseline = best_one_f_one_b(profile, gpus=2, batch_size=32)
    assert baseline is not None and baseline.candidate.schedule is Schedule.ONE_F_ONE_B
    limit = max(baseline.estimate.peak_memory_bytes) - 1  # 1F1B at its best B/M just does not fit
    options = SearchOptions(gpus=2, batch_size=32, n_trials=10, seed=0, memory_limit_bytes=limit,
                            schedules=(Schedule.ONE_F_ONE_B, Schedule.V_HALF, Schedule.V_MIN))
    planned = plan(profile, gpus=2, batch_size=32, memory_limit_bytes=limit, schedules=options.schedules)
    runner = SimulatedRunner(profile, limit=limit)
    result = run_search(spec, profile, planned, options, study_name="s", storage=f"sqlite:///{tmp_path / 's.db'}",
                        runner=runner)

    assert result.best is not None
    chosen = result.best.candidate
    assert peak(profile, chosen) <= limit and max(result.best.peak_memory_bytes) <= limit
    assert chosen != baseline.candidate
    assert all(peak(profile, c) <= limit for c in runner.calls)  # nothing over the limit was launched
    changes = lower_memory_changes(baseline.candidate, chosen)
    assert changes and all(any(kind in change for kind in LOWER_MEMORY) for change in changes), changes

    def predictor(limit):
        return Predictor(profile=profile, link=LinkModel.for_device(profile.device), memory_limit_bytes=limit)

    reason = memory_choice_reason(result, predictor(limit))
    assert reason is not None
    assert baseline.candidate.key in reason and chosen.key in reason and changes[0] in reason
    assert "less on the fullest rank" in reason
    assert memory_choice_reason(result, predictor(max(baseline.estimate.peak_memory_bytes))) is None  # it fits
    assert memory_choice_reason(result, predictor(None)) is None

    from autotune.report import write_search_report

    write_search_report(result, spec=None, profile=profile, config_path=None, report_dir=tmp_path / "report",
                        memory_limit_bytes=limit, setup={"gpus": 2, "batch_size": 32})
    markdown = (tmp_path / "report" / "report.md").read_text()
    assert "**Memory limit decided**" in markdown and reason in markdown


def test_lower_memory_changes_name_each_dimension():
    base = Candidate(schedule=Schedule.ONE_F_ONE_B, pipeline_degree=2, global_batch_size=32, n_microbatches=4,
                     layers_per_stage=(6, 4))
    v = Candidate(schedule=Schedule.V_MIN, pipeline_degree=2, global_batch_size=32, n_microbatches=8,
                  layers_per_stage=(3, 2, 3, 2), activation_checkpointing=True, wire_dtype="bfloat16")
    assert lower_memory_changes(base, v) == [
        "the V-Min schedule (about a third of 1F1B's activations in flight)",
        "activation checkpointing (each stage keeps its input and recomputes its forward)",
        "smaller micro-batches (8 of 4 per replica instead of 4 of 8)",
        "bfloat16 between stages (half the receive buffers)",
    ]
    dp = Candidate(schedule=Schedule.ONE_F_ONE_B, pipeline_degree=1, data_parallel_degree=2, global_batch_size=32,
                   n_microbatches=4, layers_per_stage=(10,))
    assert lower_memory_changes(base, dp) == [
        "plain data parallelism over 2 replicas (no pipeline)",
        "smaller micro-batches (4 of 4 per replica instead of 4 of 8)",
    ]
    split = Candidate(schedule=Schedule.ONE_F_ONE_B, pipeline_degree=2, global_batch_size=32, n_microbatches=4,
                      layers_per_stage=(5, 5))
    assert lower_memory_changes(base, split) == ["the split [5, 5] instead of [6, 4]"]
