"""The trainer versions exports are written for: one row of key names per version, each checked against a source.

A row says how the target takes its settings (TOML file, command-line flags, JSON) and what each of autotune's
settings is called there. `resolve_target` picks the row: the one asked for with --target, else the installed
trainer's, else the newest release.
"""

from __future__ import annotations

import enum
import importlib.metadata
import importlib.util
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from autotune.errors import UsageError


class ExportFormat(str, enum.Enum):
    """Trainers a tuned config can be exported to."""

    torchtitan = "torchtitan"
    deepspeed = "deepspeed"
    megatron = "megatron"

    def __str__(self) -> str:
        return self.value


TRAINER_NAMES = {
    ExportFormat.torchtitan: "torchtitan",
    ExportFormat.deepspeed: "DeepSpeed",
    ExportFormat.megatron: "Megatron-LM",
}
DISTRIBUTIONS = {
    ExportFormat.torchtitan: "torchtitan",
    ExportFormat.deepspeed: "deepspeed",
    ExportFormat.megatron: "megatron-core",
}
"""The pip distribution whose installed version picks the default target."""


@dataclass(frozen=True, kw_only=True)
class TargetVersion:
    """One trainer version's way of taking the settings autotune tunes."""

    trainer: ExportFormat
    """Which trainer."""
    version: str
    """What --target takes: "0.3", "main", ..."""
    releases: str
    """The releases the row covers, in words."""
    form: Literal["toml", "flags", "json"]
    """How the export is written: a TOML file, command-line flags (a bash array), or a JSON config."""
    keys: Mapping[str, str] = field(default_factory=dict)
    """autotune setting -> the target's key or flag."""
    checked_against: str
    """The source the keys were read from and, where the trainer was installed, run against."""
    newest_release: bool = False
    """The default when the trainer is not installed."""

    @property
    def trainer_name(self) -> str:
        return TRAINER_NAMES[self.trainer]

    @property
    def stamp(self) -> str:
        """The line stamped into every export: which version it is for and where its keys come from."""
        return f"{self.trainer_name} {self.version} ({self.releases}; keys checked against {self.checked_against})"


_TORCHTITAN_SPLIT = {
    "pipeline_degree": "parallelism.pipeline_parallel_degree",
    "schedule": "parallelism.pipeline_parallel_schedule",
    "layers_per_stage": "parallelism.pipeline_parallel_layers_per_stage",
    "first_stage_less_layers": "parallelism.pipeline_parallel_first_stage_less_layers",
    "last_stage_less_layers": "parallelism.pipeline_parallel_last_stage_less_layers",
    "module_fqns": "parallelism.module_fqns_per_model_part",
    "dp_replicate": "parallelism.data_parallel_replicate_degree",
    "dp_shard": "parallelism.data_parallel_shard_degree",
    "tensor_parallel": "parallelism.tensor_parallel_degree",
    "fsdp_reshard": "parallelism.fsdp_reshard_after_forward",
    "mixed_precision_param": "training.mixed_precision_param",
    "mixed_precision_reduce": "training.mixed_precision_reduce",
}

_MEGATRON_FLAGS = {
    "pipeline_degree": "--pipeline-model-parallel-size",
    "transformer_layers": "--num-layers",
    "microbatch_size": "--micro-batch-size",
    "global_batch_size": "--global-batch-size",
    "layers_per_virtual_stage": "--num-layers-per-virtual-pipeline-stage",
    "first_stage_layers": "--decoder-first-pipeline-num-layers",
    "last_stage_layers": "--decoder-last-pipeline-num-layers",
    "embedding_in_split": "--account-for-embedding-in-pipeline-split",
    "loss_in_split": "--account-for-loss-in-pipeline-split",
    "layout": "--pipeline-model-parallel-layout",
    "recompute": "--recompute-granularity full --recompute-method uniform --recompute-num-layers",
    "bf16": "--bf16",
    "distributed_optimizer": "--use-distributed-optimizer",
    "tensor_parallel": "--tensor-model-parallel-size",
}

