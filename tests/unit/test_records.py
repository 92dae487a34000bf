"""summarize(): one rule for the live search and the stored one; records from stored attributes; torch-free data."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

from autotune.candidate import Candidate, Measurement, TrialError
from autotune.records import TrialRecord, summarize
from autotune.schedules import Schedule
from autotune.study_storage import record_from_attrs

A = Candidate(schedule=Schedule.GPIPE, pipeline_degree=2, global_batch_size=32, n_microbatches=4,
              layers_per_stage=(4, 4))
B = Candidate(schedule=Schedule.ONE_F_ONE_B, pipeline_degree=2, global_batch_size=32, n_microbatches=8,
              layers_per_stage=(3, 5))


def run(candidate: Candidate, step_ms: float, peaks: tuple[int, ...] = (10, 20)) -> Measurement:
    return Measurement(candidate=candidate, status="ok", step_time_ms=step_ms, step_times_ms=(step_ms,),
                       throughput_samples_per_s=32 / step_ms * 1000, peak_memory_bytes=peaks)


def record(number: int, candidate: Candidate, step_ms: float | None, outcome: str = "ok",
           launched: bool = True) -> TrialRecord:
    return TrialRecord(number=number, candidate=candidate, outcome=outcome, reason="", step_time_ms=step_ms,
                       launched=launched)


def test_the_best_trial_is_a_run_of_the_best_median_not_the_fastest_single_run():
    runs = {A.key: [run(A, 5.0), run(A, 30.0), run(A, 31.0)], B.key: [run(B, 10.0, (30, 5)), run(B, 11.0, (20, 9))]}
    records = [record(0, A, 5.0), record(1, B, 10.0), record(2, B, 10.0, "duplicate", launched=False),
               record(3, A, 30.0), record(4, B, 11.0), record(5, A, 31.0), record(6, A, None, "pruned", False)]
    summary = summarize(records, runs)
    assert [leader.candidate for leader in summary.leaders] == [B, A]
    assert summary.best.candidate == B and summary.best.step_time_ms == 10.5  # the median of its two runs
    assert summary.best.peak_memory_bytes == (30, 9)  # per rank, the highest over its runs
    assert summary.best_trial == 1  # B's first real run; the fastest single run (0) is A's
    assert summary.launched == 5 and not summary.too_noisy


C = Candidate(schedule=Schedule.INTERLEAVED_1F1B, pipeline_degree=2, global_batch_size=32, n_microbatches=4,
              layers_per_stage=(2, 2, 2, 2))


def test_the_best_is_chosen_among_the_leaders_re_run_side_by_side():
    # the skewed MLP's miss: C ran once in a quiet minute and was fourth; A and B were re-run in a busier one
    runs = {A.key: [run(A, 11.5), run(A, 13.9)], B.key: [run(B, 11.4), run(B, 16.5)], C.key: [run(C, 12.6)]}
    records = [record(0, A, 11.5), record(1, B, 11.4), record(2, C, 12.6)]
    assert summarize(records, runs).best.candidate == C  # no side-by-side runs: the fastest median of all
    rerun = [dataclasses.replace(record(3, B, 16.5), phase="remeasure"),
             dataclasses.replace(record(4, A, 13.9), phase="remeasure")]
    summary = summarize(records + rerun, runs)
    assert [leader.candidate for leader in summary.leaders] == [A, B, C]
    assert summary.best.candidate == A and summary.best.step_time_ms == 12.7 and summary.best_trial == 0
    # one leader re-run (the budget or a Ctrl-C cut the round short) is no side-by-side comparison
    assert summarize(records + rerun[1:], runs).best.candidate == C


def test_nothing_ran_ok():
    failed = Measurement(candidate=A, status="oom")
    summary = summarize([record(0, A, None, "oom")], {A.key: [failed]})
    assert (summary.best, summary.best_trial, summary.leaders, summary.launched) == (None, None, (), 1)


def test_overlapping_leaders_are_too_noisy_to_separate():
    runs = {A.key: [run(A, 10.0), run(A, 10.4)], B.key: [run(B, 10.1), run(B, 10.3)]}
    assert summarize([record(0, A, 10.0), record(1, B, 10.1)], runs).too_noisy


def test_stored_records_by_state():
    attrs = {"candidate": A.to_dict(), "outcome": "ok", "reason": "", "launched": True,
             "measurement": run(A, 5.0).to_dict(), "phase": "seed"}
    assert record_from_attrs(3, attrs, "complete").outcome == "ok"
    assert record_from_attrs(3, attrs, "complete").losses == ()  # stored before trials recorded their losses
    attrs["measurement"] = dataclasses.replace(run(A, 5.0), losses=(2.5, 2.25, 2.0)).to_dict()
    assert record_from_attrs(3, attrs, "complete").losses == (2.5, 2.25, 2.0)
    running = record_from_attrs(4, {"candidate": A.to_dict(), "launched": True}, "running")
    assert (running.outcome, running.reason) == ("interrupted", "stopped before it finished")
    died = record_from_attrs(5, {"candidate": A.to_dict(), "launched": True}, "fail")
    assert (died.outcome, died.reason) == ("interrupted", "the tuner died during this trial")


def test_the_data_layer_imports_neither_torch_nor_optuna():
    code = (
        "import sys; sys.modules['torch'] = None; sys.modules['optuna'] = None\n"
        "import autotune.plan, autotune.simulate, autotune.records, autotune.report, autotune.report.reasons\n"
        "import autotune.tuned_config, autotune.config_file, autotune.exports, autotune.memory_model\n"
        "import autotune.layouts\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


def test_nothing_fits_quotes_what_the_runs_measured_not_a_prediction():
    from dataclasses import replace

    from autotune.records import SearchResult, explain_infeasible

    MiB = 2**20
    oom = Measurement(candidate=A, status="oom",
                      error=TrialError(rank=1, kind="oom", message="over the limit", bytes_requested=268 * MiB))
    attrs = {"candidate": A.to_dict(), "outcome": "oom", "launched": True, "measurement": oom.to_dict(),
             "predicted": {"peak_memory_bytes": [312 * 1024, 300 * 1024]}}
    records = [record_from_attrs(0, attrs),
               replace(record(1, B, None, "pruned", launched=False), predicted_peak_memory_bytes=(312 * 1024,))]
    result = SearchResult.of(summarize(records, {}), study_name="s", storage="sqlite://", records=records,
                             best_estimate=None, wall_time_s=0.0)
    message = str(explain_infeasible(result, 100 * MiB))
    assert "needed more than 268.0 MiB (measured" in message and "312" not in message
