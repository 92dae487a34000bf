"""Measured saved-activation peaks of V-Half and V-Min against 1F1B: real 2-rank CPU trials of a model with equal
layers, the same B/M and the same layers per rank (1F1B: 2 stages of 4 layers; V: 4 stages of 2).

What the action lists predict at pp=2, in units u of one layer's activations for one micro-batch (each layer saves
9u: its input u, then 4u twice inside the MLP): 1F1B's rank 0 holds 2 micro-batches of its 4-layer stage (70u,
the batch itself excluded); V-Half's rank 0 holds 4 two-layer stage activations, the same 70u, because the paper's
V-Half bound (p+2)//2 equals 1F1B's p at pp=2; V-Min's rank 0 holds 2 (36u), about half. So at pp=2 only V-Min meets
the issue's "<= 0.6 x 1F1B" on rank 0, and only there: V-Min's rank 1 holds 72u against 1F1B's 37u, so the most any
rank holds is the same for all three. The saving of the paper shows from pp=4 on (tests/unit/test_vshape.py).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from autotune.candidate import Candidate, Measurement, uniform_split
from autotune.schedules import Schedule, default_stages_per_rank
from autotune.trial import TrialOptions, run_trial
from autotune.trial.memory import SavedActivationBytes
from tests.dist import load_source

WIDTH = 64
EQUAL_LAYERS = f"""
import torch
from torch import nn


def build_model():
    return nn.Sequential(*[
        nn.Sequential(nn.Linear({WIDTH}, {4 * WIDTH}), nn.GELU(), nn.Linear({4 * WIDTH}, {WIDTH})) for _ in range(8)
    ])


def make_batch(batch_size):
    g = torch.Generator().manual_seed(0)
    return torch.randn(batch_size, {WIDTH}, generator=g), torch.randn(batch_size, {WIDTH}, generator=g)


def loss_fn(output, target):
    return nn.functional.mse_loss(output, target)
"""
BATCH, MICROBATCHES = 32, 8
U = BATCH // MICROBATCHES * WIDTH * 4
"""Bytes of one layer's output for one micro-batch (float32)."""


@pytest.fixture(scope="module")
def measured(tmp_path_factory: pytest.TempPathFactory) -> dict[Schedule, Measurement]:
    spec = load_source(tmp_path_factory.mktemp("vshape"), "equal_layers.py", EQUAL_LAYERS)
    results = {}
    for schedule in (Schedule.ONE_F_ONE_B, Schedule.V_HALF, Schedule.V_MIN):
        candidate = Candidate(
            schedule=schedule,
            pipeline_degree=2,
            global_batch_size=BATCH,
            n_microbatches=MICROBATCHES,
            layers_per_stage=uniform_split(spec.n_layers, 2 * default_stages_per_rank(schedule)),
        )
        results[schedule] = run_trial(spec, candidate, TrialOptions(steps=2, warmup=1, device="cpu"))
    return results


@pytest.mark.dist
def test_trials_report_activation_peaks_per_rank(measured):
    for schedule, m in measured.items():
        assert m.status == "ok", (schedule, m.error)
        assert len(m.peak_activation_bytes) == 2
        assert all(0 < a < total for a, total in zip(m.peak_activation_bytes, m.peak_memory_bytes))


@pytest.mark.dist
def test_rank0_activation_peaks_against_1f1b(measured):
    one_f_one_b = measured[Schedule.ONE_F_ONE_B].peak_activation_bytes[0]
    v_half = measured[Schedule.V_HALF].peak_activation_bytes[0]
    v_min = measured[Schedule.V_MIN].peak_activation_bytes[0]
    assert one_f_one_b == 70 * U
    assert v_min <= 0.6 * one_f_one_b  # the target, met by V-Min at pp=2
    assert v_min < v_half
    # V-Half's bound equals 1F1B's at pp=2 ((p+2)//2 = p): the same bytes, not the 0.6 (see module doc).
    assert v_half == pytest.approx(one_f_one_b, rel=0.05)
    assert v_min == pytest.approx(36 * U, rel=0.05)


@pytest.mark.dist
def test_v_min_moves_activations_to_rank1_at_pp2(measured):
    """At pp=2 V-Min relieves rank 0 by loading rank 1: the most any rank holds does not drop."""
    one_f_one_b = measured[Schedule.ONE_F_ONE_B].peak_activation_bytes
    v_min = measured[Schedule.V_MIN].peak_activation_bytes
    assert v_min[1] > one_f_one_b[1]
    assert max(v_min) == pytest.approx(max(one_f_one_b), rel=0.05)


def test_saved_activation_bytes_counts_each_storage_once_until_backward():
    model = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH), nn.Tanh())
    x = torch.randn(8, WIDTH)
    with SavedActivationBytes(exclude=[x]) as tracker:
        y = model(x)
        # Two tanh outputs, each saved twice (by tanh and by the next Linear) but counted once; the weights and the
        # excluded input are not counted.
        assert tracker.live_bytes == 2 * 8 * WIDTH * 4
        y.sum().backward()
        assert tracker.live_bytes == 0
    assert tracker.peak_bytes == 2 * 8 * WIDTH * 4


def test_measurement_round_trips_activation_peaks():
    candidate = Candidate(
        schedule=Schedule.V_HALF, pipeline_degree=2, global_batch_size=8, n_microbatches=4, layers_per_stage=(1,) * 4
    )
    m = Measurement(candidate=candidate, status="ok", peak_memory_bytes=(10, 20), peak_activation_bytes=(3, 4))
    assert Measurement.from_dict(m.to_dict()) == m
    older = m.to_dict()
    del older["peak_activation_bytes"]
    assert Measurement.from_dict(older).peak_activation_bytes == ()
