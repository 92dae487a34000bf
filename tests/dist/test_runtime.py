"""A training script uses a tuned config in a few lines (recipes/train_with_config.py under torchrun)."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from autotune.candidate import Candidate, Measurement
from autotune.config_file import save_config
from autotune.schedules import Schedule
from autotune.tuned_config import TunedConfig
from tests.conftest import RECIPES

pytestmark = pytest.mark.dist


CONFIGS = {
    "interleaved": Candidate(schedule=Schedule.INTERLEAVED_1F1B, pipeline_degree=2, global_batch_size=32,
                             n_microbatches=4, layers_per_stage=(3, 2, 2, 3)),
    # setup_pipeline builds FSDP2-sharded bf16 stages too (pp 2 x dp 2), resharding after forward under VHalf
    "sharded-bf16": Candidate(schedule=Schedule.V_HALF, pipeline_degree=2, data_parallel_degree=2,
                              global_batch_size=32, n_microbatches=4, layers_per_stage=(3, 2, 2, 3), precision="bf16",
                              data_parallel_mode="shard", reshard_after_forward=True),
    # and tensor-parallel ones from the model's own plan (pp 2 x tp 2: each stage's projections split over 2 ranks)
    "tensor-parallel": Candidate(schedule=Schedule.ONE_F_ONE_B, pipeline_degree=2, tensor_parallel_degree=2,
                                 global_batch_size=8, n_microbatches=4, layers_per_stage=(3, 3)),
}
MODELS = {"tensor-parallel": "hf_llama.py"}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_train_with_config_under_torchrun(tmp_path, name):
    candidate = CONFIGS[name]
    model = RECIPES / MODELS.get(name, "mlp.py")
    if name == "tensor-parallel":
        pytest.importorskip("transformers")
    measured = Measurement(candidate=candidate, status="ok", step_time_ms=10.0, throughput_samples_per_s=3200.0,
                           peak_memory_bytes=(1,) * candidate.world_size)
    config = TunedConfig.from_measurement(measured, model=str(model), memory_limit_bytes=None,
                                          model_layers=sum(candidate.layers_per_stage))
    save_config(config, tmp_path / "tuned.yaml")
    out = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(candidate.world_size),
         str(RECIPES / "train_with_config.py"), str(tmp_path / "tuned.yaml"), "--steps", "6", "--device", "cpu"],
        capture_output=True, text=True, timeout=180,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    losses: dict[str, list[float]] = {}  # each replica's last stage prints its own
    for rank, loss in re.findall(r"rank (\d+) step \d+ loss ([0-9.]+)", out.stdout):
        losses.setdefault(rank, []).append(float(loss))
    assert len(losses) == candidate.data_parallel_degree * candidate.tensor_parallel_degree  # tp ranks print alike
    assert len({tuple(mine) for mine in losses.values()}) == candidate.data_parallel_degree
    assert all(len(mine) == 6 and mine[-1] < mine[0] for mine in losses.values())
