"""The tuned config as a DeepSpeed JSON config plus the PipelineModule code that makes its split hold.

DeepSpeed reads the split only from the PipelineModule built in code: ds_config's pipeline.stages and
pipeline.partition are stored and never read, and no partition_method names explicit boundaries ("uniform" and
"parameters" rebalance, "type:REGEX" balances a layer count). The engine reads `module.parts`, which
PipelineModule._partition_layers sets; the export therefore carries a small subclass that sets the tuned
boundaries there (a DualPipeVModule subclass for DualPipeV, whose _partition_layers doubles the stage count first).
"""

from __future__ import annotations

import json

from autotune.candidate import stage_bounds, uniform_split
from autotune.exports.common import V_MEMORY, bf16_as_measured, header, ranges, v_memory_lacking
from autotune.exports.roles import LayerPlan
from autotune.exports.targets import TargetVersion
from autotune.schedules import SCHEDULES, Schedule
from autotune.tuned_config import TunedConfig

MODULE_KEY = "_autotune_pipeline_module"
"""Key of the JSON that holds the Python snippet, one line per entry (DeepSpeed ignores keys it does not know)."""


def pipeline_module_code(parts: list[int], *, dual_pipe_v: bool, interval: int, pp: int) -> list[str]:
    """The snippet: TUNED_PARTS and a PipelineModule (or DualPipeVModule) subclass that cuts there."""
    lines = [
        "from deepspeed.pipe import PipelineModule",
    ]
    if dual_pipe_v:
        lines.append("from deepspeed.runtime.pipe.dualpipev import DualPipeVModule")
    lines += [
        "",
        f"TUNED_PARTS = {parts}  # stage s holds layers TUNED_PARTS[s] .. TUNED_PARTS[s + 1] - 1",
        "",
        "",
        "class TunedPipelineModule(PipelineModule):",
        '    """A PipelineModule cut at autotune\'s stage boundaries (no partition_method takes explicit ones)."""',
        "",
        "    def _partition_layers(self, method='uniform'):",
        "        if len(TUNED_PARTS) != self.num_stages + 1 or TUNED_PARTS[-1] != len(self._layer_specs):",
        "            raise ValueError(",
        "                f'TUNED_PARTS {TUNED_PARTS} is {len(TUNED_PARTS) - 1} stages of {TUNED_PARTS[-1]} layers; '",
        "                f'this model has {self.num_stages} stages of {len(self._layer_specs)} layers'",
        "            )",
        "        self.parts = list(TUNED_PARTS)",
        "        self._set_bounds(start=self.parts[self.stage_id], stop=self.parts[self.stage_id + 1])",
        "",
    ]
    if dual_pipe_v:
        lines += [
            "",
            "class TunedDualPipeVModule(DualPipeVModule, TunedPipelineModule):",
            '    """DualPipeV over autotune\'s V placement: rank r holds stages r and 2 * pp - 1 - r."""',
            "",
            "",
        ]
    cls = "TunedDualPipeVModule" if dual_pipe_v else "TunedPipelineModule"
    lines += [
        f"# pipe = {cls}(layers=list(build_model()), num_stages={pp}, loss_fn=loss_fn)",
        "# engine, _, _, _ = deepspeed.initialize(model=pipe, model_parameters=pipe.parameters(), "
        "config='ds_config.json')",
    ]
    if interval:
        lines.append(f"# (activation_checkpoint_interval {interval} comes from the config's pipeline section)")
    return lines


def deepspeed_split(c: TunedConfig) -> list[int]:
    """Layers per stage in the export: the tuned split, or an even one over pp where DeepSpeed cannot place it."""
    if SCHEDULES[c.schedule].placement == "loop":
        return list(uniform_split(c.model_layers, c.pipeline_degree))
    return list(c.layers_per_stage)


