"""The tuned config as Megatron-LM flags: --num-layers counts transformer blocks only.

Megatron puts its embedding on the first stage and its output layer and loss on the last, on top of the
transformer layers each stage builds. Uneven splits, from plainest to most general (checked against
megatron/training/arguments.py validate_args and TransformerConfig.__post_init__):
  --account-for-embedding-in-pipeline-split / --account-for-loss-in-pipeline-split: the embedding / loss counts as
      one layer, so (blocks + 1 [+ 1]) / stages per stage and one fewer block on the first / last stage;
  --decoder-first-pipeline-num-layers / --decoder-last-pipeline-num-layers: one stage per rank, the middle even;
  --pipeline-model-parallel-layout "E,t*2|t*3|t*3,L": every stage listed in model order (E embedding, t block,
      L loss), virtual stages per rank = stages / pp, placed round-robin (loop placement).
"""

from __future__ import annotations

import dataclasses

from autotune.candidate import uniform_split
from autotune.exports.common import TP_AS_MEASURED, V_MEMORY, bf16_as_measured, header, shell_array, v_memory_lacking
from autotune.exports.roles import LayerPlan, StageLayers
from autotune.exports.targets import TargetVersion
from autotune.schedules import SCHEDULES, Schedule
from autotune.tuned_config import TunedConfig

ARRAY = "AUTOTUNE_MEGATRON_ARGS"
Flags = list[tuple[str, str | None]]


def megatron_blocks(n_blocks: int, n_stages: int, *, embedding: bool, loss: bool) -> list[int] | None:
    """Blocks per stage under --account-for-embedding/loss-in-pipeline-split (or neither); None where Megatron
    refuses (the count, plus one per accounted layer, must divide evenly)."""
    total = n_blocks + embedding + loss
    if total % n_stages:
        return None
    per_stage = total // n_stages
    blocks = [per_stage] * n_stages
    blocks[0] -= embedding
    blocks[-1] -= loss
    return blocks if min(blocks) >= 0 else None


def layout(stages: list[StageLayers]) -> str:
    """[E+3 blocks, 2, 3+L] -> "E,t*3|t*2|t*3,L"."""
    texts = []
    for stage in stages:
        pieces = (
            (["E"] if stage.embedding else [])
            + ([f"t*{stage.blocks}" if stage.blocks > 1 else "t"] if stage.blocks else [])
            + (["L"] if stage.head else [])
        )
        texts.append(",".join(pieces))
    return "|".join(texts)


