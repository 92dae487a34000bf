"""On a CUDA machine: profile on the GPU, a 1-GPU trial with the allocator's peak and limit, and a 2-GPU pipeline.
Skipped without CUDA (and the 2-GPU test without two GPUs). Written without a GPU at hand: first run them on one."""

from __future__ import annotations

import pytest
import torch

from autotune.candidate import Candidate
from autotune.model_file import load_model_file
from autotune.profiling import profile_model
from autotune.schedules import Schedule
from autotune.trial import TrialOptions, run_trial
from tests.conftest import RECIPES

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def test_profile_on_cuda_times_every_layer():
    spec = load_model_file(RECIPES / "gpt.py")
    profile = profile_model(spec, batch_size=16, micro_batch_sizes=[4, 16], device="cuda", repeats=3)
    assert profile.device == "cuda"
    assert all(c.forward_ms > 0 for c in profile.layer_costs(16))


def test_profiling_on_cuda_leaves_no_device_memory_behind():
    """Issue 30, item 1: after profiling, the tuner holds no model on the device (nor its allocator's cache)."""
    spec = load_model_file(RECIPES / "gpt.py")
    torch.cuda.synchronize()
    allocated, reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    profile_model(spec, batch_size=16, micro_batch_sizes=[4, 16], device="cuda", repeats=1)
    assert torch.cuda.memory_allocated() == allocated
    assert torch.cuda.memory_reserved() <= reserved


def test_one_gpu_trial_measures_the_allocator_peak_and_enforces_the_limit():
    spec = load_model_file(RECIPES / "mlp.py")
    candidate = Candidate(schedule=Schedule.GPIPE, pipeline_degree=1, global_batch_size=64, n_microbatches=2,
                          layers_per_stage=(spec.n_layers,))
    ok = run_trial(spec, candidate, TrialOptions(steps=3, warmup=1, device="cuda"))
    assert ok.status == "ok" and ok.peak_memory_bytes[0] > sum(spec.parameter_bytes)
    tight = run_trial(spec, candidate, TrialOptions(steps=3, warmup=1, device="cuda",
                                                    memory_limit_bytes=ok.peak_memory_bytes[0] // 4))
    assert tight.status == "oom" and tight.error.rank == 0


def test_one_gpu_trial_peak_is_the_simulators_with_the_library_workspaces():
    """cuBLAS's workspaces (2 x 32 MiB on Hopper) are most of a small model's peak on a GPU: the profile measures them
    (Profile.device_workspace_bytes) and the simulator adds them; without them mlp's peak was under-predicted by 60 %
    on an H200 (bench/results/cuda_first_run.md)."""
    from autotune.simulate import simulate

    spec = load_model_file(RECIPES / "mlp.py")
    profile = profile_model(spec, batch_size=64, micro_batch_sizes=[32], device="cuda", precision="fp32")
    assert profile.device_workspace_bytes > 0
    candidate = Candidate(schedule=Schedule.GPIPE, pipeline_degree=1, global_batch_size=64, n_microbatches=2,
                          layers_per_stage=(spec.n_layers,))
    measured = run_trial(spec, candidate, TrialOptions(steps=2, warmup=1, device="cuda"))
    assert measured.status == "ok", measured.error
    predicted = max(simulate(profile, candidate, with_timeline=False).peak_memory_bytes)
    assert abs(predicted - measured.peak_memory_bytes[0]) <= 0.10 * measured.peak_memory_bytes[0]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
@pytest.mark.parametrize("schedule", [Schedule.ONE_F_ONE_B, Schedule.ZBV_ZERO_BUBBLE, Schedule.V_HALF],
                         ids=lambda s: s.value)
def test_two_gpu_pipeline_over_nccl(schedule):
    spec = load_model_file(RECIPES / "gpt.py")
    stages = 2 if schedule is Schedule.ONE_F_ONE_B else 4
    candidate = Candidate(schedule=schedule, pipeline_degree=2, global_batch_size=32, n_microbatches=4,
                          layers_per_stage=(spec.n_layers // stages,) * stages)
    measured = run_trial(spec, candidate, TrialOptions(steps=3, warmup=1, device="cuda"))
    assert measured.status == "ok", measured.error
    assert len(measured.peak_memory_bytes) == 2


def test_batch_norm_takes_bfloat16_input_beside_float32_parameters():
    """What sharding.shard_stage relies on for a bf16 BatchNorm unit (float32 parameters and statistics, its input
    as it arrives, in bfloat16): torch's CUDA batch norm takes the mixed dtypes and answers in the input's."""
    norm = torch.nn.BatchNorm2d(8).cuda()
    x = torch.randn(4, 8, 5, 5, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    y = norm(x)
    assert y.dtype == torch.bfloat16
    y.float().square().sum().backward()
    assert x.grad.dtype == torch.bfloat16 and norm.weight.grad.dtype == torch.float32
    assert norm.running_mean.dtype == torch.float32


def test_a_bf16_profile_on_cuda_records_what_crosses_a_bfloat16_wire():
    """recipes/gpt.py's residual stream stays float32 under autocast (its blocks' outputs), which a bfloat16 wire
    halves; the head's logits are bfloat16 already."""
    spec = load_model_file(RECIPES / "gpt.py")
    profile = profile_model(spec, batch_size=16, micro_batch_sizes=[16], device="cuda", repeats=1, precision="bf16")
    blocks = profile.layers[1:-1]
    assert all(b.wire_output_bytes[0] * 2 == b.output_bytes[0] for b in blocks)
    assert profile.layers[-1].wire_output_bytes == profile.layers[-1].output_bytes
