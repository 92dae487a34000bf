"""The simulator's compute slowdown fitted to a study's own runs (autotune.link_fit), and the search and the report
predicting with it."""

from __future__ import annotations

from dataclasses import replace

import pytest

from autotune.candidate import Candidate
from autotune.link_fit import MIN_TRIALS, fit_link, fitted_predictor, measured_steps, scaled_overheads
from autotune.model_file import load_model_file
from autotune.plan import plan
from autotune.records import TrialRecord
from autotune.schedules import Schedule
from autotune.search import SearchOptions, load_search, run_search
from autotune.simulate import LinkModel, Predictor, simulate
from tests.conftest import RECIPES
from tests.fakes import SimulatedRunner, synthetic_profile


def candidates(n: int) -> list[Candidate]:
    profile = synthetic_profile()
    return [p.candidate for p in plan(profile, gpus=2, batch_size=32, memory_limit_bytes=None)[:n]]


def machine_link(slowdown: float = 0.45) -> LinkModel:
    """The cpu link of a machine whose trials run the profile's blocks slower than the defaults assume."""
    return replace(LinkModel.for_device("cpu"), compute_slowdown=slowdown)


def test_the_fit_finds_the_slowdown_the_machine_pays():
    profile = synthetic_profile()
    given = Predictor(profile=profile, link=LinkModel.for_device("cpu"))
    measured = [(c, simulate(profile, c, link=machine_link()).step_time_ms) for c in candidates(6)]
    fit = fit_link(given, measured)
    assert fit is not None and fit.trials == 6 and fit.moved
    assert fit.compute_slowdown == pytest.approx(0.45)
    assert fit.given_slowdown == given.link.compute_slowdown
    assert fit.error_before > 0.02 and fit.error_after == pytest.approx(0.0, abs=1e-9)
    assert fit.link == machine_link()  # the wire and the per-action and per-message costs are left alone
    assert fit.to_dict()["compute_slowdown"] == fit.compute_slowdown


def test_a_faster_machine_fits_below_the_profile():
    profile = synthetic_profile()
    given = Predictor(profile=profile, link=LinkModel.for_device("cpu"))
    measured = [(c, simulate(profile, c, link=machine_link(-0.2)).step_time_ms) for c in candidates(6)]
    fit = fit_link(given, measured)
    assert fit is not None and fit.compute_slowdown == pytest.approx(-0.2)


def test_a_host_slower_per_action_fits_the_rank_side_costs_not_the_compute():
    """A machine whose Python and dispatch are slower pays more per action, post and wake, not per FLOP: the factor
    on those costs fits it exactly where no compute slowdown can, and is the one kept."""
    profile = synthetic_profile()
    given = Predictor(profile=profile, link=LinkModel.for_device("cpu"))
    host = scaled_overheads(LinkModel.for_device("cpu"), 2.5)
    measured = [(c, simulate(profile, c, link=host).step_time_ms) for c in candidates(6)]
    fit = fit_link(given, measured)
    assert fit is not None and fit.moved
    assert fit.overhead_scale == pytest.approx(2.5) and fit.compute_slowdown == fit.given_slowdown
    assert fit.error_after == pytest.approx(0.0, abs=1e-9) and fit.link == host
    assert "per-action and per-message costs x2.50" in fit.describe()
    assert fit.to_dict()["overhead_scale"] == 2.5
    # the slowdown alone (as the search fitted before) cannot reach it
    alone = fit_link(given, measured, overheads=False)
    assert alone is not None and alone.overhead_scale == 1.0 and alone.error_after > 0.001


def test_no_fit_on_too_few_runs_and_no_change_without_a_gain():
    profile = synthetic_profile()
    given = Predictor(profile=profile, link=LinkModel.for_device("cpu"))
    exact = [(c, given(c).step_time_ms) for c in candidates(MIN_TRIALS)]
    assert fit_link(given, exact[:MIN_TRIALS - 1]) is None
    fit = fit_link(given, exact)
    assert fit is not None and not fit.moved and fit.error_after == pytest.approx(0.0)
    assert fitted_predictor(given, []) == (given, None)


def test_measured_steps_are_the_launched_ok_runs_median_per_candidate():
    a, b, c = candidates(3)

    def record(n, candidate, ms, outcome="ok", launched=True):
        return TrialRecord(number=n, candidate=candidate, outcome=outcome, reason="", step_time_ms=ms,
                           launched=launched)

    records = [record(0, a, 10.0), record(1, a, 30.0), record(2, a, 12.0), record(3, b, 5.0),
               record(4, c, 1.0, outcome="pruned", launched=False), record(5, c, None, outcome="oom")]
    assert measured_steps(records) == [(b, 5.0), (a, 12.0)]


class Phases:
    def __init__(self):
        self.lines = []

    def phase(self, text):
        self.lines.append(text)

    def trial(self, record, best, launched, budget):
        pass