TARGETS: tuple[TargetVersion, ...] = (
    TargetVersion(
        trainer=ExportFormat.torchtitan,
        version="0.2",
        releases="0.2.2 and older: a TOML job file passed with --job.config_file",
        form="toml",
        keys={
            **_TORCHTITAN_SPLIT,
            "microbatch_size": "parallelism.pipeline_parallel_microbatch_size",
            "local_batch_size": "training.local_batch_size",
            "global_batch_size": "training.global_batch_size",
            "checkpointing": "activation_checkpoint.mode",
            "loss_parallel_off": "parallelism.disable_loss_parallel",
            "embedding_fqn": "tok_embeddings",
            "head_fqns": "norm,output",
        },
        checked_against="torchtitan v0.2.2 torchtitan/config/job_config.py",
    ),
    TargetVersion(
        trainer=ExportFormat.torchtitan,
        version="0.3",
        releases="0.3.x: a config function plus --section.key flags, no TOML",
        form="flags",
        keys={
            **_TORCHTITAN_SPLIT,
            "microbatch_size": "parallelism.pipeline_parallel_microbatch_size",
            "local_batch_size": "training.local_batch_size",
            "global_batch_size": "training.global_batch_size",
            "checkpointing": "activation-checkpoint:full|none",
            "cuda_graphs": "training.disable_cuda_graphs",
            "sequence_parallel_off": "parallelism.no_enable_sequence_parallel",
            "embedding_fqn": "tok_embeddings",
            "head_fqns": "norm,lm_head",
        },
        checked_against="torchtitan 0.3.0 (PyPI wheel) torchtitan/config/configs.py, trainer.py, "
        "distributed/pipeline_parallel.py, distributed/fsdp.py and distributed/activation_checkpoint.py",
        newest_release=True,
    ),
    TargetVersion(
        trainer=ExportFormat.torchtitan,
        version="main",
        releases="main after pytorch/torchtitan#4121 (2026-08-20): micro-batches counted per pipeline, batch in tokens",
        form="flags",
        keys={
            **_TORCHTITAN_SPLIT,
            "num_microbatches": "parallelism.num_pp_microbatches",
            "tokens_per_microbatch": "training.num_tokens_per_microbatch_per_dp_rank",
            "tokens_per_step": "training.num_tokens_per_train_step",
            "checkpointing": "activation-checkpoint:full|none",
            "cuda_graphs": "training.disable_cuda_graphs",
            "sequence_parallel_off": "parallelism.no_enable_sequence_parallel",
            "embedding_fqn": "tok_embeddings",
            "head_fqns": "norm,lm_head",
        },
        checked_against="torchtitan main b5bcd76 (2026-08-21) torchtitan/config/configs.py and trainer.py",
    ),
    TargetVersion(
        trainer=ExportFormat.deepspeed,
        version="0.19",
        releases="0.19.x: a JSON config plus a PipelineModule built in code",
        form="json",
        keys={
            "global_batch_size": "train_batch_size",
            "microbatch_size": "train_micro_batch_size_per_gpu",
            "num_microbatches": "gradient_accumulation_steps",
            "checkpoint_interval": "pipeline.activation_checkpoint_interval",
            "use_reentrant": "pipeline.use_reentrant",
            "split": "PipelineModule.parts (set by a subclass's _partition_layers)",
            "dual_pipe_v": "deepspeed.runtime.pipe.dualpipev.DualPipeVModule",
            "bf16": "bf16.enabled",
            "zero_stage": "zero_optimization.stage",
            "grad_accum_dtype": "data_types.grad_accum_dtype",
        },
        checked_against="DeepSpeed 0.19.8 (PyPI sdist) deepspeed/runtime/config.py, runtime/engine.py, "
        "runtime/pipe/module.py, runtime/pipe/engine.py and dualpipev.py",
        newest_release=True,
    ),
    TargetVersion(
        trainer=ExportFormat.megatron,
        version="0.19",
        releases="Megatron-LM at core_v0.19.0: pretrain_*.py flags",
        form="flags",
        keys=_MEGATRON_FLAGS,
        checked_against="NVIDIA/Megatron-LM tag core_v0.19.0 megatron/training/arguments.py, "
        "megatron/core/model_parallel_config.py and megatron/core/transformer/transformer_config.py",
        newest_release=True,
    ),
    TargetVersion(
        trainer=ExportFormat.megatron,
        version="main",
        releases="Megatron-LM main (core 0.20 dev): pretrain_*.py flags",
        form="flags",
        keys=_MEGATRON_FLAGS,  # the same flags as core 0.19, checked flag by flag in both sources
        checked_against="NVIDIA/Megatron-LM main d98e8a6 (2026-08-22) megatron/training/arguments.py, "
        "megatron/core/model_parallel_config.py and megatron/core/transformer/transformer_config.py",
    ),
)


