"""What every exporter shares: the header that names the target version and what cannot be expressed, stage ranges."""

from __future__ import annotations

import itertools
import shlex
import textwrap
from collections.abc import Sequence

from autotune.candidate import stage_bounds
from autotune.exports.roles import LayerPlan
from autotune.exports.targets import TargetVersion
from autotune.schedules import Schedule
from autotune.tuned_config import TunedConfig

V_MEMORY = {Schedule.V_HALF: "1/2", Schedule.V_MIN: "1/3"}
"""Controllable-memory V schedules and their activation memory relative to 1F1B."""


def ranges(split: Sequence[int]) -> list[tuple[int, int]]:
    """[3, 2] -> [(0, 3), (3, 5)]: each stage's first layer and one past its last."""
    return list(itertools.pairwise(stage_bounds(split)))


def v_memory_lacking(c: TunedConfig, who: str) -> str:
    return (
        f"schedule {c.schedule.value} (about {V_MEMORY[c.schedule]} of 1F1B's activation memory, Qi et al. 2024): "
        f"neither {who} ships it; the only public implementation is the sail-sg/zero-bubble-pipeline-parallelism "
        f"fork of Megatron-LM"
    )


def data_parallel_words(c: TunedConfig) -> str:
    """How the dp replicas held their stages, for the header: FSDP2-sharded (and the reshard knob) or replicated."""
    if c.data_parallel_degree == 1:
        return ""
    if c.candidate.sharded:
        kept = "resharded after each forward" if c.fsdp_reshard_after_forward else "kept gathered for the step"
        return f" (FSDP2-sharded, {kept})"
    return " (replicated)"


def tensor_parallel_words(c: TunedConfig) -> str:
    """" x tp 2" for the header where the stages are tensor-parallel; empty otherwise."""
    return f" x tp {c.tensor_parallel_degree}" if c.tensor_parallel_degree > 1 else ""


def bf16_as_measured(c: TunedConfig) -> str:
    """How autotune's bf16 run held its parameters, for the notes of trainers that keep bfloat16 parameters instead
    (DeepSpeed's bf16.enabled, Megatron's --bf16): "autotune {this}"."""
    if c.candidate.sharded:
        return "gathered bfloat16 copies of float32 shards (FSDP2's MixedPrecisionPolicy)"
    return "ran torch.autocast over float32 parameters"


TP_AS_MEASURED = (
    "activations stay whole between blocks (an all-reduce after each row-wise layer) and the logits are gathered "
    "whole for the loss"
)
"""What autotune's tensor parallelism does where trainers often do otherwise (sequence parallel, loss parallel)."""


def header(
    c: TunedConfig,
    target: TargetVersion,
    how: str,
    cannot: list[str],
    notes: list[str],
    plan: LayerPlan,
    *,
    prefix: str,
) -> list[str]:
    """The comment block every export starts with; `prefix` "#" wraps it as comment lines, "" leaves plain lines."""
    name = target.trainer_name
    lines = [
        f"autotune tuned config -> {name}. {how}",
        f"Target: {target.stamp}.",
        (
            f"Model {c.model} (sha256 {c.model_sha256}, {c.model_layers} layers), {c.gpus} ranks = pp "
            f"{c.pipeline_degree} x dp {c.data_parallel_degree}{data_parallel_words(c)}{tensor_parallel_words(c)}, "
            f"{c.precision}, schedule "
            f"{c.schedule.value}, B={c.global_batch_size}, "
            f"M={c.micro_batch_size}, {c.num_microbatches} micro-batches, layers_per_stage "
            f"{list(c.layers_per_stage)}; measured {c.measured.step_time_ms:.1f} ms/step on {c.environment.device}."
        ),
        f"Layer roles: {plan.describe()}.",
    ]
    if cannot:
        lines.append(f"Not expressible in {name}:")
        lines += [f"  - {item}" for item in cannot]
    else:
        lines.append(f"Not expressible in {name}: nothing; everything in the tuned config is expressed below.")
    if notes:
        lines.append("Notes:")
        lines += [f"  - {item}" for item in notes]
    if not prefix:
        return lines
    lead = f"{prefix} "
    wrapped: list[str] = []
    for line in lines:
        indent = "    " if line.startswith("  - ") else ""
        wrapped += textwrap.wrap(
            line,
            width=118,
            initial_indent=lead,
            subsequent_indent=lead + indent,
            break_on_hyphens=False,
            break_long_words=False,
        )
    return wrapped


def shell_array(name: str, args: Sequence[tuple[str, str | Sequence[str] | None]]) -> list[str]:
    """A bash array, one flag and its shell-quoted value(s) per line: NAME=(\n    --flag value\n    ...\n)."""
    lines = [f"{name}=("]
    for flag, value in args:
        values = [] if value is None else [value] if isinstance(value, str) else list(value)
        lines.append("    " + " ".join([flag, *map(shlex.quote, values)]))
    lines.append(")")
    return lines
