"""Exports of a tuned config to other trainers (torchtitan, DeepSpeed, Megatron-LM), per trainer version."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from autotune.candidate import stage_bounds
from autotune.errors import ConfigError, UsageError
from autotune.exports.deepspeed import export_deepspeed
from autotune.exports.megatron import export_megatron
from autotune.exports.roles import LayerPlan, layer_plan, model_file_hints
from autotune.exports.targets import TARGETS, ExportFormat, TargetVersion, resolve_target
from autotune.exports.torchtitan import export_torchtitan
from autotune.exports.validate import Validation, check_export
from autotune.schedules import SCHEDULES
from autotune.tuned_config import TunedConfig

__all__ = [
    "TARGETS",
    "ExportFormat",
    "LayerPlan",
    "TargetVersion",
    "Validation",
    "export_config",
    "layer_plan",
    "parse_format",
    "resolve_target",
    "stage_bounds",
    "validate_export",
]


def parse_format(fmt: ExportFormat | str) -> ExportFormat:
    try:
        return ExportFormat(fmt.lower() if isinstance(fmt, str) else fmt)
    except ValueError:
        names = ", ".join(f.value for f in ExportFormat)
        raise UsageError(f"unknown export format {fmt!r}; pass --format with one of: {names}") from None


def export_config(
    config: TunedConfig,
    fmt: ExportFormat | str,
    target: str | None = None,
    *,
    model_file: Path | None = None,
) -> str:
    """The settings of `config` for one trainer version (--target; default: the installed trainer's, else the
    newest release), with comments naming the version and what the target cannot express.

    Layer roles come from the config, else from LAYER_ROLES in the model file (`model_file`, default the config's
    `model` path where that file exists; read, not run)."""
    trainer = parse_format(fmt)
    if SCHEDULES[config.candidate.schedule].asynchronous:
        raise ConfigError(
            f"{config.candidate.schedule.value} is asynchronous (one-step-stale updates, no flush) and "
            f"{trainer.value} has no asynchronous schedule, so it would run something else; export a config of a "
            f"synchronous schedule (autotune search without --allow-async), or run this one with "
            f"autotune.runtime.setup_pipeline"
        )
    row, why = resolve_target(trainer, target)
    hints = _hints(config, model_file)
    plan = layer_plan(config, hints.get("layer_roles"))
    if trainer is ExportFormat.torchtitan:
        return export_torchtitan(config, row, plan, hints.get("seq_len"), why)
    if trainer is ExportFormat.deepspeed:
        return export_deepspeed(config, row, plan, why)
    return export_megatron(config, row, plan, why)


def validate_export(
    config: TunedConfig,
    fmt: ExportFormat | str,
    text: str,
    target: str | None = None,
    *,
    model_file: Path | None = None,
) -> Validation:
    """Run the installed trainer's own checks on `text`, the export of `config` (same target and model file)."""
    trainer = parse_format(fmt)
    row, _ = resolve_target(trainer, target)
    plan = layer_plan(config, _hints(config, model_file).get("layer_roles"))
    return check_export(config, trainer, text, row, plan)


def _hints(config: TunedConfig, model_file: Path | None) -> dict[str, Any]:
    path = model_file if model_file is not None else Path(config.model)
    return model_file_hints(path) if path.is_file() else {}