def targets_for(fmt: ExportFormat) -> list[TargetVersion]:
    """The rows of one trainer, oldest first."""
    return [t for t in TARGETS if t.trainer is fmt]


def installed_version(fmt: ExportFormat) -> str | None:
    """The version of the trainer's pip distribution in this environment, or None. Megatron-LM is often used from
    a source checkout on PYTHONPATH: its megatron/core/package_info.py is read then (not imported: that is slow)."""
    try:
        return importlib.metadata.version(DISTRIBUTIONS[fmt])
    except importlib.metadata.PackageNotFoundError:
        pass
    if fmt is not ExportFormat.megatron:
        return None
    try:
        spec = importlib.util.find_spec("megatron")
    except (ImportError, ValueError):
        return None
    for location in (spec.submodule_search_locations or []) if spec else []:
        try:
            text = (Path(location) / "core" / "package_info.py").read_text(encoding="utf-8")
        except OSError:
            continue
        numbers = [re.search(rf"^{part} = (\d+)", text, re.MULTILINE) for part in ("MAJOR", "MINOR", "PATCH")]
        if all(numbers):
            return ".".join(found.group(1) for found in numbers if found)
    return None


def resolve_target(fmt: ExportFormat, requested: str | None = None) -> tuple[TargetVersion, str]:
    """The row to export for, and why it was picked (a phrase for the export's notes)."""
    rows = targets_for(fmt)
    names = ", ".join(t.version for t in rows)
    if requested is not None:
        row = _match(rows, requested.strip().lower().removeprefix("v"))
        if row is None:
            raise UsageError(f"unknown {TRAINER_NAMES[fmt]} target {requested!r}; pass --target with one of: {names}")
        return row, f"asked for with --target {requested}"
    installed = installed_version(fmt)
    if installed is not None:
        return target_for_version(fmt, installed)
    newest = next(t for t in reversed(rows) if t.newest_release)
    return newest, (
        f"{TRAINER_NAMES[fmt]} is not installed here, so the newest release autotune knows; pass --target "
        f"({names}) for another"
    )


def target_for_version(fmt: ExportFormat, installed: str) -> tuple[TargetVersion, str]:
    """The row for an installed version: its own, else the newest row for a newer one, the oldest for an older."""
    rows = targets_for(fmt)
    row = _match(rows, installed)
    if row is not None:
        return row, f"{DISTRIBUTIONS[fmt]} {installed} is installed here"
    known = [r for r in (_release(t.version) for t in rows) if r is not None]
    older = (_release(installed) or (0, 0)) < min(known)
    row = rows[0] if older else rows[-1]
    return row, (
        f"{DISTRIBUTIONS[fmt]} {installed} is installed here, {'older' if older else 'newer'} than the versions "
        f"autotune knows; exported for {row.version}, the {'oldest' if older else 'newest'} it knows"
    )


def _match(rows: list[TargetVersion], version: str) -> TargetVersion | None:
    """'0.3.0' -> the 0.3 row; '0.1.0' -> the 0.2 row where it covers 'and older'; 'main' -> main."""
    if version == "main":
        return next((t for t in rows if t.version == "main"), None)
    wanted = _release(version)
    if wanted is None:
        return None
    for row in rows:
        have = _release(row.version)
        if have is None:
            continue
        if wanted == have or (wanted < have and "older" in row.releases):
            return row
    return None


def _release(version: str) -> tuple[int, int] | None:
    """'0.19.8' -> (0, 19); '0.20.0rc1+abc' -> (0, 20); 'main' -> None."""
    found = re.match(r"(\d+)\.(\d+)", version)
    return (int(found.group(1)), int(found.group(2))) if found else None
