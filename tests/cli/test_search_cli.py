"""`autotune search` as a user runs it: a real CPU search, the memory limit nothing fits, Ctrl-C and --resume."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import optuna
import pytest
import sqlalchemy.exc
import yaml
from typer.testing import CliRunner

from autotune.cli import app

runner = CliRunner()

SCHEMA_KEYS = {
    "version", "model", "gpus", "global_batch_size", "micro_batch_size", "num_microbatches", "pipeline_degree",
    "data_parallel_degree", "schedule", "layers_per_stage", "activation_checkpointing", "memory_limit_bytes",
    "measured", "predicted", "search", "environment",
}


def search_args(model, tmp_path, *extra):
    return ["search", str(model), "--gpus", "2", "--device", "cpu", "--batch-size", "16", "--output",
            str(tmp_path / "tuned.yaml"), "--storage", f"sqlite:///{tmp_path / 'study.db'}", "--report-dir",
            str(tmp_path / "report"), *extra]


def test_memory_limit_nothing_fits_exits_3_saying_what_would(model_file, tmp_path):
    result = runner.invoke(app, search_args(model_file(), tmp_path, "--trials", "4", "--memory-limit", "1KiB"))
    assert result.exit_code == 3, result.output
    assert "--memory-limit" in result.output and "needs" in result.output
    assert not (tmp_path / "tuned.yaml").exists()


@pytest.mark.parametrize("value,fragment", [
    ("two", "cannot read --tensor-parallel 'two'"),
    ("2", "tensor_parallel_degree 2 needs a tensor-parallel plan"),  # the test model has none
])
def test_a_tensor_parallel_degree_the_model_cannot_take_exits_2_in_one_line(model_file, tmp_path, value, fragment):
    result = runner.invoke(app, search_args(model_file(), tmp_path, "--trials", "2", "--tensor-parallel", value))
    assert result.exit_code == 2, result.output
    assert fragment in result.output and "Traceback" not in result.output


@pytest.mark.dist
def test_real_search_writes_the_config_and_one_json_object(model_file, tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "autotune.cli", *search_args(model_file(), tmp_path, "--trials", "5", "--steps", "2",
                                                            "--warmup", "1", "--json")],
        capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stderr
    summary = json.loads(out.stdout)
    config = yaml.safe_load((tmp_path / "tuned.yaml").read_text())
    assert SCHEMA_KEYS <= config.keys()
    assert summary["launched"] == 5 and summary["config_written"]
    best = summary["best"]
    assert (config["schedule"], config["layers_per_stage"]) == (best["schedule"], best["layers_per_stage"])
    # the chosen config is the fastest median among the candidates that ran
    assert summary["leaders"][0]["candidate"].startswith(("dp2/", best["schedule"]))
    assert config["measured"]["throughput_samples_per_s"] == pytest.approx(best["throughput_samples_per_s"])


@pytest.mark.dist
def test_ctrl_c_writes_the_best_so_far_and_resume_continues(model_file, tmp_path):
    # Each step sleeps a little on the last rank, so there is time to interrupt between trials.
    path = model_file("if os.environ.get('RANK') == '1':\n    time.sleep(0.05)")
    args = search_args(path, tmp_path, "--trials", "12", "--steps", "2", "--warmup", "1")
    tuner = subprocess.Popen([sys.executable, "-m", "autotune.cli", *args], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    storage = f"sqlite:///{tmp_path / 'study.db'}"
    deadline = time.time() + 120
    completed = 0
    while time.time() < deadline and completed < 2:
        time.sleep(0.5)
        try:
            study = optuna.load_study(study_name=optuna.get_all_study_names(storage)[0], storage=storage)
            completed = sum(t.state == optuna.trial.TrialState.COMPLETE for t in study.trials)
        except (KeyError, IndexError, OSError, sqlalchemy.exc.SQLAlchemyError):  # not written yet, or locked
            continue
    tuner.send_signal(signal.SIGINT)
    _, err = tuner.communicate(timeout=60)
    assert tuner.returncode == 130, err
    assert (tmp_path / "tuned.yaml").exists()
    before = len(optuna.load_study(study_name=study.study_name, storage=storage).trials)

    resumed = runner.invoke(app, [*args[:-6], "--steps", "2", "--warmup", "1", "--trials", "6", "--resume"])
    assert resumed.exit_code == 0, resumed.output
    after = optuna.load_study(study_name=study.study_name, storage=storage).trials
    assert len(after) > before
    assert sum(bool(t.user_attrs.get("launched")) for t in after) == 6


@pytest.mark.dist
def test_a_search_with_allow_async_runs_2bw_trials(tmp_path):
    """--allow-async on the GPT recipe: the planner's 2BW candidates run as real trials beside the synchronous ones
    (the stderr lines of trials that ran name them), and the config of a 2BW winner says asynchronous. An odd batch
    leaves one layout, pp 2 (no dp 2 to divide it), where 2BW is predicted ahead of 1F1B (and measured so:
    bench/results/two_bw.md; on the MLP recipe 2BW measured slower than 1F1B from 4 micro-batches on, and the
    simulator no longer ranks it ahead there)."""
    from tests.conftest import RECIPES

    args = search_args(RECIPES / "gpt.py", tmp_path, "--trials", "6", "--steps", "3", "--warmup", "1", "--json",
                       "--allow-async")
    args[args.index("--batch-size") + 1] = "63"
    out = subprocess.run([sys.executable, "-m", "autotune.cli", *args], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    ran = [line for line in out.stderr.splitlines() if " ok " in line]
    assert any("2BW/" in line for line in ran), out.stderr
    config = yaml.safe_load((tmp_path / "tuned.yaml").read_text())
    assert config.get("asynchronous", False) is (config["schedule"] == "2BW")