def split_flags(plan: LayerPlan, pp: int) -> Flags:
    """The plainest flags that make Megatron build plan.block_split transformer layers per stage."""
    stages = list(plan.stages)
    if not plan.known:  # every layer a transformer layer; Megatron's own embedding and loss on the end stages
        stages[0] = StageLayers(embedding=True, blocks=stages[0].blocks, head=stages[0].head)
        stages[-1] = StageLayers(embedding=stages[-1].embedding, blocks=stages[-1].blocks, head=True)
    blocks = [s.blocks for s in stages]
    n, n_stages = sum(blocks), len(stages)
    ends_only = (
        stages[0].embedding
        and stages[-1].head
        and not any(s.embedding for s in stages[1:])
        and not any(s.head for s in stages[:-1])
    )
    if ends_only and not plan.problems:
        for embedding, loss in ((False, False), (True, False), (False, True), (True, True)):
            if (embedding or loss) and (not plan.known or n_stages > pp):
                break  # only for a model whose embedding and head are known, one stage per rank
            if megatron_blocks(n, n_stages, embedding=embedding, loss=loss) != blocks:
                continue
            flags: Flags = []
            if n_stages > pp:
                flags.append(("--num-layers-per-virtual-pipeline-stage", str(n // n_stages)))
            if embedding:
                flags.append(("--account-for-embedding-in-pipeline-split", None))
            if loss:
                flags.append(("--account-for-loss-in-pipeline-split", None))
            return flags
        if n_stages == pp and min(blocks) > 0:
            first, middle, last = blocks[0], blocks[1:-1], blocks[-1]
            if n_stages == 2:
                return [("--decoder-first-pipeline-num-layers", str(first))]
            if len(set(middle)) == 1:
                flags = []
                if first != middle[0]:
                    flags.append(("--decoder-first-pipeline-num-layers", str(first)))
                if last != middle[0]:
                    flags.append(("--decoder-last-pipeline-num-layers", str(last)))
                return flags
    return [("--pipeline-model-parallel-layout", layout(stages))]


def megatron_plan(c: TunedConfig, plan: LayerPlan) -> LayerPlan:
    """The stages Megatron is asked to build: the tuned ones, or 1F1B over an even split for a V placement."""
    if SCHEDULES[c.schedule].placement != "v":
        return plan
    pp = c.pipeline_degree
    even = uniform_split(plan.blocks, pp)
    stages = tuple(
        StageLayers(embedding=s == 0 and plan.known, blocks=n, head=s == pp - 1 and plan.known)
        for s, n in enumerate(even)
    )
    return dataclasses.replace(plan, stages=stages)


def precision_flags(c: TunedConfig, cannot: list[str], notes: list[str]) -> Flags:
    """--bf16 and --use-distributed-optimizer for the tuned precision and data-parallel mode, and what they differ in
    (core_v0.19.0 megatron/training/arguments.py validate_args; megatron/core/optimizer/distrib_optimizer.py)."""
    flags: Flags = []
    dp = c.data_parallel_degree
    if c.precision == "bf16":
        flags.append(("--bf16", None))
        notes.append(
            "--bf16: bfloat16 parameters and compute with float32 main parameters in the optimizer; validate_args "
            "then accumulates and all-reduces gradients in float32 (accumulate_allreduce_grads_in_fp32), as tuned. "
            f"Megatron holds the bfloat16 parameters beside the float32 main copy, where autotune {bf16_as_measured(c)}"
            + (
                "; its stages send bfloat16 activations, half the bytes of the float32 sends autotune measured"
                if c.pipeline_degree > 1 and c.wire_dtype == "float32"
                else ""
            )
        )
    if c.candidate.sharded:
        flags.append(("--use-distributed-optimizer", None))
        cannot.append(
            f"FSDP2's sharding of parameters and gradients over the {dp} data-parallel ranks: "
            f"--use-distributed-optimizer (ZeRO-1-like) shards the float32 main parameters and optimizer state over "
            f"them, reduce-scatters the gradients from a full-size gradient buffer and all-gathers the updated "
            f"parameters after the step; every rank holds its stage's whole parameters and gradient buffer, more "
            f"memory than autotune measured, so check the memory limit. Megatron's own FSDP options "
            f"(--use-megatron-fsdp with --data-parallel-sharding-strategy optim_grads_params, or --use-torch-fsdp2, "
            f"which refuses pipeline parallelism) shard all three; autotune did not check them"
        )
    return flags


def export_megatron(c: TunedConfig, target: TargetVersion, plan: LayerPlan, why: str) -> str:
    cannot: list[str] = []
    notes: list[str] = [f"target {target.version}: {why}"]
    pp = c.pipeline_degree
    placement = SCHEDULES[c.schedule].placement
    if c.schedule is Schedule.GPIPE:
        cannot.append("schedule GPipe: Megatron runs 1F1B instead (same bubble, fewer activations held at once)")
    if c.schedule in (Schedule.LOOPED_BFS, Schedule.INTERLEAVED_ZERO_BUBBLE):
        cannot.append(
            f"schedule {c.schedule.value}: Megatron runs its interleaved 1F1B over the same stage placement instead"
        )
    if placement == "v":
        cannot.append(
            f"schedule {c.schedule.value}: Megatron places virtual stages in a loop, not in a V, so the tuned split "
            f"does not carry over; below is 1F1B over an even split of {list(uniform_split(plan.blocks, pp))} "
            f"transformer blocks, which autotune did not measure"
        )
    plan = megatron_plan(c, plan)
    if c.schedule in V_MEMORY:
        setup = "half" if c.schedule is Schedule.V_HALF else "min"
        cannot.append(
            f"{v_memory_lacking(c, 'torch nor NVIDIA Megatron-LM')}; the 1F1B below holds about "
            f"{'twice' if setup == 'half' else 'three times'} its activations, so it may not fit the memory limit "
            f"autotune tuned for"
        )
        notes.append(
            f"the sail-sg/zero-bubble-pipeline-parallelism fork of Megatron-LM runs {c.schedule.value} with "
            f"--zero-bubble-v-schedule --zero-bubble-v-schedule-mem-setup {setup} (its own V placement of layers; "
            f"autotune checked the flag names only)"
        )
    cannot += [f"layer roles: {problem}" for problem in plan.problems]
    if not plan.known:
        cannot.append(
            f"--num-layers {plan.blocks} assumes every one of the model's {c.model_layers} layers is a transformer "
            f"block: Megatron adds its own embedding and output layer, so if the model's first layer is an embedding "
            f"and its last a head, Megatron builds 2 transformer layers too many and shifts the split; set "
            f"layer_roles in the config (or LAYER_ROLES in the model file) and export again"
        )
    flags: Flags = [
        ("--pipeline-model-parallel-size", str(pp)),
        ("--num-layers", str(plan.blocks)),
        ("--micro-batch-size", str(c.micro_batch_size)),
        ("--global-batch-size", str(c.global_batch_size)),
    ]
    tp = c.tensor_parallel_degree
    if tp > 1:
        flags.append(("--tensor-model-parallel-size", str(tp)))
        notes.append(
            f"--tensor-model-parallel-size {tp}: Megatron splits attention and MLP column- then row-wise over {tp} "
            f"consecutive ranks (tp innermost), as autotune applied the model's own plan; the model's heads and "
            f"query groups (--num-attention-heads, --num-query-groups) must divide by {tp}. --sequence-parallel is "
            f"left off because autotune did not use it: {TP_AS_MEASURED}; --sequence-parallel would shard the norms' "
            f"and dropouts' activations over the sequence (a reduce-scatter and an all-gather in place of each "
            f"all-reduce, less activation memory). Megatron's output layer keeps the logits split by vocabulary and "
            f"computes a vocabulary-parallel cross-entropy: each rank holds 1/{tp} of the logits, a little less memory "
            f"than measured"
        )
    split = split_flags(plan, pp)
    flags += split
    if any(name == "--pipeline-model-parallel-layout" for name, _ in split):
        notes.append(
            "in the layout each stage is listed in model order: E embedding, t one transformer layer, L output "
            "layer and loss; Megatron places stage i on rank i mod pp"
        )
    if len(plan.stages) > pp and c.num_microbatches % pp:
        notes.append(
            f"older Megatron releases need num_microbatches ({c.num_microbatches}) divisible by pp ({pp}) for "
            f"the interleaved schedule"
        )
    if c.activation_checkpointing:
        most = max(plan.block_split)
        flags += [
            ("--recompute-granularity", "full"),
            ("--recompute-method", "uniform"),
            ("--recompute-num-layers", str(most)),
        ]
        notes.append(
            f"--recompute-num-layers {most} (the most transformer layers on one stage) makes each stage's blocks one "
            f"recomputed chunk, as autotune measured (Megatron does not recompute its embedding and output layer)"
        )
    if c.wire_dtype == "bfloat16" and c.precision == "fp32":
        cannot.append(
            "wire_dtype bfloat16: Megatron sends activations between stages in the model's dtype (--bf16 makes the "
            "whole model bf16)"
        )
    flags += precision_flags(c, cannot, notes)
    notes.append(
        f"launch {c.gpus} ranks: Megatron derives the data-parallel size {c.data_parallel_degree} as world size / "
        f"(tensor x pipeline x context parallel size)"
    )
    environment = [("CUDA_DEVICE_MAX_CONNECTIONS", "1")] if tp > 1 else []
    if environment:
        notes.append(
            "CUDA_DEVICE_MAX_CONNECTIONS=1 (exported below): validate_args requires it with tensor parallelism on GPUs "
            "before Blackwell, so the tp collectives are queued in order with the matrix products around them"
        )
    lines = header(c, target, "Add these to your pretrain_*.py arguments.", cannot, notes, plan, prefix="#")
    return "\n".join(lines + shell_array(ARRAY, flags) + [f"export {k}={v}" for k, v in environment]) + "\n"