def precision_settings(c: TunedConfig, cannot: list[str], notes: list[str]) -> dict[str, object]:
    """bf16, zero_optimization and data_types for the tuned precision and data-parallel mode, and what they differ in
    (DeepSpeed 0.19.8: PipelineEngine.__init__ refuses ZeRO-2/3; DeepSpeedEngine._do_optimizer_sanity_check picks
    BF16_Optimizer for bf16 under a pipeline, which partitions fp32 master weights and optimizer state over dp)."""
    settings: dict[str, object] = {}
    dp = c.data_parallel_degree
    bf16 = c.precision == "bf16"
    if bf16:
        settings["bf16"] = {"enabled": True}
    if c.candidate.sharded:
        settings["zero_optimization"] = {"stage": 1}
        if bf16:
            settings["data_types"] = {"grad_accum_dtype": "fp32"}
        cannot.append(
            f"FSDP2's sharding of parameters and gradients over the {dp} data-parallel ranks: DeepSpeed's "
            f'PipelineEngine refuses ZeRO-2 and ZeRO-3 ("ZeRO-2 and ZeRO-3 are incompatible with pipeline '
            f'parallelism"), so this exports ZeRO stage 1, which shards only the optimizer state'
            f"{' and the float32 master weights' if bf16 else ''}; every rank holds its stage's whole parameters "
            f"and gradients, more memory than autotune measured, so check the memory limit"
        )
        if bf16:
            notes.append(
                'bf16 with ZeRO-1 and data_types.grad_accum_dtype fp32: DeepSpeed runs its BF16_Optimizer, bfloat16 '
                "parameters and compute, gradients accumulated and all-reduced in float32, float32 master weights "
                f"and optimizer state partitioned over the {dp} data-parallel ranks"
            )
    elif bf16:
        cannot.append(
            "float32 gradient accumulation without ZeRO: DeepSpeed refuses data_types.grad_accum_dtype fp32 over "
            'bfloat16 parameters at stage 0 ("unsupported mix"), so its pipeline accumulates the micro-batches\' '
            "gradients in bfloat16 (BF16_Optimizer warns that this is not safe numerically)"
        )
        if dp > 1:
            notes.append(
                f"bf16 under DeepSpeed's pipeline runs BF16_Optimizer even at ZeRO stage 0: it partitions the float32 "
                f"master weights and optimizer state over the {dp} data-parallel ranks (like ZeRO-1), less memory "
                f"per rank than the replicas autotune measured"
            )
    if bf16:
        sends = ""
        if c.pipeline_degree > 1:
            sends = "; its stages send bfloat16 activations" + (
                ", half the bytes of the float32 sends autotune measured" if c.wire_dtype == "float32" else ""
            )
        notes.append(
            "bf16.enabled makes the module's parameters bfloat16 (float32 master weights in the optimizer), where "
            f"autotune {bf16_as_measured(c)}{sends}"
        )
    return settings


