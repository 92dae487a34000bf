"""A trial's rank keeps only the micro-batches it consumes: the first stage's inputs where that stage is, the targets
where the last one is, its replica's rows of them (2 CPU ranks, the tracker's live tensor bytes)."""

from __future__ import annotations

import textwrap

import pytest

from autotune.candidate import Candidate
from autotune.schedules import Schedule
from autotune.trial import TrialOptions, run_trial
from tests.dist import load_source

pytestmark = pytest.mark.dist

FEATURES = 2048
ROWS = 2048
INPUT_BYTES = ROWS * FEATURES * 4
"""The global batch's inputs: 16 MiB, far above everything else a rank of this model holds (~0.2 MiB)."""

MODEL = f'''
import torch
from torch import nn


def build_model():
    return nn.Sequential(nn.Linear({FEATURES}, 8), nn.ReLU(), nn.Linear(8, 8), nn.Linear(8, 4))


def make_batch(batch_size):
    generator = torch.Generator().manual_seed(0)
    return torch.randn(batch_size, {FEATURES}, generator=generator), torch.randint(0, 4, (batch_size,))


def loss_fn(output, target):
    return nn.functional.cross_entropy(output, target)
'''


@pytest.fixture(scope="module")
def spec(tmp_path_factory):
    return load_source(tmp_path_factory.mktemp("model"), "wide_input.py", textwrap.dedent(MODEL))


def test_only_the_first_stage_holds_the_inputs(spec):
    """pp 2: rank 0 holds the inputs (all its micro-batches), rank 1 only the targets (it used to hold them all)."""
    candidate = Candidate(schedule=Schedule.ONE_F_ONE_B, pipeline_degree=2, global_batch_size=ROWS,
                          n_microbatches=4, layers_per_stage=(2, 2))
    m = run_trial(spec, candidate, TrialOptions(steps=1, warmup=1))
    assert m.status == "ok", m.error
    first, last = m.peak_memory_bytes
    assert first > INPUT_BYTES  # the tracker sees the batch where it is
    assert last < INPUT_BYTES / 8


def test_a_replica_holds_its_rows_only(spec):
    """pp 1 x dp 2: each rank holds its replica's half of the inputs, not the global batch."""
    candidate = Candidate(schedule=Schedule.GPIPE, pipeline_degree=1, data_parallel_degree=2,
                          global_batch_size=ROWS, n_microbatches=2, layers_per_stage=(4,))
    m = run_trial(spec, candidate, TrialOptions(steps=1, warmup=1))
    assert m.status == "ok", m.error
    for peak in m.peak_memory_bytes:
        # The old code held the global batch and a copy of its replica's rows in the step (>= 1.5x INPUT_BYTES).
        # On torch 2.14 a rank peaks at its half (0.5-0.75x); on torch 2.11 one more replica-sized tensor is alive
        # during the step (~1.0x; not yet traced to its owner), so the bound is the one both versions keep.
        assert INPUT_BYTES / 2 < peak < INPUT_BYTES * 1.25
