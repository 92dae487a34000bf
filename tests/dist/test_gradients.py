"""One pipelined step's gradients equal a single-process reference, for every schedule (2 CPU ranks, gloo), and with
FSDP2-sharded replicas (pp 2 x dp 2, 4 ranks); bf16 trains as float32 does."""

from __future__ import annotations

import pytest
import torch

from autotune.candidate import Candidate, uniform_split
from autotune.model_file import build_blocks, load_model_file, make_batch
from autotune.schedules import SYNCHRONOUS_SCHEDULES, Schedule, default_stages_per_rank
from tests.conftest import RECIPES
from tests.dist import load_source, spawn_ranks

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


@pytest.mark.parametrize("schedule", SYNCHRONOUS_SCHEDULES, ids=lambda s: s.value)
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
    spec = load_source(tmp_path, "transposing.py", TRANSPOSING)
    candidate = Candidate(schedule=schedule, pipeline_degree=2, global_batch_size=8, n_microbatches=4,
                          layers_per_stage=uniform_split(4, 2 * default_stages_per_rank(schedule)))
    got = pipelined_grads(spec, candidate, tmp_path)
    want = reference_grads(spec, candidate)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-6, msg=name)


# --- sharded data parallel (FSDP2) and bf16: pp 2 x dp 2, every job in one 4-rank launch --------------------------

TIED = """
import torch
from torch import nn

def build_model():  # the first and the last layer share their weight, as GPT-2's embedding and head; 5 rows: FSDP2
    first, last = nn.Linear(6, 5), nn.Linear(6, 5)  # shards them 3 + 2 over 2 replicas
    last.weight = first.weight
    return nn.Sequential(first, nn.Tanh(), nn.Linear(5, 6), nn.Tanh(), last)

def make_batch(batch_size):
    g = torch.Generator().manual_seed(0)
    return torch.randn(batch_size, 6, generator=g), torch.randn(batch_size, 5, generator=g)

def loss_fn(output, target):
    return nn.functional.mse_loss(output, target)
"""
SHARDED = {  # schedule, reshard_after_forward (VHalf and ZBV resharding need compat.unshard_before_split_backward)
    "GPipe": (Schedule.GPIPE, False),
    "1F1B": (Schedule.ONE_F_ONE_B, True),
    "Interleaved1F1B": (Schedule.INTERLEAVED_1F1B, False),
    "ZBVZeroBubble": (Schedule.ZBV_ZERO_BUBBLE, True),
    "VHalf": (Schedule.V_HALF, True),
}
TIED_SHARDED = ["1F1B", "ZBVZeroBubble"]  # the tie's shards on ranks 0 and 1, summed; both uses on rank 0, whole
STEPS = 8
PRECISIONS = {"fp32": dict(precision="fp32"), "bf16": dict(precision="bf16"),
              "bf16-shard": dict(precision="bf16", data_parallel_mode="shard")}


def sharded(spec, schedule: Schedule, **more) -> Candidate:
    """pp 2 x dp 2, 16 samples in 2 micro-batches per replica; more: other Candidate fields."""
    split = uniform_split(spec.n_layers, 2 * default_stages_per_rank(schedule))
    return Candidate(schedule=schedule, pipeline_degree=2, data_parallel_degree=2, global_batch_size=16,
                     n_microbatches=2, layers_per_stage=split, **more)


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    from tests.dist import Runs

    mlp = load_model_file(RECIPES / "mlp.py")
    tied = load_source(tmp_path_factory.mktemp("tied"), "tied.py", TIED)
    jobs = {f"mlp-{name}": (mlp, sharded(mlp, schedule, data_parallel_mode="shard", reshard_after_forward=r), 0)
            for name, (schedule, r) in SHARDED.items()}
    jobs |= {f"tied-{name}": (tied, sharded(tied, SHARDED[name][0], data_parallel_mode="shard"), 0)
             for name in TIED_SHARDED}
    jobs |= {name: (mlp, sharded(mlp, Schedule.ONE_F_ONE_B, **more), STEPS) for name, more in PRECISIONS.items()}
    return Runs(jobs, tmp_path_factory.mktemp("runs")), {"mlp": mlp, "tied": tied}


@pytest.mark.parametrize("job", [f"mlp-{name}" for name in SHARDED] + [f"tied-{name}" for name in TIED_SHARDED])
def test_sharded_pipelines_gradients_match_reference(four_ranks, job):
    """FSDP2 over the replicas of each stage (autotune.sharding), driven by torch's schedules: the gathered gradients
    are the unpipelined model's, a tied weight's included; the shards are DTensors on every rank."""
    from tests.dist import gathered

    runs, specs = four_ranks
    spec = specs[job.split("-")[0]]
    got = gathered(runs[job], "grads")
    want = reference_grads(spec, runs.jobs[job][1])
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-6, msg=name)


def trained_loss(spec, params) -> float:
    """The unpipelined float32 model's loss on the batch with these parameter values."""
    model = build_blocks(spec).model
    inputs, targets = make_batch(spec, 16)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(params[name])
        return float(spec.loss_fn(model(inputs), targets))


@pytest.mark.parametrize("job", ["bf16", "bf16-shard"])
def test_bf16_loss_after_8_steps_is_within_2_percent_of_fp32(four_ranks, job):
    """bf16 compute over float32 master weights (torch.autocast replicated, FSDP2's mixed precision sharded) trains as
    float32 does: after 8 AdamW steps the loss (float32 forward, gathered weights) is within 2 % of the float32
    run's; weights and gradients stay float32; the gradients carry bfloat16's rounding (so bf16 did compute)."""
    from tests.dist import gathered

    runs, specs = four_ranks
    mlp = specs["mlp"]
    fp32_params, bf16_params = gathered(runs["fp32"], "params"), gathered(runs[job], "params")
    initial = trained_loss(mlp, {name: p.detach() for name, p in build_blocks(mlp).model.named_parameters()})
    fp32_loss, bf16_loss = trained_loss(mlp, fp32_params), trained_loss(mlp, bf16_params)
    assert fp32_loss < initial - 0.1  # the steps trained
    assert bf16_loss == pytest.approx(fp32_loss, rel=0.02)
    assert {t.dtype for t in bf16_params.values()} == {torch.float32}
    want, got = gathered(runs["fp32"], "grads"), gathered(runs[job], "grads")
    assert {t.dtype for t in got.values()} == {torch.float32}
    error = sum(float((got[n] - want[n]).norm()) ** 2 for n in want) / sum(float(g.norm()) ** 2 for g in want.values())
    assert 1e-3 < error**0.5 < 0.05
