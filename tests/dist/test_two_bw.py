"""2BW (PipeDream-2BW) is exact: after 6 steps every stage's weights equal a single-process run of the same delayed
update W(t+1) = W(t) - lr * grad f(W(t-1)) under the model's own optimizer (SGD with momentum, AdamW; SGD with
activation checkpointing too), with pp 2, pp 2 x dp 2 and pp 4 on CPU ranks, the 6 steps run as windows of 1, 3, 1
and 1 steps: the versions carry across windows, torch's schedules of both window lengths share the stages, and in
the window of 3 an update finishes (its all-reduce waited for, the optimizer stepped) only when the next step but one
needs its weights."""

from __future__ import annotations

import copy

import pytest
import torch

from autotune.candidate import Candidate, uniform_split
from autotune.model_file import build_blocks, build_optimizer, make_batch
from autotune.schedules import Schedule
from tests.dist import load_source, spawn_ranks

pytestmark = pytest.mark.dist

WINDOWS = [1, 3, 1, 1]
STEPS = sum(WINDOWS)
MODEL = """
import torch
from torch import nn

def build_model():
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                         nn.Linear(16, 4))  # every stage of a uniform split over 2 or 4 has weights

def make_batch(batch_size):
    g = torch.Generator().manual_seed(batch_size)
    return torch.randn(batch_size, 8, generator=g), torch.randn(batch_size, 4, generator=g)

def loss_fn(output, target):
    return nn.functional.mse_loss(output, target)

def build_optimizer(params):
    return {optimizer}
"""
OPTIMIZERS = {  # large steps, so that a step of staleness moves the weights well past the tolerance
    "sgd": "torch.optim.SGD(params, lr=0.2, momentum=0.9)",
    "adamw": "torch.optim.AdamW(params, lr=0.05, weight_decay=0.1)",
}
CASES = {"sgd": ("sgd", False), "adamw": ("adamw", False), "sgd-ckpt": ("sgd", True)}
"""name: (optimizer, activation checkpointing: a backward recomputes its forward, on its step's version)"""
LAYOUTS = {"pp2": (2, 1), "pp2xdp2": (2, 2), "pp4": (4, 1)}
"""name: (pp, dp)"""


def candidate(spec, pp: int, dp: int, checkpointing: bool = False) -> Candidate:
    """pp x dp, pp micro-batches of 4 samples per replica and step: the fewest 2BW runs, where a stage's first
    micro-batches of a step start right after the previous step's update."""
    return Candidate(schedule=Schedule.TWO_BW, pipeline_degree=pp, data_parallel_degree=dp,
                     global_batch_size=4 * pp * dp, n_microbatches=pp, layers_per_stage=uniform_split(spec.n_layers, pp),
                     activation_checkpointing=checkpointing)


def reference(spec, c: Candidate, *, delay: int) -> dict[str, torch.Tensor]:
    """One process, the model's optimizer: step t's gradient (the mean over its micro-batches of all replicas) is
    taken at W(t - delay) (W(-1) = W(0)) and applied to W(t)."""
    model = build_blocks(spec).model
    optimizer = build_optimizer(spec, list(model.parameters()))
    stale = copy.deepcopy(model)
    history = [{n: p.detach().clone() for n, p in model.named_parameters()}]
    b, chunks = c.global_batch_size, c.n_microbatches * c.data_parallel_degree
    inputs, targets = make_batch(spec, STEPS * b)
    for t in range(STEPS):
        stale.load_state_dict(history[max(t - delay, 0)], strict=False)
        stale.zero_grad()
        x, y = inputs[t * b : (t + 1) * b], targets[t * b : (t + 1) * b]
        loss = sum(spec.loss_fn(stale(xs), ys) for xs, ys in zip(x.chunk(chunks), y.chunk(chunks))) / chunks
        loss.backward()
        for (_, p), (_, q) in zip(model.named_parameters(), stale.named_parameters()):
            p.grad = q.grad.clone()
        optimizer.step()
        optimizer.zero_grad()
        history.append({n: p.detach().clone() for n, p in model.named_parameters()})
    return history[-1]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every (case, layout) job, the jobs of one world size in one launch: the parameters after the steps, by name
    (replicas must agree), per job."""
    from tests.dist import gathered, grad_worker

    root = tmp_path_factory.mktemp("2bw")
    specs = {name: load_source(root, f"{name}.py", MODEL.format(optimizer=text)) for name, text in OPTIMIZERS.items()}
    results = {}
    for layout, (pp, dp) in LAYOUTS.items():
        store = root / layout
        store.mkdir()
        jobs = []
        for name, (optimizer, checkpointing) in CASES.items():
            (store / name).mkdir()
            spec = specs[optimizer]
            jobs.append({"model": str(spec.path), "candidate": candidate(spec, pp, dp, checkpointing).to_dict(),
                         "out": str(store / name), "windows": WINDOWS})
        world = pp * dp
        args = (world, jobs, str(store))
        codes = spawn_ranks(grad_worker.run_jobs, lambda rank, args=args: (rank, *args), world, timeout=240)
        assert codes == [0] * world, f"{layout}: rank exit codes {codes} (tracebacks on stderr)"
        for name in CASES:
            ranks = [torch.load(store / name / f"steps-{rank}.pt") for rank in range(world)]
            results[name, layout] = gathered(ranks, "params"), ranks
    return specs, results


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("case", CASES)
def test_weights_after_six_steps_equal_the_delayed_reference(runs, case, layout):
    specs, results = runs
    spec = specs[CASES[case][0]]
    got, ranks = results[case, layout]
    c = candidate(spec, *LAYOUTS[layout])
    want = reference(spec, c, delay=1)
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-6, msg=name)
    # the test can fail: the synchronous update (no delay) ends elsewhere
    synchronous = reference(spec, c, delay=0)
    assert any(not torch.allclose(got[n], synchronous[n], rtol=1e-3, atol=1e-4) for n in want)
    # the last stage's rank reports each step's micro-batch losses
    last = ranks[c.pipeline_degree - 1]["losses"]
    assert len(last) == STEPS and all(len(step) == c.n_microbatches for step in last)

