"""The tuned config as torchtitan settings: a TOML job file (0.2 and older) or --section.key flags (0.3, main).

torchtitan builds a stage by keeping the named modules of its own model (tok_embeddings, layers.N, norm, and the
head: `output` up to 0.2, `lm_head` from 0.3) and deleting the rest. Its automatic split counts transformer blocks
plus `first/last_stage_less_layers` for the embedding and the head (torchtitan/distributed/pipeline_parallel.py,
_generate_llm_fqn_per_model_part, mirrored in `torchtitan_blocks`); when no such setting reproduces the tuned split,
module_fqns_per_model_part lists every stage's modules.
"""

from __future__ import annotations

import json
import math

from autotune.exports.common import TP_AS_MEASURED, V_MEMORY, header, ranges, shell_array, v_memory_lacking
from autotune.exports.roles import LayerPlan
from autotune.exports.targets import TargetVersion
from autotune.schedules import SCHEDULES, Schedule
from autotune.tuned_config import TunedConfig

DEFAULT_SEQ_LEN = 2048
"""torchtitan's default sequence length (training.seq_len in 0.3, training.max_context_length on main)."""
ARRAY = "AUTOTUNE_TORCHTITAN_ARGS"


def torchtitan_blocks(num_stages: int, num_layers: int, input_weight: int, output_weight: int) -> list[int] | None:
    """Transformer blocks per stage as torchtitan's _generate_llm_fqn_per_model_part hands them out; None where
    torchtitan refuses the numbers or would leave blocks out."""
    if num_stages == 1:
        return [num_layers]
    effective = num_layers + input_weight + output_weight
    per_stage, extra = divmod(effective, num_stages)
    if per_stage == 0 or input_weight > per_stage or output_weight > per_stage:
        return None
    blocks: list[int] = []
    placed = 0
    for stage in range(num_stages):
        take = per_stage + (1 if stage < extra else 0)
        take -= input_weight if stage == 0 else output_weight if stage == num_stages - 1 else 0
        take = max(0, min(take, num_layers - placed))
        blocks.append(take)
        placed += take
    return blocks if placed == num_layers else None


def split_settings(plan: LayerPlan, c: TunedConfig) -> dict[str, int] | None:
    """The fewest of pipeline_parallel_layers_per_stage / first / last_stage_less_layers (torchtitan's defaults:
    none, 1, 1) that make torchtitan's own split equal the tuned one; None when no values do."""
    stages = plan.stages
    if not plan.known or plan.problems or any(s.embedding for s in stages[1:]) or any(s.head for s in stages[:-1]):
        return None
    n_stages, n_blocks = len(stages), plan.blocks
    multi = SCHEDULES[c.schedule].placement != "single"
    default_stages = c.pipeline_degree * (2 if multi else 1)
    best: tuple[int, dict[str, int]] | None = None
    weights = range(min(n_blocks, max(plan.block_split) + 2) + 1)  # larger weights only empty the end stages
    for first in weights:
        for last in weights:
            if torchtitan_blocks(n_stages, n_blocks, first, last) != plan.block_split:
                continue
            settings = {}
            if n_stages != default_stages:
                effective = n_blocks + first + last
                per_stage = math.ceil(effective / n_stages)
                if math.ceil(effective / per_stage) != n_stages:
                    continue
                settings["layers_per_stage"] = per_stage
            if first != 1:
                settings["first_stage_less_layers"] = first
            if last != 1:
                settings["last_stage_less_layers"] = last
            if best is None or len(settings) < best[0]:
                best = (len(settings), settings)
    return None if best is None else best[1]


def module_fqns(plan: LayerPlan, target: TargetVersion) -> list[list[str]]:
    """Each stage's modules: torchtitan's names when the roles are known, the nn.Sequential's children otherwise."""
    if not plan.known:
        return [[str(i) for i in range(lo, hi)] for lo, hi in ranges(plan.block_split)]
    parts: list[list[str]] = []
    block = 0
    for s, stage in enumerate(plan.stages):
        names = [target.keys["embedding_fqn"]] if s == 0 else []
        names += [f"layers.{i}" for i in range(block, block + stage.blocks)]
        block += stage.blocks
        if s == len(plan.stages) - 1:
            names += target.keys["head_fqns"].split(",")
        parts.append(names)
    return parts


