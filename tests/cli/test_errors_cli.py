"""Every command maps every exception: an AutotuneError to its exit code, anything else to exit 1 with one line, and
with --json exactly one JSON object on stdout, Typer's own parse errors included; `python -m autotune` runs it."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from typer.testing import CliRunner

import autotune.config_file
import autotune.tune
from autotune.cli import app
from tests.conftest import RECIPES

runner = CliRunner()


def boom(*args, **kwargs):
    raise RuntimeError("boom\nsecond line")


def test_an_unexpected_exception_is_one_line_and_exit_1(monkeypatch, tmp_path):
    monkeypatch.setattr(autotune.config_file, "load_config", boom)
    result = runner.invoke(app, ["export", str(tmp_path / "c.yaml"), "--format", "deepspeed"])
    assert result.exit_code == 1
    assert result.stderr.strip() == (
        "error: internal error: RuntimeError: boom second line (rerun with --debug for the traceback)"
    )
    assert "Traceback" not in result.output


def test_an_unexpected_exception_under_json_prints_one_object(monkeypatch):
    monkeypatch.setattr(autotune.tune, "load_and_profile", boom)
    result = runner.invoke(app, ["plan", str(RECIPES / "mlp.py"), "--gpus", "2", "--batch-size", "8", "--device",
                                 "cpu", "--json"])
    assert result.exit_code == 1
    data = json.loads(result.stdout)
    assert data["status"] == "error" and data["exit_code"] == 1 and data["error"].startswith("internal error: ")


def test_debug_shows_the_traceback(monkeypatch, tmp_path):
    monkeypatch.setattr(autotune.config_file, "load_config", boom)
    result = runner.invoke(app, ["--debug", "export", str(tmp_path / "c.yaml"), "--format", "deepspeed"])
    assert isinstance(result.exception, RuntimeError)


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["plan", "MODEL", "--gpus", "0", "--batch-size", "8"], "--gpus"),
        (["plan", "MODEL", "--batch-size", "8", "--bogus"], "--bogus"),
        (["search", "MODEL", "--gpus", "2"], "--batch-size"),
    ],
)
def test_typers_own_parse_errors_under_json_print_one_object(args, fragment):
    args = [str(RECIPES / "mlp.py") if a == "MODEL" else a for a in args]
    result = runner.invoke(app, [*args, "--json"])
    assert result.exit_code == 2
    data = json.loads(result.stdout)
    assert data["status"] == "error" and data["exit_code"] == 2 and fragment in data["error"]
    assert fragment in result.stderr  # the usual message is still shown


def test_a_parse_error_without_json_prints_nothing_on_stdout():
    result = runner.invoke(app, ["plan", str(RECIPES / "mlp.py"), "--gpus", "0", "--batch-size", "8"])
    assert result.exit_code == 2 and result.stdout == ""


def test_python_dash_m_autotune_runs_the_command():
    out = subprocess.run([sys.executable, "-m", "autotune", "plan", str(RECIPES / "mlp.py"), "--gpus", "0",
                          "--batch-size", "8", "--json"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert json.loads(out.stdout)["exit_code"] == 2


def test_version_prints_autotune_and_torch_as_a_config_records_them():
    from importlib.metadata import version

    import autotune

    expected = f"autotune {autotune.__version__} (torch {version('torch')})"
    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0 and result.stdout.strip() == expected
    module = subprocess.run([sys.executable, "-m", "autotune", "--version"], capture_output=True, text=True, timeout=60)
    assert module.returncode == 0 and module.stdout.strip() == expected
