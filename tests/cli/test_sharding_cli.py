"""Issue 23 from the command line: where every replicated layout runs out of memory and a sharded one fits, the
search writes the sharded config, and its trial stays under the limit."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import yaml

WIDE_LAYER = '''"""One wide layer holds nearly every parameter: a pipeline cannot split it, sharding can."""
import torch
from torch import nn


def build_model():
    return nn.Sequential(nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 16))


def make_batch(batch_size):
    g = torch.Generator().manual_seed(0)
    return torch.randn(batch_size, 1024, generator=g), torch.randn(batch_size, 16, generator=g)


def loss_fn(output, target):
    return nn.functional.mse_loss(output, target)
'''
LIMIT = 20 * 2**20  # replicated: ~24 MiB per rank (4 MiB of weights x 4 for gradients and AdamW, + activations)


def autotune(*args: str, cwd) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "autotune.cli", *args], capture_output=True, text=True, timeout=600,
                          cwd=cwd)


@pytest.mark.dist
def test_under_a_limit_only_sharding_meets_the_search_writes_a_sharded_config_that_fits(tmp_path):
    (tmp_path / "wide.py").write_text(WIDE_LAYER)
    common = ["--gpus", "2", "--device", "cpu", "--batch-size", "8", "--memory-limit", "20MiB"]
    # every replicated layout: out of memory when run (pp 2: the wide layer's rank; pp 1 x dp 2 replicate)
    for layout in (["--dp", "1"], ["--dp", "2", "--data-parallel", "replicate"]):
        out = autotune("trial", "wide.py", *common, *layout, "--microbatches", "2", "--schedule", "1F1B",
                       "--steps", "1", "--warmup", "1", "--json", cwd=tmp_path)
        assert json.loads(out.stdout)["status"] == "oom", out.stdout[-2000:]
    out = autotune("search", "wide.py", *common, "--trials", "4", "--steps", "2", "--warmup", "2", "--json",
                   "--storage", f"sqlite:///{tmp_path / 's.db'}", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads(out.stdout)
    config = yaml.safe_load((tmp_path / "autotune.yaml").read_text())
    assert (config["data_parallel_mode"], config["data_parallel_degree"]) == ("shard", 2)
    assert max(config["measured"]["peak_memory_bytes"]) < LIMIT
    # the replicated layouts were ruled out by prediction: every configuration that ran is sharded
    assert summary["leaders"] and all(lead["candidate"].startswith("dp2-shard/") for lead in summary["leaders"])
    report = (tmp_path / "autotune-report" / "report.md").read_text()
    assert "predicted peak" in report  # the reason given for the pruned replicated ones
    # the chosen config, re-run as a trial by `autotune check`, stays under the limit
    check = autotune("check", "autotune.yaml", "--tolerance", "0.9", "--json", cwd=tmp_path)  # memory, not speed
    result = json.loads(check.stdout)
    assert result["status"] == "ok", check.stdout[-2000:]
    assert result["memory_limit_bytes"] == LIMIT and max(result["peak_memory_bytes"]) < LIMIT