def export_torchtitan(c: TunedConfig, target: TargetVersion, plan: LayerPlan, seq_len: int | None, why: str) -> str:
    cannot: list[str] = []
    notes: list[str] = [f"target {target.version}: {why}"]
    keys = target.keys
    schedule = c.schedule
    if schedule in V_MEMORY:
        schedule = Schedule.ZBV_ZERO_BUBBLE
        cannot.append(
            f"{v_memory_lacking(c, 'torch nor torchtitan')}; below is ZBVZeroBubble over the same V placement and "
            f"split, which holds about 1F1B's activations ({c.pipeline_degree} micro-batches on the first rank), so "
            f"it may not fit the memory limit autotune tuned for, and autotune did not measure it"
        )
    bf16_stages = c.precision == "bf16" and not _fp32_under_0_2(c, target)
    if c.wire_dtype == "bfloat16" and not bf16_stages:
        cannot.append(
            "wire_dtype bfloat16 (torchtitan sends activations between stages in the dtype its stages compute in: "
            "float32 here)"
        )
    cannot += [f"layer roles: {problem}" for problem in plan.problems]

    settings: list[tuple[str, object]] = []  # (key, value); value None = a bare boolean flag
    # ---- batch
    if target.version == "main":
        length = seq_len or DEFAULT_SEQ_LEN
        if seq_len is None:
            notes.append(
                f"main counts the batch in tokens: {DEFAULT_SEQ_LEN} tokens per sample (torchtitan's default "
                f"max_context_length) is assumed; set SEQ_LEN in the model file, or multiply M and B by your "
                f"sequence length yourself"
            )
        else:
            notes.append(f"main counts the batch in tokens: {seq_len} per sample (SEQ_LEN in the model file)")
        settings += [
            (keys["tokens_per_microbatch"], c.micro_batch_size * length),
            (keys["tokens_per_step"], c.global_batch_size * length),
        ]
        if c.pipeline_degree > 1:
            settings.append((keys["num_microbatches"], c.num_microbatches))
    else:
        local = c.micro_batch_size if c.pipeline_degree == 1 else c.global_batch_size // c.data_parallel_degree
        settings += [(keys["local_batch_size"], local), (keys["global_batch_size"], c.global_batch_size)]
        if c.pipeline_degree > 1:
            settings.append((keys["microbatch_size"], c.micro_batch_size))
            notes.append(
                f"local_batch_size {local} per data-parallel rank is {c.num_microbatches} micro-batches of "
                f"{c.micro_batch_size} (torchtitan: n_microbatches = local_batch_size // "
                f"pipeline_parallel_microbatch_size)"
            )
    if c.pipeline_degree == 1:
        notes.append(
            f"pp 1 is plain data parallelism: torchtitan accumulates gradients over {c.num_microbatches} "
            f"micro-batches per step, as measured; the pipeline settings are then unused"
        )
    # ---- layout, data parallelism and precision
    dp = c.data_parallel_degree
    settings += [
        (keys["pipeline_degree"], c.pipeline_degree),
        (keys["schedule"], schedule.value),
        (keys["dp_replicate"], 1 if c.candidate.sharded else dp),
        (keys["dp_shard"], dp if c.candidate.sharded else 1),
    ]
    if c.candidate.sharded:
        policy = reshard_policy(c)
        settings.append((keys["fsdp_reshard"], policy))
    # torchtitan's default param dtype is bfloat16: fp32 is written out too
    settings += [
        (keys["mixed_precision_param"], "bfloat16" if c.precision == "bf16" else "float32"),
        (keys["mixed_precision_reduce"], "float32"),
    ]
    data_parallel_notes(c, target, cannot, notes)
    if c.tensor_parallel_degree > 1:
        settings.append((keys["tensor_parallel"], c.tensor_parallel_degree))
        tensor_parallel_settings(c, target, settings, cannot, notes)
    if c.pipeline_degree > 1 and "cuda_graphs" in keys:
        settings.append((keys["cuda_graphs"], None))
        notes.append("--training.disable_cuda_graphs: torchtitan 0.3 and later refuse pipeline parallelism otherwise")
    split = split_settings(plan, c) if c.pipeline_degree > 1 else {}
    if split is not None:
        settings += [(keys[name], value) for name, value in split.items()]
        notes.append(
            f"torchtitan's own split gives transformer blocks per stage {plan.block_split} "
            f"({'with its defaults' if not split else ', '.join(f'{k} {v}' for k, v in split.items())}); "
            f"the embedding goes to the first stage and norm + {keys['head_fqns'].split(',')[-1]} to the last"
        )
    else:
        settings.append((keys["module_fqns"], module_fqns(plan, target)))
        if plan.known:
            cannot.append(
                f"the split {plan.block_split} (transformer blocks per stage) through torchtitan's layer counts "
                f"(pipeline_parallel_layers_per_stage, first/last_stage_less_layers): module_fqns_per_model_part "
                f"lists each stage's modules instead"
            )
        else:
            notes.append(
                'module_fqns_per_model_part names the children of your build_model() nn.Sequential ("0", "1", ...); '
                "torchtitan's own models call them tok_embeddings, layers.N, norm, "
                f"{keys['head_fqns'].split(',')[-1]}: set layer_roles in the config (or LAYER_ROLES in the model "
                "file) and export again to get those names and torchtitan's own layer counts"
            )
    if c.activation_checkpointing:
        notes.append(
            "full activation checkpointing recomputes every block on its own, keeping each block's input; autotune "
            "measured whole-stage recomputation, which keeps only each stage's input, so expect somewhat more memory"
        )
    mode = "full" if c.activation_checkpointing else "none"
    if target.form == "toml":
        how = "Merge into your torchtitan job TOML (--job.config_file)."
        lines = header(c, target, how, cannot, notes, plan, prefix="#")
        return "\n".join(lines + _toml(settings, mode)) + "\n"
    how = (
        f"Add to the torchtitan command line: torchrun --nproc-per-node {c.gpus} -m torchtitan.train --module MODEL "
        f'--config CONFIG [your flags] "${{{ARRAY}[@]}}". The bash array holds one --section.key value per line; '
        f"its last line is the activation-checkpoint subcommand, so your own flags go before it."
    )
    lines = header(c, target, how, cannot, notes, plan, prefix="#")
    args: list[tuple[str, str | list[str] | None]] = [(f"--{key}", _flag_value(value)) for key, value in settings]
    args.append((f"activation-checkpoint:{mode}", None))
    return "\n".join(lines + shell_array(ARRAY, args)) + "\n"


