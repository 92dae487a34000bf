"""One pipelined step's gradients equal a single-process reference, for every schedule (2 CPU ranks, gloo)."""

from __future__ import annotations


import pytest
import torch

from autotune.candidate import Candidate, uniform_split
from autotune.model_file import build_blocks, load_model_file, make_batch
from autotune.schedules import Schedule, default_stages_per_rank
from tests.conftest import RECIPES
from tests.dist import spawn_ranks

pytestmark = pytest.mark.dist


def reference_grads(spec, candidate):
    """Unpipelined: the mean over replicas and micro-batches of the micro-batch losses, backpropagated."""
    model = build_blocks(spec).model
    inputs, targets = make_batch(spec, candidate.global_batch_size)
    chunks = candidate.n_microbatches * candidate.data_parallel_degree
    loss = sum(spec.loss_fn(model(x), y) for x, y in zip(inputs.chunk(chunks), targets.chunk(chunks))) / chunks
    loss.backward()
    return {name: p.grad for name, p in model.named_parameters()}


def pipelined_grads(spec, candidate, tmp_path):
    from tests.dist import grad_worker

    codes = spawn_ranks(
        grad_worker.run,
        lambda rank: (rank, candidate.world_size, str(spec.path), candidate.to_dict(), str(tmp_path)),
        candidate.world_size,
        timeout=120,
    )
    assert codes == [0] * candidate.world_size
    grads = {}
    for rank in range(candidate.world_size):
        for name, grad in torch.load(tmp_path / f"grads-{rank}.pt").items():
            grads.setdefault(name, grad)  # replicas hold the same (all-reduced) gradient
    return grads


@pytest.mark.parametrize("schedule", list(Schedule), ids=lambda s: s.value)
def test_pipelined_gradients_match_reference(schedule, tmp_path):
    spec = load_model_file(RECIPES / "mlp.py")
    candidate = Candidate(
        schedule=schedule,
        pipeline_degree=2,
        global_batch_size=16,
        n_microbatches=4,
        layers_per_stage=uniform_split(spec.n_layers, 2 * default_stages_per_rank(schedule)),
    )
    got = pipelined_grads(spec, candidate, tmp_path)
    want = reference_grads(spec, candidate)
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-6, msg=name)


def test_data_parallel_pipeline_gradients_match_reference(tmp_path):
    """pp=1 x dp=2: plain data parallelism, gradients averaged over replicas."""
    spec = load_model_file(RECIPES / "gpt.py")
    candidate = Candidate(
        schedule=Schedule.GPIPE, pipeline_degree=1, data_parallel_degree=2, global_batch_size=8, n_microbatches=2,
        layers_per_stage=(spec.n_layers,),
    )
    got = pipelined_grads(spec, candidate, tmp_path)
    want = reference_grads(spec, candidate)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("order", ["pp-inner", "dp-inner"])
def test_pipelines_of_replicas_in_either_rank_order_match_reference(order, tmp_path):
    """pp=2 x dp=2, the grid filled pipelines-first or replicas-first (placement.RankOrder): same gradients."""
    spec = load_model_file(RECIPES / "mlp.py")
    candidate = Candidate(
        schedule=Schedule.ONE_F_ONE_B, pipeline_degree=2, data_parallel_degree=2, global_batch_size=16,
        n_microbatches=2, layers_per_stage=uniform_split(spec.n_layers, 2), rank_order=order,
    )
    got = pipelined_grads(spec, candidate, tmp_path)
    want = reference_grads(spec, candidate)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-6, msg=name)


TRANSPOSING = """
import torch
from torch import nn

class Transposed(nn.Module):  # hands the next stage a non-contiguous tensor, and gets one back as its gradient
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(6, 6)
    def forward(self, x):
        return self.linear(x).transpose(1, 2)

def build_model():
    return nn.Sequential(Transposed(), Transposed(), Transposed(), Transposed())

def make_batch(batch_size):
    g = torch.Generator().manual_seed(0)
    return torch.randn(batch_size, 6, 6, generator=g), torch.randn(batch_size, 6, 6, generator=g)

def loss_fn(output, target):
    return nn.functional.mse_loss(output, target)
"""


@pytest.mark.parametrize("schedule", [Schedule.ONE_F_ONE_B, Schedule.ZBV_ZERO_BUBBLE], ids=lambda s: s.value)
def test_non_contiguous_activations_and_gradients_cross_stages(schedule, tmp_path):
    path = tmp_path / "transposing.py"
    path.write_text(TRANSPOSING)
    spec = load_model_file(path)
    candidate = Candidate(schedule=schedule, pipeline_degree=2, global_batch_size=8, n_microbatches=4,
                          layers_per_stage=uniform_split(4, 2 * default_stages_per_rank(schedule)))
    got = pipelined_grads(spec, candidate, tmp_path)
    want = reference_grads(spec, candidate)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-6, msg=name)
