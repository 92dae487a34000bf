"""What a new user and a fault drill hit (issue 13): help texts, early checks of the output and the model path, and
warnings a command owes before it spends minutes."""

from __future__ import annotations

from typer.testing import CliRunner

from autotune.cli import app
from tests.conftest import RECIPES

runner = CliRunner()


def test_search_help_shows_its_placeholders():
    result = runner.invoke(app, ["search", "--help"], terminal_width=200, env={"COLUMNS": "200"})
    assert result.exit_code == 0
    assert ".autotune/<study>.db" in result.output
    assert "<model>-<device>-g<gpus>-b<batch>" in result.output


def test_check_as_the_header_prints_it_runs_on_the_device_the_config_was_tuned_on(monkeypatch, tmp_path):
    from dataclasses import replace

    import autotune.check
    from autotune.check import CheckResult
    from autotune.config_file import save_config
    from autotune.model_file import fingerprint
    from tests.unit.test_check import config

    tuned = replace(config(100.0), model_sha256=fingerprint(RECIPES / "mlp.py"))
    path = save_config(tuned, tmp_path / "tuned.yaml", command="autotune search ... --device cpu")
    header = [line for line in path.read_text().splitlines() if line.startswith("# Check it still holds:")]
    assert header == [f"# Check it still holds: autotune check {path}"]
    devices = []

    def fake_check(tuned, spec, *, options, **kwargs):
        devices.append(options.device)
        return CheckResult(status="ok", message="fine", recorded_throughput_samples_per_s=100.0,
                           measured_throughput_samples_per_s=100.0, ratio=1.0, tolerance=0.05)

    monkeypatch.setattr(autotune.check, "check_config", fake_check)
    result = runner.invoke(app, ["check", str(path)])
    assert result.exit_code == 0, result.output
    assert devices == ["cpu"]  # tuned with --device cpu: checked on the CPU, not "no CUDA device found" (exit 4)


def _no_profiling(monkeypatch):
    import autotune.tune

    def refuse(*args, **kwargs):
        raise AssertionError("profiled before the early checks")

    monkeypatch.setattr(autotune.tune, "load_and_profile", refuse)


def test_an_unwritable_output_is_refused_before_profiling(monkeypatch, tmp_path):
    _no_profiling(monkeypatch)
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    result = runner.invoke(app, ["search", str(RECIPES / "mlp.py"), "--gpus", "2", "--device", "cpu", "--batch-size",
                                 "16", "--output", str(blocker / "tuned.yaml"), "--report-dir", str(tmp_path / "r")])
    assert result.exit_code == 2, result.output
    assert "cannot be written" in result.stderr and "--output" in result.stderr


def test_more_cpu_ranks_than_cores_is_warned(monkeypatch, tmp_path):
    import os

    _no_profiling(monkeypatch)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    result = runner.invoke(app, ["search", str(RECIPES / "mlp.py"), "--gpus", "8", "--device", "cpu", "--batch-size",
                                 "16", "--output", str(tmp_path / "t.yaml"), "--report-dir", str(tmp_path / "r")],
                           terminal_width=300)
    assert "8 CPU ranks on 2 core(s)" in " ".join(result.stderr.split())


def test_a_directory_as_the_model_says_so(tmp_path):
    result = runner.invoke(app, ["trial", str(tmp_path), "--gpus", "2", "--device", "cpu", "--batch-size", "8",
                                 "--microbatches", "2", "--schedule", "GPipe"], terminal_width=300)
    assert result.exit_code == 2
    assert "is a directory" in result.stderr and "no such file" not in result.stderr


def test_a_forward_that_hangs_ends_the_command_at_its_timeout(model_file):
    # Issue 13, item 1: the check forward runs in the tuner's own process; `trial --timeout 30` never returned.
    import json
    import time

    model = model_file(last_forward="time.sleep(1000)")
    started = time.monotonic()
    result = runner.invoke(app, ["trial", str(model), "--gpus", "2", "--device", "cpu", "--batch-size", "8",
                                 "--microbatches", "2", "--schedule", "GPipe", "--timeout", "2", "--json"],
                           terminal_width=400)
    assert time.monotonic() - started < 2 + 30
    assert result.exit_code == 1
    error = json.loads(result.stdout)["error"]
    assert error.startswith(f"{model}: the model check") and "did not return within 2 s" in error
    assert f"hung at {model}:" in error and "in forward() (time.sleep(1000))" in error and "--timeout" in error


def test_search_and_check_bound_the_model_check_too(model_file, tmp_path):
    model = model_file(last_forward="time.sleep(1000)")
    result = runner.invoke(app, ["search", str(model), "--gpus", "2", "--device", "cpu", "--batch-size", "8",
                                 "--trial-timeout", "2", "--output", str(tmp_path / "t.yaml"), "--report-dir",
                                 str(tmp_path / "r")], terminal_width=400)
    assert result.exit_code == 1
    assert "did not return within 2 s" in result.stderr and "--trial-timeout" in result.stderr
    from autotune.candidate import Candidate, Measurement
    from autotune.config_file import save_config
    from autotune.schedules import Schedule
    from autotune.tuned_config import TunedConfig

    candidate = Candidate(schedule=Schedule.GPIPE, pipeline_degree=2, global_batch_size=8, n_microbatches=2,
                          layers_per_stage=(2, 2))
    measured = Measurement(candidate=candidate, status="ok", step_time_ms=10.0, throughput_samples_per_s=800.0,
                           peak_memory_bytes=(1, 1))
    config = save_config(TunedConfig.from_measurement(measured, model=str(model), memory_limit_bytes=None),
                         tmp_path / "tuned.yaml")
    result = runner.invoke(app, ["check", str(config), "--timeout", "2"], terminal_width=400)
    assert result.exit_code == 1
    assert "did not return within 2 s" in result.stderr and "time.sleep(1000)" in result.stderr
