"""`autotune export CONFIG --format ...`: the export on stdout and exit 0, or one error line and exit 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from autotune.candidate import Candidate
from autotune.cli import ExportTarget, app
from autotune.config_file import save_config
from autotune.exports import ExportFormat
from autotune.schedules import Schedule
from autotune.tuned_config import Environment, MeasuredResult, TunedConfig

runner = CliRunner()


@pytest.fixture
def config_path(tmp_path: Path) -> Path:
    config = TunedConfig(
        model="recipes/gpt.py", model_sha256="0123456789abcdef", model_layers=10,
        candidate=Candidate(schedule=Schedule.ONE_F_ONE_B, pipeline_degree=4, global_batch_size=64, n_microbatches=8,
                            layers_per_stage=(3, 2, 2, 3)),
        memory_limit_bytes=None,
        measured=MeasuredResult(step_time_ms=100.0, throughput_samples_per_s=640.0, peak_memory_bytes=(1, 1, 1, 1)),
        environment=Environment(device="cpu", torch="2.13.0", autotune="0.1.0", python="3.11.7"),
    )
    return save_config(config, tmp_path / "autotune.yaml")


def test_format_choices_match_the_exporter() -> None:
    assert [t.value for t in ExportTarget] == [f.value for f in ExportFormat]


def test_deepspeed_json_on_stdout(config_path: Path) -> None:
    result = runner.invoke(app, ["export", str(config_path), "--format", "deepspeed"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["train_batch_size"] == 64
    assert result.stderr == ""


def test_format_is_case_insensitive(config_path: Path) -> None:
    result = runner.invoke(app, ["export", str(config_path), "-f", "Megatron"])
    assert result.exit_code == 0, result.output
    assert "--pipeline-model-parallel-size 4" in result.stdout


def test_missing_config_exits_2(tmp_path: Path) -> None:
    result = runner.invoke(app, ["export", str(tmp_path / "none.yaml"), "--format", "torchtitan"])
    assert result.exit_code == 2
    assert "none.yaml: no such file" in result.stderr
    assert result.stdout == ""


def test_inconsistent_config_exits_2(config_path: Path) -> None:
    data = yaml.safe_load(config_path.read_text())
    data["gpus"] = 8
    config_path.write_text(yaml.safe_dump(data))
    result = runner.invoke(app, ["export", str(config_path), "--format", "torchtitan"])
    assert result.exit_code == 2
    assert "pipeline_degree 4 x data_parallel_degree 1 = 4, but gpus is 8" in " ".join(result.stderr.split())
    assert result.stdout == ""


def test_unknown_format_exits_2(config_path: Path) -> None:
    result = runner.invoke(app, ["export", str(config_path), "--format", "nemo"])
    assert result.exit_code == 2
    assert "nemo" in result.output


def test_target_picks_the_trainer_version(config_path: Path) -> None:
    toml = runner.invoke(app, ["export", str(config_path), "-f", "torchtitan", "--target", "0.2"])
    assert toml.exit_code == 0, toml.output
    assert "[parallelism]" in toml.stdout and "# Target: torchtitan 0.2 (" in toml.stdout
    flags = runner.invoke(app, ["export", str(config_path), "-f", "torchtitan", "--target", "main"])
    assert flags.exit_code == 0, flags.output
    assert "AUTOTUNE_TORCHTITAN_ARGS=(" in flags.stdout and "--parallelism.num_pp_microbatches 8" in flags.stdout


def test_unknown_target_exits_2(config_path: Path) -> None:
    result = runner.invoke(app, ["export", str(config_path), "-f", "deepspeed", "--target", "0.14"])
    assert result.exit_code == 2
    assert "unknown DeepSpeed target '0.14'; pass --target with one of: 0.19" in result.stderr
    assert result.stdout == ""


@pytest.mark.parametrize(
    ("status", "code", "said"),
    [
        ("validated", 0, "validated against torchtitan 0.3.0: read back pp 4"),
        ("not_run", 0, "not validated against torchtitan: torchtitan.config is not importable"),
        ("rejected", 1, "rejected by torchtitan 0.3.0: Unrecognized options: --parallelism.x"),
    ],
)
def test_validate_reports_on_stderr_and_exits_1_on_a_rejection(
    config_path: Path, monkeypatch: pytest.MonkeyPatch, status: str, code: int, said: str
) -> None:
    import autotune.exports as exports

    against, _, detail = said.partition(": ")
    against = against.removeprefix("validated against ").removeprefix("not validated against ")
    fake = exports.Validation(status=status, against=against.removeprefix("rejected by "), detail=detail)  # type: ignore[arg-type]
    monkeypatch.setattr(exports, "check_export", lambda *args: fake)
    result = runner.invoke(app, ["export", str(config_path), "-f", "torchtitan", "--validate"])
    assert result.exit_code == code, result.output
    assert said in " ".join(result.stderr.split())
    assert "AUTOTUNE_TORCHTITAN_ARGS=(" in result.stdout  # the export is printed either way
