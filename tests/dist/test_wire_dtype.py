"""bf16 between stages: gradients stay within a few tenths of a percent of float32, and a trial says by how much."""

from __future__ import annotations

import pytest
import torch

from autotune.candidate import Candidate
from autotune.model_file import load_model_file
from autotune.schedules import Schedule
from autotune.trial import TrialOptions, run_trial
from tests.conftest import RECIPES
from tests.dist.test_gradients import pipelined_grads, reference_grads

pytestmark = pytest.mark.dist


def bf16_candidate(spec, schedule=Schedule.ONE_F_ONE_B, split=None):
    return Candidate(
        schedule=schedule, pipeline_degree=2, global_batch_size=16, n_microbatches=4,
        layers_per_stage=split or (5, 5), wire_dtype="bfloat16",
    )


def test_trial_reports_the_bf16_gradient_error():
    spec = load_model_file(RECIPES / "mlp.py")
    measured = run_trial(spec, bf16_candidate(spec), TrialOptions(steps=1, warmup=2, measure_wire_error=True))
    assert measured.status == "ok", measured.error
    assert measured.wire_grad_rel_error is not None
    assert 0 < measured.wire_grad_rel_error < 0.05  # notes/torch-pipelining.md: 0.2-0.4 % expected


@pytest.mark.parametrize(("schedule", "split"), [(Schedule.ONE_F_ONE_B, (5, 5)), (Schedule.V_HALF, (3, 2, 2, 3))],
                         ids=["1F1B", "VHalf"])
def test_bf16_pipeline_gradients_are_close_to_the_reference(schedule, split, tmp_path):
    spec = load_model_file(RECIPES / "mlp.py")
    candidate = bf16_candidate(spec, schedule, split)
    got = pipelined_grads(spec, candidate, tmp_path)
    want = reference_grads(spec, candidate)
    assert got.keys() == want.keys()
    total_diff = total = 0.0
    for name in want:
        scale = float(want[name].abs().max())
        torch.testing.assert_close(got[name], want[name], rtol=1e-2, atol=1e-2 * scale, msg=name)
        total_diff += float((got[name] - want[name]).double().square().sum())
        total += float(want[name].double().square().sum())
    assert 0 < (total_diff / total) ** 0.5 < 0.02  # bf16 really travelled, and it cost little