def test_the_search_predicts_with_the_costs_its_runs_show(tmp_path):
    profile = synthetic_profile()
    machine = machine_link()
    runner = SimulatedRunner(link=machine)
    options = SearchOptions(gpus=2, batch_size=32, n_trials=8, seed=1)
    phases = Phases()
    result = run_search(load_model_file(RECIPES / "gpt.py"), profile, plan(profile, gpus=2, batch_size=32,
                        memory_limit_bytes=None), options, study_name="s",
                        storage=f"sqlite:///{tmp_path / 's.db'}", runner=runner, reporter=phases)
    fitted = [line for line in phases.lines if line.startswith("predictions fitted")]
    assert len(fitted) == 1 and "compute x1.45 the profile's (was x1.12" in fitted[0], phases.lines  # said once
    # what the search asked after the fit was predicted with the machine's costs, as was its chosen candidate
    last = [r for r in result.records if r.predicted_throughput_samples_per_s][-1]
    assert last.predicted_throughput_samples_per_s == pytest.approx(
        simulate(profile, last.candidate, link=machine).throughput_samples_per_s)
    assert result.best_estimate.step_time_ms == pytest.approx(
        simulate(profile, result.best.candidate, link=machine).step_time_ms)
    assert Schedule(result.best.candidate.schedule)
    # the stored study predicts the same: its runs give the same fit
    stored, _ = load_search(f"sqlite:///{tmp_path / 's.db'}", "s")
    assert stored.best_estimate.step_time_ms == pytest.approx(result.best_estimate.step_time_ms)


def test_the_report_says_how_far_the_fit_moved_the_predictions(tmp_path):
    from autotune.report.document import Paragraph, build_document
    from autotune.report.facts import gather_facts

    profile = synthetic_profile()
    machine = machine_link()
    options = SearchOptions(gpus=2, batch_size=32, n_trials=8, seed=1)
    result = run_search(load_model_file(RECIPES / "gpt.py"), profile, plan(profile, gpus=2, batch_size=32,
                        memory_limit_bytes=None), options, study_name="s",
                        storage=f"sqlite:///{tmp_path / 's.db'}", runner=SimulatedRunner(link=machine))
    facts = gather_facts(result, profile=profile, memory_limit_bytes=None)
    assert facts.link_fit is not None and facts.link_fit.compute_slowdown == pytest.approx(0.45)
    assert facts.estimate.step_time_ms == pytest.approx(simulate(profile, result.best.candidate,
                                                                 link=machine).step_time_ms)
    text = " ".join(b.text for b in build_document(facts, []) if isinstance(b, Paragraph))
    assert "fitted the simulator's compute to the" in text and "1.45 x the profile's, for 1.12" in text


def test_the_report_says_when_the_fit_scaled_the_rank_side_costs():
    from autotune.link_fit import LinkFit
    from autotune.report.document import _fitted

    link = scaled_overheads(LinkModel.for_device("cpu"), 2.0)
    fit = LinkFit(compute_slowdown=0.12, given_slowdown=0.12, overhead_scale=2.0, trials=8, error_before=0.12,
                  error_after=0.05, link=link)
    text = _fitted(fit)
    assert "per-action and per-message costs" in text and "2.00 x the defaults'" in text and "12% to 5%" in text


def _searched_and_reported(profile, tmp_path):
    """A short simulated search of the gpt recipe on this profile: its stored setup, its report's facts and the
    report's paragraphs as one text."""
    from autotune.report.document import Paragraph, build_document
    from autotune.report.facts import gather_facts

    options = SearchOptions(gpus=2, batch_size=32, n_trials=4, seed=1)
    storage = f"sqlite:///{tmp_path / 's.db'}"
    result = run_search(load_model_file(RECIPES / "gpt.py"), profile, plan(profile, gpus=2, batch_size=32,
                        memory_limit_bytes=None), options, study_name="s", storage=storage,
                        runner=SimulatedRunner(link=LinkModel.for_profile(profile)))
    stored, _ = load_search(storage, "s")
    facts = gather_facts(result, profile=profile, memory_limit_bytes=None, setup=stored.setup)
    return stored.setup, facts, " ".join(b.text for b in build_document(facts, []) if isinstance(b, Paragraph))


def test_a_search_on_a_slower_host_predicts_and_reports_its_per_action_cost(tmp_path):
    """The profile's host probe at twice the development machine's: the study's stored link charges each action
    twice the default overhead, and the report says so."""
    from autotune.simulate import HOST_CALL_REFERENCE_MS

    profile = replace(synthetic_profile(), host_call_ms=2 * HOST_CALL_REFERENCE_MS)
    setup, facts, text = _searched_and_reported(profile, tmp_path)
    assert setup["link"]["per_action_overhead_ms"] == pytest.approx(
        2 * LinkModel.for_device("cpu").per_action_overhead_ms)
    assert facts.host_probe == pytest.approx((2 * HOST_CALL_REFERENCE_MS, 2.0))
    assert "at 77 us a call (38.5 on the machine" in text and "2.00 x their defaults" in text
    assert "slower right after a wait" not in text  # the profile has no idle probe: no such charge, no sentence


def test_a_search_on_a_host_that_resumes_slowly_stores_and_reports_the_idle_charge(tmp_path):
    """The profile's idle probe (Profile.idle_resume_ms) goes into the study's stored link, comes back from the
    storage as it went in, and the report says what it charged."""
    points = ((0.5, 0.2), (20.0, 1.25))
    profile = replace(synthetic_profile(), idle_resume_ms=points, idle_resume_window_ms=1.8)
    setup, _, text = _searched_and_reported(profile, tmp_path)
    assert Predictor.of_setup(profile, setup).link.idle_resume_ms == points
    assert "a 1.8 ms forward and backward took 1.25 ms more after 20 ms idle" in text
