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
from autotune.exports.common import V_MEMORY, header, ranges, v_memory_lacking
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
    if c.wire_dtype == "bfloat16":
        cannot.append(
            'wire_dtype bfloat16: DeepSpeed sends activations in the model\'s dtype; "bf16": {"enabled": true} '
            "would make the whole model bf16, which is not what was measured"
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
        f"launch {c.gpus} ranks: DeepSpeed derives data-parallel size {c.data_parallel_degree} = world size / "
        f"num_stages, and train_batch_size = micro x gradient_accumulation_steps x data-parallel size",
        "pipeline.stages and pipeline.partition are left out: DeepSpeed stores them and never reads them",
    ]
    comment = header(c, target, "Pass as the DeepSpeed config (JSON).", cannot, notes, plan, prefix="")
    config: dict[str, object] = {
        "train_batch_size": c.global_batch_size,
        "train_micro_batch_size_per_gpu": c.micro_batch_size,
        "gradient_accumulation_steps": c.num_microbatches,
    }
    if pipeline:
        config["pipeline"] = pipeline
    config["_comment"] = [line for line in comment if line]
    config[MODULE_KEY] = pipeline_module_code(parts, dual_pipe_v=dual, interval=interval, pp=pp)
    return json.dumps(config, indent=2) + "\n"