def reshard_policy(c: TunedConfig) -> str:
    """parallelism.fsdp_reshard_after_forward for a sharded config: the tuned knob, spelled out. torchtitan's
    "default" is `reshard_after_forward = not pp_enabled` (distributed/fsdp.py): it keeps the stage gathered under a
    pipeline but reshards at pp 1, so it reproduces the tuned knob only sometimes and is never written."""
    return "always" if c.fsdp_reshard_after_forward else "never"


def tensor_parallel_settings(
    c: TunedConfig, target: TargetVersion, settings: list[tuple[str, object]], cannot: list[str], notes: list[str]
) -> None:
    """Sequence and loss parallelism as autotune measured them (both off), where the target can say so, and what
    differs (torchtitan 0.3.0 models/llama3/sharding.py and models/common/decoder_sharding.py: sequence parallel by
    parallelism.enable_sequence_parallel, the head's logits always sharded; 0.2.2 models/llama3/infra/parallelize.py:
    SequenceParallel on every norm, loss parallel unless parallelism.disable_loss_parallel)."""
    tp, keys = c.tensor_parallel_degree, target.keys
    notes.append(
        f"tensor_parallel_degree {tp}: torchtitan shards its own model with its own plan (embedding and head by "
        f"vocabulary, attention and feed-forward column- then row-wise) over {tp} consecutive ranks (tp is the "
        f"innermost dimension of its mesh), as autotune applied the model's own plan; autotune measured: "
        f"{TP_AS_MEASURED}"
    )
    if "sequence_parallel_off" in keys:
        settings.append((keys["sequence_parallel_off"], None))
        notes.append(
            "parallelism.no_enable_sequence_parallel keeps activations whole between blocks, as measured; torchtitan's "
            "default shards the norms' activations over the sequence (a reduce-scatter and an all-gather in place of "
            "each all-reduce, less activation memory, seq_len divisible by tp)"
        )
        notes.append(
            f"torchtitan keeps the logits sharded over the tp ranks and computes the loss on the shards (loss "
            f"parallel; {target.version} has no switch for it): each rank holds 1/{tp} of the logits where autotune "
            f"gathered them whole, a little less memory than measured"
        )
    else:
        settings.append((keys["loss_parallel_off"], True))
        notes.append("parallelism.disable_loss_parallel: the logits are gathered whole for the loss, as measured")
        cannot.append(
            "sequence parallelism off: torchtitan 0.2 applies SequenceParallel to every norm whenever "
            "tensor_parallel_degree > 1 (no switch), sharding their activations over the sequence (a reduce-scatter "
            "and an all-gather in place of each all-reduce autotune measured, less activation memory); export with "
            "--target 0.3 to keep them whole"
        )


def _fp32_under_0_2(c: TunedConfig, target: TargetVersion) -> bool:
    """torchtitan 0.2 turns mixed precision off under a pipeline without FSDP (utils.maybe_enable_amp warns
    "Mixed precision training with TP or PP is only supported when FSDP/HSDP/CP is enabled")."""
    return target.version == "0.2" and c.pipeline_degree > 1 and not c.candidate.sharded


