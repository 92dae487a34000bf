"""Translate a tuned config into another trainer's settings: torchtitan (TOML), DeepSpeed (JSON), Megatron-LM (flags).

Key and flag names were checked against the projects' own sources (2025-26 main branches):
  torchtitan  torchtitan/config/job_config.py: [training] local_batch_size (per data-parallel rank), global_batch_size;
              [parallelism] pipeline_parallel_degree, pipeline_parallel_schedule (any name torch's
              get_schedule_class takes), pipeline_parallel_microbatch_size, pipeline_parallel_layers_per_stage (one
              int), module_fqns_per_model_part (list of FQN lists; replaces pipeline_parallel_split_points, renamed
              pipeline_parallel_module_fqns_per_model_part in the newest Python configs),
              data_parallel_replicate_degree,
              data_parallel_shard_degree; [activation_checkpoint] mode = "selective" | "full" | "none".
              torchtitan/distributed/pipeline_parallel.py: n_microbatches = local_batch_size // microbatch_size;
              layers_per_stage counts tok_embeddings and norm+output as one layer each
              (pipeline_parallel_first/last_stage_less_layers = 1) and hands out the remainder to the first stages.
  DeepSpeed   deepspeed/runtime/config.py: train_batch_size, train_micro_batch_size_per_gpu,
              gradient_accumulation_steps, "pipeline": {stages, partition, seed_layers, activation_checkpoint_interval,
              pipe_partitioned, grad_partitioned}; deepspeed/runtime/pipe/module.py: PipelineModule(layers, num_stages,
              partition_method = "parameters" (default) | "uniform" | "type:REGEX", activation_checkpoint_interval),
              no explicit boundaries; runtime/utils.py partition_uniform gives the first stages the remainder;
              runtime/pipe/schedule.py: TrainSchedule (1F1B-style, one stage per rank) is the only training schedule.
  Megatron    megatron/training/arguments.py (NVIDIA/Megatron-LM): --pipeline-model-parallel-size, --num-layers,
              --micro-batch-size, --global-batch-size, --num-layers-per-virtual-pipeline-stage,
              --decoder-first-pipeline-num-layers, --decoder-last-pipeline-num-layers, --recompute-granularity
              full|selective, --recompute-method uniform|block, --recompute-num-layers; data-parallel size is
              world_size / (tp x pp x cp). Megatron-Core docs "Custom Pipeline Model Parallel Layout":
              --pipeline-model-parallel-layout "Et*3|(tt|)*29,m|L" (stages split by |, listed in model order, E
              embedding, t decoder layer, L loss; virtual stages per rank = stages / pp).
  V-Half, V-Min (Qi et al., NeurIPS 2024): in none of the three upstream; public code only in the Megatron-LM fork
              sail-sg/zero-bubble-pipeline-parallelism (megatron/training/arguments.py there: --zero-bubble-v-schedule,
              --zero-bubble-v-schedule-mem-setup zb|half|min).
"""

from __future__ import annotations

import enum
import itertools
import json
import math
import shlex
import textwrap
from collections.abc import Sequence

from autotune.candidate import stage_bounds, uniform_split
from autotune.errors import UsageError
from autotune.schedules import SCHEDULES, Schedule
from autotune.tuned_config import TunedConfig


class ExportFormat(str, enum.Enum):
    """Trainers a tuned config can be exported to."""

    torchtitan = "torchtitan"
    deepspeed = "deepspeed"
    megatron = "megatron"

    def __str__(self) -> str:
        return self.value


def export_config(config: TunedConfig, fmt: ExportFormat | str) -> str:
    """The settings of `config` in the target's own format, with comments naming what the target cannot express."""
    try:
        target = ExportFormat(fmt.lower() if isinstance(fmt, str) else fmt)
    except ValueError:
        names = ", ".join(f.value for f in ExportFormat)
        raise UsageError(f"unknown export format {fmt!r}; pass --format with one of: {names}") from None
    render = {
        ExportFormat.torchtitan: _torchtitan,
        ExportFormat.deepspeed: _deepspeed,
        ExportFormat.megatron: _megatron,
    }
    return render[target](config)


