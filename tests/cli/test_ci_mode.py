"""What the CI workflow does, on CPU: search, then check passes (0), a doctored recorded throughput ten times as high
regresses (1), a model whose layer count changed mismatches (2), a memory limit below the config's peak does not
fit (3); every --json output is exactly one JSON object."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import yaml

from tests.conftest import RECIPES

pytestmark = pytest.mark.dist


def autotune(*args, cwd):
    out = subprocess.run([sys.executable, "-m", "autotune.cli", *map(str, args)], capture_output=True, text=True,
                         cwd=cwd, timeout=300)
    return out.returncode, out.stdout, out.stderr


def one_json(stdout):
    data = json.loads(stdout)  # raises on anything but one JSON document
    assert isinstance(data, dict)
    return data


def cnn_copy(tmp_path):
    model = tmp_path / "cnn.py"
    model.write_text((RECIPES / "cnn.py").read_text())
    return model


def test_ci_mode_exit_codes(tmp_path):
    model = cnn_copy(tmp_path)
    code, out, err = autotune("search", model, "--gpus", "2", "--device", "cpu", "--batch-size", "16", "--trials", "4",
                              "--steps", "3", "--warmup", "1", "--output", "tuned.yaml", "--json", cwd=tmp_path)
    assert code == 0, err
    one_json(out)
    config = tmp_path / "tuned.yaml"
    # A CPU stand-in is noisy: CI on GPUs keeps the default tolerance of 5 %. On the 2-core VM the same trial
    # measured 17.0 ms in one hour and 23-24.6 ms in another (recipes/mlp.py, GPipe m1): a tolerance of 0.3 failed
    # a full suite run once; what is tested here is the exit codes, the regressed case sits at 10x.
    check = ("check", config, "--device", "cpu", "--steps", "3", "--warmup", "1", "--tolerance", "0.6", "--json")

    code, out, err = autotune(*check, cwd=tmp_path)
    assert code == 0, (err, out)
    assert one_json(out)["status"] == "ok"

    doctored = yaml.safe_load(config.read_text())
    # Ten times as fast as measured, every recorded run too: past any noise the search's own runs showed.
    doctored["measured"]["throughput_samples_per_s"] *= 10
    doctored["measured"]["runs_throughput_samples_per_s"] = [
        10 * t for t in doctored["measured"].get("runs_throughput_samples_per_s", [])
    ]
    (tmp_path / "doctored.yaml").write_text(yaml.safe_dump(doctored))
    code, out, err = autotune(*check[:1], tmp_path / "doctored.yaml", *check[2:], cwd=tmp_path)
    assert code == 1, err
    data = one_json(out)
    assert data["status"] == "regressed" and len(data["runs"]) == 3 and "below the recorded" in data["message"]

    bigger = model.read_text().replace("CHANNELS = [16, 32, 64, 64]", "CHANNELS = [16, 32, 64, 64, 64]")
    (tmp_path / "bigger.py").write_text(bigger)
    code, out, err = autotune(*check, "--model", tmp_path / "bigger.py", cwd=tmp_path)
    assert code == 2
    assert one_json(out)["status"] == "error" and "8 layers" in err and "has 10" in err

    wider = model.read_text().replace("CHANNELS = [16, 32, 64, 64]", "CHANNELS = [16, 32, 64, 96]")
    (tmp_path / "wider.py").write_text(wider)  # same layer count, one layer wider: the config no longer applies
    code, out, err = autotune(*check, "--model", tmp_path / "wider.py", cwd=tmp_path)
    assert code == 2, err
    assert "of parameters" in err and "when the config was tuned" in err

    peak = max(yaml.safe_load(config.read_text())["measured"]["peak_memory_bytes"])
    code, out, err = autotune(*check, "--memory-limit", str(peak // 2), cwd=tmp_path)
    assert code == 3, err
    assert one_json(out)["status"] == "oom"


def test_refresh_keeps_the_existing_config_without_a_clear_gain(tmp_path):
    model = cnn_copy(tmp_path)
    args = ("search", model, "--gpus", "2", "--device", "cpu", "--batch-size", "16", "--trials", "4", "--steps", "3",
            "--warmup", "1", "--output", "tuned.yaml", "--json")
    assert autotune(*args, cwd=tmp_path)[0] == 0
    before = (tmp_path / "tuned.yaml").read_text()
    code, out, err = autotune(*args, "--study-name", "refresh", "--min-improvement", "10", cwd=tmp_path)
    assert code == 0, err
    summary = one_json(out)
    assert summary["kept_existing_config"] and not summary["config_written"]
    assert (tmp_path / "tuned.yaml").read_text() == before
