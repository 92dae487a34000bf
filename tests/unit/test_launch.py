"""A trial's time bounds: derived from its predicted step time, a hang always bounded; torch.distributed's own
timeout kept apart; the CPU threads each rank gets."""

from __future__ import annotations

import math

import pytest

from autotune.devices import rank_threads
from autotune.trial.launch import (
    PROCESS_GROUP_MARGIN_S,
    TRIAL_TIMEOUT_FLOOR_S,
    TrialOptions,
    process_group_timeout_s,
    trial_timeout_s,
)


def test_a_60_s_step_trial_fits_its_bound_under_the_default_flags():
    defaults = TrialOptions()  # what `autotune search` gives each trial: 2 warm-up steps, 5 measured
    bound = trial_timeout_s(defaults, predicted_step_s=60.0)
    # What the rank runs: 2 warm-up steps (one memory-tracked), 1 more untracked, 5 measured = 8 steps of 60 s.
    # Even 50 % slower than predicted, after 2 minutes of set-up, it is within the bound; the old fixed 300 s
    # bound did not cover its steps alone.
    runs_s = 120 + 8 * 60.0 * 1.5
    assert bound > runs_s > TRIAL_TIMEOUT_FLOOR_S
    assert bound == pytest.approx(120 + 3 * 9 * 60.0)


def test_the_bound_grows_with_steps_and_the_bf16_twin():
    base = trial_timeout_s(TrialOptions(), 10.0)
    assert trial_timeout_s(TrialOptions(steps=10), 10.0) == pytest.approx(base + 3 * 5 * 10.0)
    assert trial_timeout_s(TrialOptions(measure_wire_error=True), 10.0) == pytest.approx(base + 3 * 2 * 10.0)


@pytest.mark.parametrize("predicted", [0.0, 0.001, 1.0, math.inf, math.nan, -1.0])
def test_a_hang_is_still_bounded(predicted):
    bound = trial_timeout_s(TrialOptions(), predicted)
    assert math.isfinite(bound)
    assert bound == TRIAL_TIMEOUT_FLOOR_S  # fast or unknown steps: the floor (the old fixed default)


def test_the_process_group_timeout_is_apart_from_the_trials():
    assert process_group_timeout_s(TrialOptions(timeout_s=1740.0)) == 1740.0 + PROCESS_GROUP_MARGIN_S
    assert process_group_timeout_s(TrialOptions(timeout_s=1740.0, process_group_timeout_s=600.0)) == 600.0


def test_cuda_ranks_share_the_cores_and_cpu_ranks_keep_one():
    assert rank_threads("cuda", cores=64, ranks_here=8) == 8
    assert rank_threads("cuda", cores=6, ranks_here=8) == 1
    assert rank_threads("cpu", cores=64, ranks_here=2) == 1