def stage_boundaries(layers_per_stage: Sequence[int]) -> list[int]:
    """[3, 2, 2, 3] -> [0, 3, 5, 7, 10]: stage s holds layers boundaries[s] .. boundaries[s+1]-1."""
    return stage_bounds(layers_per_stage)


# ---------------------------------------------------------------------------------------------- torchtitan


def _torchtitan(c: TunedConfig) -> str:
    cannot: list[str] = []
    notes: list[str] = []
    split = list(c.layers_per_stage)
    parts = [[str(i) for i in range(lo, hi)] for lo, hi in _ranges(split)]
    fqns = "[\n" + "".join(f"    {json.dumps(part)},\n" for part in parts) + "]"
    k = max(split)
    by_count = split == list(uniform_split(c.model_layers, len(split))) and math.ceil(c.model_layers / k) == len(split)
    if by_count:
        notes.append(
            f"pipeline_parallel_layers_per_stage = {k} gives exactly this split when your model's first layer is the "
            f"embedding and its last the norm + output (torchtitan counts each as one layer); for any other model "
            f"use the commented module_fqns_per_model_part instead (never both)"
        )
    else:
        cannot.append(
            f"the split {split} as one pipeline_parallel_layers_per_stage (torchtitan spreads layers evenly): "
            f"module_fqns_per_model_part below lists each stage's modules instead"
        )
    notes.append(
        'module_fqns_per_model_part names the children of your build_model() nn.Sequential ("0", "1", ...): '
        "torchtitan builds a stage by deleting the modules it does not hold, so the model's forward must skip "
        "deleted children, as torchtitan's own models do; rename them to your model's FQNs "
        '(e.g. "tok_embeddings", "layers.0", "norm", "output")'
    )
    if c.activation_checkpointing:
        notes.append(
            'mode = "full" recomputes every block on its own, keeping each block\'s input; autotune measured '
            "whole-stage recomputation, which keeps only each stage's input, so expect somewhat more memory"
        )
    if c.wire_dtype == "bfloat16":
        cannot.append(
            "wire_dtype bfloat16 (torchtitan sends activations between stages in the model's own dtype; "
            "training.mixed_precision_param only applies under FSDP)"
        )
    schedule = c.schedule
    if schedule in _V_MEMORY:
        schedule = Schedule.ZBV_ZERO_BUBBLE
        cannot.append(
            f"{_v_memory_lacking(c, 'torch nor torchtitan')}; below is ZBVZeroBubble over the same V placement and "
            f"split, which holds about 1F1B's activations ({c.pipeline_degree} micro-batches on the first rank), so "
            f"it may not fit the memory limit autotune tuned for, and autotune did not measure it"
        )
    if c.pipeline_degree == 1:
        local_batch = f"{c.micro_batch_size}  # no pipeline: gradient accumulation over {c.num_microbatches} steps"
        notes.append(
            f"pp 1 is plain data parallelism: torchtitan accumulates gradients over global_batch_size / "
            f"(local_batch_size x {c.data_parallel_degree} replicas) = {c.num_microbatches} micro-batches, as "
            f"measured; the pipeline keys below are then unused"
        )
    else:
        local_batch = (
            f"{c.global_batch_size // c.data_parallel_degree}  # per data-parallel rank: "
            f"{c.num_microbatches} micro-batches of {c.micro_batch_size}"
        )
    lines = _header(c, "torchtitan", "Merge into your torchtitan job TOML.", cannot, notes, prefix="#")
    lines += [
        "",
        "[training]",
        f"local_batch_size = {local_batch}",
        f"global_batch_size = {c.global_batch_size}",
        "",
        "[parallelism]",
        f"pipeline_parallel_degree = {c.pipeline_degree}",
        f"pipeline_parallel_schedule = {json.dumps(schedule.value)}",
        f"pipeline_parallel_microbatch_size = {c.micro_batch_size}",
        f"data_parallel_replicate_degree = {c.data_parallel_degree}",
        "data_parallel_shard_degree = 1  # plain replicas (DDP), as measured; no FSDP",
    ]
    if by_count:
        lines += [f"pipeline_parallel_layers_per_stage = {k}", f"# module_fqns_per_model_part = {_commented(fqns)}"]
    else:
        lines += [f"module_fqns_per_model_part = {fqns}"]
    lines += [
        "",
        "[activation_checkpoint]",
        f'mode = "{"full" if c.activation_checkpointing else "none"}"',
    ]
    return "\n".join(lines) + "\n"


