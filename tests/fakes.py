"""Test doubles for the search: a synthetic profile and a trial runner that measures by simulation."""

from __future__ import annotations

from collections.abc import Callable

from autotune.candidate import Candidate, Measurement, TrialError
from autotune.costs import LayerCost, Profile
from autotune.simulate import LinkModel, simulate

COSTS = [1.0, 6.0, 6.0, 1.0, 1.0, 0.5, 0.5, 0.5]
"""Per-layer forward (= input-grad = weight-grad) ms of the synthetic 8-layer model: two heavy layers."""


def synthetic_profile() -> Profile:
    layers = [
        LayerCost(forward_ms=c, backward_input_ms=c, backward_weight_ms=c, saved_bytes=1000, output_bytes=100,
                  parameter_bytes=400)
        for c in COSTS
    ]
    return Profile.from_layer_costs(layers, micro_batch_size=4, input_bytes=100)


class SimulatedRunner:
    """A trial = the simulator: its step time and per-rank peak memory (every replica holds the same), noise-free.

    limit: a run whose peak passes it is oom (as the CPU tracker and the CUDA allocator fail such a rank);
    fail(candidate) -> "oom" | "error" | "timeout" | None injects failures; interrupt_after=k raises
    KeyboardInterrupt on launch k + 1 (Ctrl-C during a trial); link: the machine's link (default: the device's)."""

    def __init__(
        self,
        profile: Profile | None = None,
        *,
        limit: int | None = None,
        fail: Callable[[Candidate], str | None] = lambda c: None,
        interrupt_after: int | None = None,
        link: LinkModel | None = None,
    ) -> None:
        self.profile = profile or synthetic_profile()
        self.link = link
        self.limit, self.fail, self.interrupt_after = limit, fail, interrupt_after
        self.calls: list[Candidate] = []

    def __call__(self, spec, candidate: Candidate, options) -> Measurement:
        self.calls.append(candidate)
        if self.interrupt_after is not None and len(self.calls) > self.interrupt_after:
            raise KeyboardInterrupt
        kind = self.fail(candidate)
        if kind:
            return Measurement(candidate=candidate, status=kind,
                               error=TrialError(rank=1, kind=kind, message=f"injected {kind}"))
        estimate = simulate(self.profile, candidate, with_timeline=False, link=self.link)
        peaks = tuple(estimate.peak_memory_bytes) * candidate.data_parallel_degree
        if self.limit is not None and max(peaks) > self.limit:
            return Measurement(candidate=candidate, status="oom", error=TrialError(
                rank=0, kind="oom", message="over the limit", bytes_requested=max(peaks)))
        step = estimate.step_time_ms
        return Measurement(candidate=candidate, status="ok", step_time_ms=step, step_times_ms=(step,),
                           throughput_samples_per_s=candidate.global_batch_size / step * 1000,
                           peak_memory_bytes=peaks)


TINY_MODEL = """
import torch
from torch import nn
def build_model():
    return nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
def make_batch(batch_size):
    return torch.randn(batch_size, 4), torch.randn(batch_size, 2)
def loss_fn(output, target):
    return nn.functional.mse_loss(output, target)
"""
"""A model file that keeps the contract: 3 layers, MSE loss (tests derive broken ones from it)."""

BATCHNORM_MODEL = """
import torch
from torch import nn
def build_model():
    return nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
def make_batch(batch_size):
    return torch.randn(batch_size, 4), torch.randn(batch_size, 2)
def loss_fn(output, target):
    return nn.functional.mse_loss(output, target)
"""
"""A model file whose middle layer is a BatchNorm (statistics per micro-batch; cannot train on one sample)."""


# A model torch.fx cannot cut: Python control flow on a tensor's value between its blocks.
GATED_MODEL = """
import torch
from torch import nn

class Gated(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))

    def forward(self, x):
        for block in self.blocks:
            if x.sum() > 0:  # Python control flow on a tensor's value, between the blocks
                x = block(x)
        return x

def build_model():
    return Gated()

def make_batch(batch_size):
    return torch.randn(batch_size, 8), torch.randn(batch_size, 8)

def loss_fn(out, y):
    return nn.functional.mse_loss(out, y)
"""

