"""A model autotune cuts itself (torch.fx between repeated blocks; no optional package): a side input reaches every
stage and two tensors cross every cut (a skip from the stem to the head). One pipelined step's gradients equal the
model's own, under a loop and a V schedule (2 CPU ranks, gloo)."""

from __future__ import annotations

import pytest
import torch

from autotune.candidate import Candidate, uniform_split
from autotune.model_file import build_blocks, make_batch
from autotune.schedules import Schedule, default_stages_per_rank
from tests.dist import load_source
from tests.dist.test_gradients import pipelined_grads

pytestmark = pytest.mark.dist

SKIP_MODEL = """
import torch
from torch import nn

class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)
    def forward(self, x):
        return torch.tanh(self.lin(x))

class Skippy(nn.Module):
    # A U-shaped skip: the stem's output is added back after the last block, so two tensors cross every cut.
    def __init__(self):
        super().__init__()
        self.stem = nn.Linear(8, 16)
        self.blocks = nn.ModuleList(Block() for _ in range(4))
        self.head = nn.Linear(16, 4)
    def forward(self, x, scale):
        h0 = self.stem(x)
        h = h0
        for block in self.blocks:
            h = block(h) * scale[:, None]
        return self.head(h + h0)

def build_model():
    return Skippy()

def make_batch(batch_size):
    g = torch.Generator().manual_seed(batch_size)
    inputs = (torch.randn(batch_size, 8, generator=g), torch.rand(batch_size, generator=g) + 0.5)
    return inputs, torch.randn(batch_size, 4, generator=g)

def loss_fn(out, y):
    return nn.functional.mse_loss(out, y)
"""


@pytest.mark.parametrize("schedule", [Schedule.ONE_F_ONE_B, Schedule.ZBV_ZERO_BUBBLE], ids=lambda s: s.value)
def test_a_traced_model_with_a_side_input_and_a_skip_pipelines_exactly(schedule, tmp_path):
    spec = load_source(tmp_path, "skippy.py", SKIP_MODEL)
    assert spec.family == "traced" and spec.block_names == ("stem", "blocks.0", "blocks.1", "blocks.2", "blocks.3",
                                                              "head")
    candidate = Candidate(schedule=schedule, pipeline_degree=2, global_batch_size=8, n_microbatches=4,
                          layers_per_stage=uniform_split(spec.n_layers, 2 * default_stages_per_rank(schedule)))
    got = pipelined_grads(spec, candidate, tmp_path)

    model = build_blocks(spec).model
    (x, scale), y = make_batch(spec, candidate.global_batch_size)
    k = candidate.n_microbatches
    loss = sum(spec.loss_fn(model(a, s), t) for a, s, t in zip(x.chunk(k), scale.chunk(k), y.chunk(k))) / k
    loss.backward()
    want = {name: p.grad for name, p in model.named_parameters()}
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-6, msg=name)