def _commented(text: str) -> str:
    return text.replace("\n", "\n# ")


# ---------------------------------------------------------------------------------------------- DeepSpeed


def _deepspeed(c: TunedConfig) -> str:
    cannot: list[str] = []
    notes: list[str] = []
    pp = c.pipeline_degree
    split = list(c.layers_per_stage)
    if c.schedule is Schedule.GPIPE:
        cannot.append(
            "schedule GPipe: DeepSpeed's only training schedule is its 1F1B-style TrainSchedule (same bubble, "
            "fewer activations held at once)"
        )
    elif c.schedule is not Schedule.ONE_F_ONE_B:
        split = list(uniform_split(c.model_layers, pp))
        if c.schedule in _V_MEMORY:
            cannot.append(
                f"{_v_memory_lacking(c, 'torch nor DeepSpeed')}; DeepSpeed's TrainSchedule holds about 1F1B's "
                f"activations, so the even split below may not fit the memory limit autotune tuned for"
            )
        cannot.append(
            f"schedule {c.schedule.value} with {c.candidate.stages_per_rank} stages per rank: DeepSpeed runs one "
            f"stage per rank with its 1F1B-style TrainSchedule, so the tuned split does not carry over; below is an "
            f"even split over {pp} stages, which autotune did not measure (measure it with `autotune trial "
            f"{c.model} --schedule 1F1B --layers-per-stage {','.join(map(str, split))} ...`)"
        )
    bounds = stage_boundaries(split)
    if split == list(uniform_split(c.model_layers, pp)):
        method = "uniform"
        notes.append(
            f'partition_method="uniform" gives this split: DeepSpeed\'s partition_uniform hands the remainder to '
            f"the first stages (older releases gave it to the last); check pipe.parts == {bounds}"
        )
    else:
        method = "parameters"
        cannot.append(
            f'the split {split} as a partition_method: PipelineModule takes only "parameters", "uniform" or '
            f'"type:REGEX", none of which names boundaries; "parameters" (balance by parameter count) is the '
            f"closest; the tuned boundaries are parts = {bounds}, check pipe.parts against them"
        )
    interval = max(split) if c.activation_checkpointing else 0
    if c.activation_checkpointing:
        notes.append(
            f"activation_checkpoint_interval={interval} (the largest stage) makes each stage one checkpointed chunk, "
            f"as autotune measured"
        )
    if c.wire_dtype == "bfloat16":
        cannot.append(
            'wire_dtype bfloat16: DeepSpeed sends activations in the model\'s dtype; "bf16": {"enabled": true} '
            "would make the whole model bf16, which is not what was measured"
        )
    call = (
        f"PipelineModule(layers=list(build_model()), num_stages={pp}, partition_method={json.dumps(method)}, "
        f"activation_checkpoint_interval={interval})"
    )
    ranges = ", ".join(f"stage {s}: layers {lo}-{hi - 1}" for s, (lo, hi) in enumerate(_ranges(split)))
    comment = _header(c, "DeepSpeed", "Pass as the DeepSpeed config (JSON).", cannot, notes, prefix="")
    comment += [
        f"Build the model as: pipe = {call}",
        (
            f"  (num_stages and partition_method take effect there, not in the 'pipeline' section; launch {c.gpus} "
            f"ranks: data-parallel size = world size / num_stages = {c.data_parallel_degree})"
        ),
        f"Stage boundaries: parts = {bounds} ({ranges})",
    ]
    config = {
        "train_batch_size": c.global_batch_size,
        "train_micro_batch_size_per_gpu": c.micro_batch_size,
        "gradient_accumulation_steps": c.num_microbatches,
        "pipeline": {"stages": pp, "partition": method, "activation_checkpoint_interval": interval},
        "_comment": [line for line in comment if line],
    }
    return json.dumps(config, indent=2) + "\n"