def data_parallel_notes(c: TunedConfig, target: TargetVersion, cannot: list[str], notes: list[str]) -> None:
    """What torchtitan does with the dp degrees and the precision written, where that differs from what autotune
    measured (torchtitan 0.3.0 parallelize_llama, distributed/fsdp.py; 0.2.2 parallelize.py, distributed/utils.py)."""
    dp, pp = c.data_parallel_degree, c.pipeline_degree
    bf16 = c.precision == "bf16"
    if c.candidate.sharded:
        policy = reshard_policy(c)
        kept = (
            "gathers each block's parameters again for every micro-batch's backward"
            if c.fsdp_reshard_after_forward
            else "keeps each stage's parameters gathered from its first forward to its last backward of the step"
        )
        default = "would keep them gathered" if pp > 1 else "would reshard all but norm + head"
        notes.append(
            f"data_parallel_shard_degree {dp}: FSDP2 (fully_shard) over each stage's {dp} data-parallel ranks, as "
            f"tuned; torchtitan wraps each transformer block, the embedding, and norm + head as FSDP units of their "
            f"own. fsdp_reshard_after_forward {policy} {kept}, as tuned (torchtitan's default, "
            f"reshard_after_forward = not pp_enabled, {default} at pp {pp})"
        )
        if bf16:
            notes.append(
                "training.mixed_precision_param bfloat16, mixed_precision_reduce float32: FSDP2's "
                "MixedPrecisionPolicy computes in bfloat16 over float32 sharded parameters and reduce-scatters "
                "gradients in float32, as tuned"
            )
    elif target.version == "0.2":
        if dp > 1 and pp > 1:
            cannot.append(
                f"pp {pp} x dp {dp} replicated: torchtitan 0.2 applies DDP only without other parallelism and refuses "
                f'this layout at start ("DDP has not supported > 1D parallelism"); export with --target 0.3, where '
                f"replicas are fully_shard with a shard degree of 1"
            )
        if bf16 and pp > 1:
            cannot.append(
                "precision bf16 without FSDP under a pipeline: torchtitan 0.2 turns mixed precision off there "
                '("Mixed precision training with TP or PP is only supported when FSDP/HSDP/CP is enabled") and '
                "trains in float32"
            )
        elif bf16:
            notes.append("training.mixed_precision_param bfloat16 without FSDP: torch.autocast, as tuned")
    elif dp > 1 or bf16:
        what = (
            f"data_parallel_replicate_degree {dp} with data_parallel_shard_degree 1: torchtitan {target.version} "
            f"has no DDP; it runs fully_shard over a (replicate {dp}, shard 1) mesh, HSDP with shards of one rank, so "
            f"parameters stay whole on every rank and gradients are all-reduced in float32, as tuned"
            if dp > 1
            else "data parallelism off (both degrees 1)"
        )
        if bf16:
            held = "kept for the step under the pipeline" if pp > 1 else "freed after each forward"
            what += (
                f"; bfloat16 comes from FSDP2's MixedPrecisionPolicy (torchtitan applies it even at shard degree 1): "
                f"a bfloat16 copy of each block's parameters, {held} (fsdp_reshard_after_forward default), where "
                f"autotune measured torch.autocast, which casts per operation; expect up to 2 bytes per parameter more"
            )
        notes.append(what)
    if bf16 and not _fp32_under_0_2(c, target) and c.wire_dtype == "float32" and pp > 1:
        notes.append(
            "with bfloat16 parameters torchtitan's stages send bfloat16 activations, half the bytes of the float32 "
            "sends (wire_dtype float32) autotune measured"
        )


def _flag_value(value: object) -> str | list[str] | None:
    if value is None:
        return None
    if isinstance(value, list):  # list[list[str]]: one comma-joined argument per stage (torchtitan's tyro rule)
        return [",".join(part) for part in value]
    return str(value)


def _toml(settings: list[tuple[str, object]], mode: str) -> list[str]:
    sections: dict[str, list[str]] = {}
    for key, value in settings:
        section, name = key.split(".", 1)
        if isinstance(value, list):
            text = "[\n" + "".join(f"    {json.dumps(part)},\n" for part in value) + "]"
        else:
            text = json.dumps(value)
        sections.setdefault(section, []).append(f"{name} = {text}")
    sections.setdefault("activation_checkpoint", []).append(f'mode = "{mode}"')
    lines: list[str] = []
    for section, entries in sections.items():
        lines += ["", f"[{section}]", *entries]
    return lines