def export_deepspeed(c: TunedConfig, target: TargetVersion, plan: LayerPlan, why: str) -> str:
    cannot: list[str] = []
    notes: list[str] = [f"target {target.version}: {why}"]
    pp = c.pipeline_degree
    split = deepspeed_split(c)
    placement = SCHEDULES[c.schedule].placement
    dual = placement == "v"
    if c.schedule is Schedule.GPIPE:
        cannot.append(
            "schedule GPipe: DeepSpeed's training schedules are its 1F1B-style TrainSchedule (used below, same "
            "split, same bubble, fewer activations held at once) and DualPipeV"
        )
    elif placement == "loop":
        cannot.append(
            f"schedule {c.schedule.value} with {c.candidate.stages_per_rank} stages per rank: DeepSpeed runs one "
            f"stage per rank with its 1F1B-style TrainSchedule (or two in a V with DualPipeV), so the tuned split "
            f"does not carry over; below is an even split over {pp} stages, which autotune did not measure "
            f"(measure it with `autotune trial {c.model} --schedule 1F1B --layers-per-stage "
            f"{','.join(map(str, split))} ...`)"
        )
    elif dual and c.schedule is not Schedule.DUAL_PIPE_V:
        what = (
            v_memory_lacking(c, "torch nor DeepSpeed")
            if c.schedule in V_MEMORY
            else f"schedule {c.schedule.value}: DeepSpeed does not ship it"
        )
        cannot.append(
            f"{what}; below is DeepSpeed's DualPipeV over the same V placement and split, which autotune did not "
            f"measure and which may not fit the memory limit autotune tuned for"
        )
    if dual and c.num_microbatches < 2 * pp:
        cannot.append(
            f"{c.num_microbatches} micro-batches under DualPipeV: DeepSpeed's DualPipeVEngine needs "
            f"gradient_accumulation_steps >= 2 x pp = {2 * pp}; raise the batch or choose 1F1B"
        )
    if c.wire_dtype == "bfloat16" and c.precision == "fp32":
        cannot.append(
            'wire_dtype bfloat16: DeepSpeed sends activations in the model\'s dtype; "bf16": {"enabled": true} '
            "would make the whole model bf16, which is not what was measured"
        )
    precision = precision_settings(c, cannot, notes)
    tp = c.tensor_parallel_degree
    if tp > 1:
        dp = c.data_parallel_degree
        cannot.append(
            f"tensor_parallel_degree {tp}: DeepSpeed's pipeline engine has no tensor parallelism of its own. The "
            f"layers must split themselves (as Megatron-DeepSpeed's do) and the PipelineModule be built with "
            f"topology=PipeModelDataParallelTopology(num_pp={pp}, num_mp={tp}, num_dp={dp}) in place of num_stages "
            f"(its model axis innermost, as tuned). With the model's own layers, launch pp x dp = {pp * dp} ranks: "
            f"each then holds its stage's whole layers, about {tp} times the parameter, gradient and optimizer memory "
            f"autotune measured per rank, so check the memory limit"
        )
    cannot += [f"layer roles: {problem}" for problem in plan.problems]
    parts = stage_bounds(split)
    interval = max(split) if c.activation_checkpointing else 0
    pipeline: dict[str, object] = {}
    if c.activation_checkpointing:
        pipeline = {"activation_checkpoint_interval": interval, "use_reentrant": False}
        notes.append(
            f"pipeline.activation_checkpoint_interval {interval} (the largest stage) makes each stage one "
            f"checkpointed chunk, as autotune measured; use_reentrant false because DeepSpeed's default reentrant "
            f"checkpoint fails on a first layer that takes integer token ids"
        )
    if dual:
        pipeline.update(pipe_partitioned=False, grad_partitioned=False)
        notes.append("DualPipeVEngine refuses pipe_partitioned / grad_partitioned, so both are off")
    stage_text = ", ".join(f"stage {s}: layers {lo}-{hi - 1}" for s, (lo, hi) in enumerate(ranges(split)))
    ranks = "; ".join(f"rank {r}: stages {r} and {2 * pp - 1 - r}" for r in range(pp)) if dual else "one stage per rank"
    cls = "TunedDualPipeVModule" if dual else "TunedPipelineModule"
    notes += [
        f"build the model with the {MODULE_KEY} code below: {cls}(layers=list(build_model()), num_stages={pp}, "
        f"loss_fn=loss_fn) cuts at parts = {parts} ({stage_text}; {ranks}); check pipe.parts == {parts}",
        f"launch {c.gpus // tp} ranks{f' ({c.gpus} with the tensor-parallel topology above)' if tp > 1 else ''}: "
        f"DeepSpeed derives data-parallel size {c.data_parallel_degree} = world size / (num_stages x model-parallel "
        f"size), and train_batch_size = micro x gradient_accumulation_steps x data-parallel size",
        "pipeline.stages and pipeline.partition are left out: DeepSpeed stores them and never reads them",
    ]
    comment = header(c, target, "Pass as the DeepSpeed config (JSON).", cannot, notes, plan, prefix="")
    config: dict[str, object] = {
        "train_batch_size": c.global_batch_size,
        "train_micro_batch_size_per_gpu": c.micro_batch_size,
        "gradient_accumulation_steps": c.num_microbatches,
    }
    config.update(precision)
    if pipeline:
        config["pipeline"] = pipeline
    config["_comment"] = [line for line in comment if line]
    config[MODULE_KEY] = pipeline_module_code(parts, dual_pipe_v=dual, interval=interval, pp=pp)
    return json.dumps(config, indent=2) + "\n"
