"""A training script uses a tuned config in a few lines (recipes/train_with_config.py under torchrun)."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from autotune.candidate import Candidate, Measurement
from autotune.schedules import Schedule
from autotune.config_file import save_config
from autotune.tuned_config import TunedConfig
from tests.conftest import RECIPES

pytestmark = pytest.mark.dist


def test_train_with_config_under_torchrun(tmp_path):
    candidate = Candidate(schedule=Schedule.INTERLEAVED_1F1B, pipeline_degree=2, global_batch_size=32,
                          n_microbatches=4, layers_per_stage=(3, 2, 2, 3))
    measured = Measurement(candidate=candidate, status="ok", step_time_ms=10.0, throughput_samples_per_s=3200.0,
                           peak_memory_bytes=(1, 1))
    config = TunedConfig.from_measurement(measured, model=str(RECIPES / "mlp.py"), memory_limit_bytes=None,
                                          model_layers=10)
    save_config(config, tmp_path / "tuned.yaml")
    out = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         str(RECIPES / "train_with_config.py"), str(tmp_path / "tuned.yaml"), "--steps", "6", "--device", "cpu"],
        capture_output=True, text=True, timeout=180,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    losses = [float(x) for x in re.findall(r"loss ([0-9.]+)", out.stdout)]
    assert len(losses) == 6
    assert losses[-1] < losses[0]
