"""Faults are data: a last layer that raises, hangs, cannot allocate or dies is attributed to its rank, and no rank
process outlives the trial (nor a tuner killed with SIGKILL)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from autotune.candidate import Candidate
from autotune.model_file import load_model_file
from autotune.schedules import Schedule
from autotune.study_storage import process_gone
from autotune.trial import TrialOptions, run_trial
from tests.conftest import rank_pids

pytestmark = pytest.mark.dist

# The last layer misbehaves only on rank 1 (the worker sets RANK as torchrun does), not in the tuner's model check.
ON_LAST_RANK = "if os.environ.get('RANK') == '1':\n    {}"


def trial(path, **options):
    spec = load_model_file(path)
    candidate = Candidate(
        schedule=Schedule.ONE_F_ONE_B, pipeline_degree=2, global_batch_size=8, n_microbatches=2,
        layers_per_stage=(2, 2),
    )
    return run_trial(spec, candidate, TrialOptions(steps=2, warmup=1, **options))


def assert_no_rank_left(path):
    pids = set(rank_pids(path))
    assert len(pids) == 3  # this process's meta build + two ranks
    deadline = time.time() + 10
    while time.time() < deadline and not all(process_gone(pid) for pid in pids if pid != os.getpid()):
        time.sleep(0.1)
    assert all(process_gone(pid) for pid in pids if pid != os.getpid())


def test_healthy_trial_measures(model_file):
    path = model_file()
    m = trial(path)
    assert m.status == "ok", m.error
    assert m.step_time_ms > 0 and len(m.step_times_ms) == 2
    assert m.throughput_samples_per_s == pytest.approx(8 / (m.step_time_ms / 1000))
    assert len(m.peak_memory_bytes) == 2 and all(b > 0 for b in m.peak_memory_bytes)
    assert m.loss is not None and m.loss > 0
    assert_no_rank_left(path)


def test_raising_layer_is_an_error_on_rank_1(model_file):
    path = model_file(ON_LAST_RANK.format("raise ValueError('boom in the last layer')"))
    m = trial(path)
    assert m.status == "error"
    assert m.error.rank == 1 and m.error.kind == "error"
    assert "boom in the last layer" in m.error.message and "model.py" in m.error.message
    assert_no_rank_left(path)


def test_hanging_layer_times_out_on_rank_1(model_file):
    path = model_file(ON_LAST_RANK.format("time.sleep(600)"))
    m = trial(path, timeout_s=8)
    assert m.status == "timeout"
    assert m.error.rank == 1 and m.error.kind == "timeout"
    # blamed by the ranks' progress or, where progress cannot tell (which differs by torch version), by the stacks
    assert ("rank 1 hung outside torch.distributed" in m.error.message
            or "rank 1 hung: by every rank's progress, it was stuck in its own work" in m.error.message)
    assert m.wall_time_s < 20
    assert_no_rank_left(path)


def test_a_hang_in_a_later_step_is_blamed_by_progress(model_file):
    # Rank 1's last layer hangs on its 5th call: after the first steps, while rank 0 waits for its gradient.
    hang = "_calls = globals().setdefault('_calls', [0])\n    _calls[0] += 1\n    if _calls[0] >= 5:\n        time.sleep(600)"
    path = model_file(ON_LAST_RANK.format(hang))
    m = trial(path, timeout_s=15)
    assert m.status == "timeout"
    assert m.error.rank == 1
    assert "rank 1 hung: by every rank's progress, it was stuck in its own work" in m.error.message, m.error
    assert_no_rank_left(path)


@pytest.mark.parametrize(("schedule", "microbatches"), [
    (Schedule.INTERLEAVED_ZERO_BUBBLE, 4),  # two stages per rank, backward split into I and W
    (Schedule.ZBV_ZERO_BUBBLE, 2),  # V placement
])
def test_every_rank_counts_each_action_of_its_schedule(model_file, tmp_path, monkeypatch, schedule, microbatches):
    # What hang blame by progress reads: after a healthy trial, each rank ran the schedule once per step and
    # completed every action of its list in the last run.
    import tempfile

    from autotune.schedules import action_lists
    from autotune.trial.progress import read_progress

    runs = tmp_path / "runs"
    runs.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(runs))
    path = model_file()
    candidate = Candidate(schedule=schedule, pipeline_degree=2, global_batch_size=8, n_microbatches=microbatches,
                          layers_per_stage=(1, 1, 1, 1))
    m = run_trial(load_model_file(path), candidate, TrialOptions(steps=2, warmup=1, keep_run_dir=True))
    assert m.status == "ok", m.error
    (run_dir,) = runs.glob("autotune-trial-*")
    lists = action_lists(schedule, 2, microbatches, 4)
    assert [read_progress(run_dir, r) for r in (0, 1)] == [(1 + 1 + 2, 0, len(lists[r])) for r in (0, 1)]


def test_allocation_failure_is_oom_on_rank_1_with_bytes(model_file):
    path = model_file(ON_LAST_RANK.format("torch.empty(2**50)"))
    m = trial(path)
    assert m.status == "oom"
    assert m.error.rank == 1 and m.error.bytes_requested == 2**52
    assert_no_rank_left(path)


def test_nccl_out_of_memory_is_oom_on_rank_1_with_bytes(model_file):
    # What ProcessGroupNCCL raises when NCCL cannot allocate its buffers (it gave `error` before).
    nccl = ("NCCL error in: ProcessGroupNCCL.cpp:3356, unhandled cuda error (run with NCCL_DEBUG=INFO for details), "
            "NCCL version 2.21.5\\nncclUnhandledCudaError: Call to CUDA function failed.\\nLast error:\\n"
            "Failed to CUDA calloc 6291456 bytes")
    path = model_file(ON_LAST_RANK.format(f"raise torch.distributed.DistBackendError('{nccl}')"))
    m = trial(path)
    assert m.status == "oom", m.error
    assert m.error.rank == 1 and m.error.bytes_requested == 6291456
    assert_no_rank_left(path)


def test_tracked_peak_over_the_memory_limit_is_oom(model_file):
    path = model_file()
    m = trial(path, memory_limit_bytes=4096)
    assert m.status == "oom"
    assert m.error.kind == "oom" and m.error.bytes_requested > 4096
    assert_no_rank_left(path)


def test_rank_killed_without_an_error_is_blamed(model_file):
    path = model_file(ON_LAST_RANK.format("os.kill(os.getpid(), 9)"))
    m = trial(path)
    assert m.status == "error"
    assert m.error.rank == 1 and "killed by signal 9" in m.error.message
    assert_no_rank_left(path)


def test_sigkilled_tuner_leaves_no_orphans(model_file):
    path = model_file(ON_LAST_RANK.format("time.sleep(600)"))
    tuner = subprocess.Popen(
        [sys.executable, "-m", "autotune.cli", "trial", str(path), "--gpus", "2", "--device", "cpu",
         "--batch-size", "8", "--microbatches", "2", "--schedule", "1F1B", "--timeout", "600"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.time() + 60
        while len(set(rank_pids(path)) - {tuner.pid}) < 2 and time.time() < deadline:
            time.sleep(0.2)
        ranks = set(rank_pids(path)) - {tuner.pid}  # the tuner itself builds the model on the meta device first
        assert len(ranks) == 2
    finally:
        tuner.send_signal(signal.SIGKILL)
        tuner.wait()
    deadline = time.time() + 10
    while time.time() < deadline and not all(process_gone(pid) for pid in ranks):
        time.sleep(0.1)
    assert all(process_gone(pid) for pid in ranks)
