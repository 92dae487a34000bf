"""What a new user and a fault drill hit (issue 13): help texts, early checks of the output and the model path, and
warnings a command owes before it spends minutes."""

from __future__ import annotations

from typer.testing import CliRunner

from autotune.cli import app

runner = CliRunner()


def test_search_help_shows_its_placeholders():
    result = runner.invoke(app, ["search", "--help"], terminal_width=200, env={"COLUMNS": "200"})
    assert result.exit_code == 0
    assert ".autotune/<study>.db" in result.output
    assert "<model>-<device>-g<gpus>-b<batch>" in result.output


def test_check_as_the_header_prints_it_runs_on_the_device_the_config_was_tuned_on(monkeypatch, tmp_path):
    import autotune.check
    from autotune.check import CheckResult
    from autotune.config_file import save_config
    from tests.unit.test_check import config

    path = save_config(config(100.0), tmp_path / "tuned.yaml", command="autotune search ... --device cpu")
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
