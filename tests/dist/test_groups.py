"""Process groups are made once per layout in a process that runs several pipelines under one default group (2 CPU
ranks, gloo): the pp x dp mesh and the tied-parameter groups are reused, not made again for the same layout.

A search's trials each run in fresh rank processes (autotune.trial.launch forks them per trial), so there a trial
makes its groups once; these are the processes that persist: runtime users rebuilding a pipeline, and run_jobs."""

from __future__ import annotations

import json
import textwrap

import pytest
import torch

from autotune.candidate import Candidate
from autotune.schedules import Schedule
from tests.dist import spawn_ranks

pytestmark = pytest.mark.dist

TIED = '''
import torch
from torch import nn


def build_model():
    embedding, head = nn.Embedding(16, 8), nn.Linear(8, 16, bias=False)
    head.weight = embedding.weight  # tied: the first and the last block hold one parameter
    return nn.Sequential(embedding, nn.Linear(8, 8), nn.Linear(8, 8), head)


def make_batch(batch_size):
    generator = torch.Generator().manual_seed(batch_size)
    return (torch.randint(0, 16, (batch_size, 4), generator=generator),
            torch.randint(0, 16, (batch_size, 4), generator=generator))


def loss_fn(output, target):
    return nn.functional.cross_entropy(output.reshape(-1, 16), target.reshape(-1))
'''


def test_same_layout_makes_its_groups_once(tmp_path):
    from tests.dist import grad_worker

    model = tmp_path / "tied.py"
    model.write_text(textwrap.dedent(TIED))
    pipeline = dict(pipeline_degree=2, global_batch_size=8, layers_per_stage=(2, 2))
    replicas = dict(pipeline_degree=1, data_parallel_degree=2, global_batch_size=8, layers_per_stage=(4,))
    candidates = [
        Candidate(schedule=Schedule.ONE_F_ONE_B, n_microbatches=2, **pipeline),
        Candidate(schedule=Schedule.GPIPE, n_microbatches=4, **pipeline),  # same layout, other schedule
        Candidate(schedule=Schedule.GPIPE, n_microbatches=2, **replicas),
        Candidate(schedule=Schedule.GPIPE, n_microbatches=1, **replicas),  # same layout again
    ]
    jobs = []
    for i, c in enumerate(candidates):
        (tmp_path / str(i)).mkdir()
        jobs.append({"model": str(model), "candidate": c.to_dict(), "out": str(tmp_path / str(i))})
    codes = spawn_ranks(grad_worker.run_jobs, lambda rank: (rank, 2, jobs, str(tmp_path)), 2, timeout=120)
    assert codes == [0, 0]
    for rank in range(2):
        # The tied parameter's group across the two stages, made for the first job only; the pp x dp mesh, made for
        # the third only.
        assert json.loads((tmp_path / f"groups-{rank}.json").read_text()) == [1, 1, 2, 2]
    # The reused group still carries the tied gradient: both ranks hold the same summed gradient of it.
    first, last = (torch.load(tmp_path / "1" / f"grads-{rank}.pt") for rank in range(2))
    torch.testing.assert_close(first["0.weight"], last["0.weight"])