# ---------------------------------------------------------------------------------------------- Megatron-LM


def _megatron(c: TunedConfig) -> str:
    cannot: list[str] = []
    notes: list[str] = []
    pp = c.pipeline_degree
    split = list(c.layers_per_stage)
    placement = SCHEDULES[c.schedule].placement
    flags: list[tuple[str, str | None]] = [
        ("--pipeline-model-parallel-size", str(pp)),
        ("--num-layers", str(c.model_layers)),
        ("--micro-batch-size", str(c.micro_batch_size)),
        ("--global-batch-size", str(c.global_batch_size)),
    ]
    if c.schedule is Schedule.GPIPE:
        cannot.append("schedule GPipe: Megatron runs 1F1B instead (same bubble, fewer activations held at once)")
    if c.schedule in (Schedule.LOOPED_BFS, Schedule.INTERLEAVED_ZERO_BUBBLE):
        cannot.append(
            f"schedule {c.schedule.value}: Megatron runs its interleaved 1F1B over the same stage placement instead"
        )
    if placement == "v":
        split = list(uniform_split(c.model_layers, pp))
        cannot.append(
            f"schedule {c.schedule.value}: Megatron places virtual stages in a loop, not in a V, so the tuned split "
            f"does not carry over; below is 1F1B over an even split {split}, which autotune did not measure"
        )
    if c.schedule in _V_MEMORY:
        setup = "half" if c.schedule is Schedule.V_HALF else "min"
        cannot.append(
            f"{_v_memory_lacking(c, 'torch nor NVIDIA Megatron-LM')}; the 1F1B below holds about "
            f"{'twice' if setup == 'half' else 'three times'} its activations, so it may not fit the memory limit "
            f"autotune tuned for"
        )
        notes.append(
            f"the sail-sg/zero-bubble-pipeline-parallelism fork of Megatron-LM runs {c.schedule.value} with "
            f"--zero-bubble-v-schedule --zero-bubble-v-schedule-mem-setup {setup} (its own V placement of layers; "
            f"autotune checked the flag names only)"
        )
    if placement == "loop":
        if len(set(split)) == 1:
            flags.append(("--num-layers-per-virtual-pipeline-stage", str(split[0])))
        else:
            flags.append(("--pipeline-model-parallel-layout", _layout(split)))
        if c.num_microbatches % pp:
            notes.append(
                f"older Megatron releases need num_microbatches ({c.num_microbatches}) divisible by pp ({pp}) for "
                f"the interleaved schedule"
            )
    else:
        flags += _uneven_flags(split)
    if any(name == "--pipeline-model-parallel-layout" for name, _ in flags):
        notes.append(
            "in the layout every layer of your nn.Sequential is one decoder layer t; E and L mark where Megatron "
            "puts its own embedding and loss"
        )
    if c.activation_checkpointing:
        flags += [
            ("--recompute-granularity", "full"),
            ("--recompute-method", "uniform"),
            ("--recompute-num-layers", str(max(split))),
        ]
        notes.append(
            f"--recompute-num-layers {max(split)} (the largest stage) makes each stage one recomputed chunk, as "
            f"autotune measured"
        )
    if c.wire_dtype == "bfloat16":
        cannot.append(
            "wire_dtype bfloat16: Megatron sends activations between stages in the model's dtype (--bf16 makes the "
            "whole model bf16)"
        )
    notes.append(
        f"launch {c.gpus} ranks: Megatron derives the data-parallel size {c.data_parallel_degree} as world size / "
        f"(tensor x pipeline x context parallel size)"
    )
    lines = _header(c, "Megatron-LM", "Add these to your pretrain_*.py arguments.", cannot, notes, prefix="#")
    lines.append("AUTOTUNE_MEGATRON_ARGS=(")
    lines += [f"    {name} {shlex.quote(value)}" if value is not None else f"    {name}" for name, value in flags]
    lines.append(")")
    return "\n".join(lines) + "\n"


def _uneven_flags(split: list[int]) -> list[tuple[str, str | None]]:
    """One stage per rank: even needs no flag; first/last stages off the common middle size take
    --decoder-first/last-pipeline-num-layers; anything else needs a layout."""
    if len(set(split)) == 1:
        return []
    first, middle, last = split[0], split[1:-1], split[-1]
    if len(split) == 2:
        return [("--decoder-first-pipeline-num-layers", str(first))]
    if len(set(middle)) == 1:
        flags: list[tuple[str, str | None]] = []
        if first != middle[0]:
            flags.append(("--decoder-first-pipeline-num-layers", str(first)))
        if last != middle[0]:
            flags.append(("--decoder-last-pipeline-num-layers", str(last)))
        return flags
    return [("--pipeline-model-parallel-layout", _layout(split))]


def _layout(split: list[int]) -> str:
    """[3, 2, 2, 3] -> "E,t*3|t*2|t*2|t*3,L" (stages in model order)."""
    stages = [f"t*{n}" if n > 1 else "t" for n in split]
    stages[0] = "E," + stages[0]
    stages[-1] += ",L"
    return "|".join(stages)


# ---------------------------------------------------------------------------------------------- shared

_V_MEMORY = {Schedule.V_HALF: "1/2", Schedule.V_MIN: "1/3"}
"""Controllable-memory V schedules and their activation memory relative to 1F1B."""


def _v_memory_lacking(c: TunedConfig, who: str) -> str:
    return (
        f"schedule {c.schedule.value} (about {_V_MEMORY[c.schedule]} of 1F1B's activation memory, Qi et al. 2024): "
        f"neither {who} ships it; the only public implementation is the sail-sg/zero-bubble-pipeline-parallelism "
        f"fork of Megatron-LM"
    )


def _ranges(split: Sequence[int]) -> list[tuple[int, int]]:
    bounds = stage_boundaries(split)
    return list(itertools.pairwise(bounds))


def _header(c: TunedConfig, target: str, how: str, cannot: list[str], notes: list[str], *, prefix: str) -> list[str]:
    lead = f"{prefix} " if prefix else ""
    lines = [
        f"autotune tuned config -> {target}. {how}",
        (
            f"Model {c.model} (sha256 {c.model_sha256}, {c.model_layers} layers), {c.gpus} ranks = pp "
            f"{c.pipeline_degree} x dp {c.data_parallel_degree}, schedule {c.schedule.value}, B={c.global_batch_size}, "
            f"M={c.micro_batch_size}, {c.num_microbatches} micro-batches, layers_per_stage "
            f"{list(c.layers_per_stage)}; measured {c.measured.step_time_ms:.1f} ms/step on {c.environment.device}."
        ),
    ]
    if cannot:
        lines.append(f"Not expressible in {target}:")
        lines += [f"  - {item}" for item in cannot]
    else:
        lines.append(f"Not expressible in {target}: nothing; everything in the tuned config is expressed below.")
    if notes:
        lines.append("Notes:")
        lines += [f"  - {item}" for item in notes]
    if not prefix:
        return lines
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
