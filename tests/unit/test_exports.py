"""Exports: each parses in its target's format and carries the config's values; what cannot be said is said so."""

from __future__ import annotations

import argparse
import itertools
import json
import math
import re
import shlex
import sys
from typing import Any

import pytest

from autotune.candidate import Candidate
from autotune.errors import UsageError
from autotune.exports import ExportFormat, export_config, stage_boundaries
from autotune.schedules import Schedule
from autotune.tuned_config import Environment, MeasuredResult, TunedConfig


def make_config(
    schedule: Schedule = Schedule.ONE_F_ONE_B,
    split: tuple[int, ...] = (3, 2, 2, 3),
    *,
    pp: int = 4,
    dp: int = 1,
    batch: int = 64,
    microbatches: int = 8,
    ckpt: bool = False,
    wire: str = "float32",
) -> TunedConfig:
    return TunedConfig(
        model="recipes/gpt.py",
        model_sha256="0123456789abcdef",
        model_layers=sum(split),
        candidate=Candidate(
            schedule=schedule,
            pipeline_degree=pp,
            data_parallel_degree=dp,
            global_batch_size=batch,
            n_microbatches=microbatches,
            layers_per_stage=split,
            activation_checkpointing=ckpt,
            wire_dtype=wire,  # type: ignore[arg-type]
        ),
        memory_limit_bytes=None,
        measured=MeasuredResult(step_time_ms=100.0, throughput_samples_per_s=640.0, peak_memory_bytes=(1,) * pp * dp),
        environment=Environment(device="cpu", torch="2.13.0", autotune="0.1.0", python="3.11.7"),
    )


UNEVEN = make_config()  # 1F1B [3, 2, 2, 3]
EVEN = make_config(split=(3, 3, 3, 3))
INTERLEAVED = make_config(Schedule.INTERLEAVED_1F1B, (3, 3, 2, 2), pp=2, dp=2, microbatches=4)
INTERLEAVED_UNEVEN = make_config(Schedule.INTERLEAVED_1F1B, (1, 3, 3, 3), pp=2, dp=2, microbatches=4)
ZBV = make_config(Schedule.ZBV_ZERO_BUBBLE, (3, 2, 2, 3), pp=2, microbatches=4, batch=32)
GPIPE = make_config(Schedule.GPIPE, (6, 4), pp=2, dp=2, microbatches=4)
CKPT_BF16 = make_config(ckpt=True, wire="bfloat16")
VHALF = make_config(Schedule.V_HALF, (3, 2, 2, 3), pp=2, dp=2, microbatches=4)
VMIN_CKPT_BF16 = make_config(Schedule.V_MIN, (2, 3, 3, 2), pp=2, microbatches=8, ckpt=True, wire="bfloat16")
DATA_PARALLEL = make_config(Schedule.ONE_F_ONE_B, (10,), pp=1, dp=4, microbatches=4)  # pp 1: no pipeline
ALL = [UNEVEN, EVEN, INTERLEAVED, INTERLEAVED_UNEVEN, ZBV, GPIPE, CKPT_BF16, VHALF, VMIN_CKPT_BF16, DATA_PARALLEL]


def comments(text: str) -> str:
    """The # comment lines as one paragraph, wrapping undone."""
    return " ".join(line.lstrip("#").strip() for line in text.splitlines() if line.startswith("#"))


def test_stage_boundaries() -> None:
    assert stage_boundaries([3, 2, 2, 3]) == [0, 3, 5, 7, 10]


def test_unknown_format() -> None:
    with pytest.raises(UsageError, match="unknown export format 'nemo'; pass --format with one of: torchtitan"):
        export_config(UNEVEN, "nemo")


@pytest.mark.parametrize("config", ALL)
@pytest.mark.parametrize("fmt", list(ExportFormat))
def test_every_export_says_what_it_cannot_express(config: TunedConfig, fmt: ExportFormat) -> None:
    text = export_config(config, fmt)
    said = " ".join(json.loads(text)["_comment"]) if fmt is ExportFormat.deepspeed else comments(text)
    cannot = said.split("Not expressible in ")[1].split("Notes:")[0]
    assert ("wire_dtype bfloat16" in cannot) == (config.wire_dtype == "bfloat16")
    lacks = {  # schedules each target does not have
        ExportFormat.torchtitan: {Schedule.V_HALF, Schedule.V_MIN},
        ExportFormat.deepspeed: set(Schedule) - {Schedule.ONE_F_ONE_B},
        ExportFormat.megatron: set(Schedule) - {Schedule.ONE_F_ONE_B, Schedule.INTERLEAVED_1F1B},
    }[fmt]
    assert (f"schedule {config.schedule.value}" in cannot) == (config.schedule in lacks)


# ---------------------------------------------------------------------------------------------- torchtitan


def _toml(config: TunedConfig) -> dict[str, Any]:
    if sys.version_info < (3, 11):
        pytest.skip("tomllib needs Python 3.11")
    import tomllib

    return tomllib.loads(export_config(config, "torchtitan"))


@pytest.mark.parametrize("config", ALL)
def test_torchtitan_values(config: TunedConfig) -> None:
    doc = _toml(config)
    training, par = doc["training"], doc["parallelism"]
    assert par["pipeline_parallel_degree"] == config.pipeline_degree
    v_memory = config.schedule in (Schedule.V_HALF, Schedule.V_MIN)  # torchtitan has neither: same V placement
    assert par["pipeline_parallel_schedule"] == ("ZBVZeroBubble" if v_memory else config.schedule.value)
    assert par["pipeline_parallel_microbatch_size"] == config.micro_batch_size
    assert par["data_parallel_replicate_degree"] == config.data_parallel_degree
    assert par["data_parallel_shard_degree"] == 1
    assert training["global_batch_size"] == config.global_batch_size
    if config.pipeline_degree == 1:
        # no pipeline: torchtitan accumulates global // (local x dp) micro-batches
        accumulation = training["global_batch_size"] // (training["local_batch_size"] * config.data_parallel_degree)
        assert training["local_batch_size"] == config.micro_batch_size
        assert accumulation == config.num_microbatches
    else:
        # torchtitan: n_microbatches = local_batch_size // pipeline_parallel_microbatch_size
        assert training["local_batch_size"] // par["pipeline_parallel_microbatch_size"] == config.num_microbatches
        assert training["local_batch_size"] * config.data_parallel_degree == config.global_batch_size
    assert doc["activation_checkpoint"]["mode"] == ("full" if config.activation_checkpointing else "none")
    # exactly one way of splitting is active, and it gives the tuned split
    assert ("pipeline_parallel_layers_per_stage" in par) != ("module_fqns_per_model_part" in par)
    if "module_fqns_per_model_part" in par:
        parts = par["module_fqns_per_model_part"]
        assert [len(p) for p in parts] == list(config.layers_per_stage)
        assert list(itertools.chain.from_iterable(parts)) == [str(i) for i in range(config.model_layers)]
    else:
        assert _torchtitan_split(config.model_layers, par["pipeline_parallel_layers_per_stage"]) == list(
            config.layers_per_stage
        )


def _torchtitan_split(n_layers: int, per_stage: int) -> list[int]:
    """torchtitan's pipeline_llm + generate_llm_fqn_per_model_part, counting every layer (embedding and output too)."""
    n_stages = math.ceil(n_layers / per_stage)
    return [n_layers // n_stages + (1 if s < n_layers % n_stages else 0) for s in range(n_stages)]


def test_torchtitan_uneven_split_uses_module_fqns() -> None:
    par = _toml(UNEVEN)["parallelism"]
    assert par["module_fqns_per_model_part"] == [["0", "1", "2"], ["3", "4"], ["5", "6"], ["7", "8", "9"]]
    assert "the split [3, 2, 2, 3] as one pipeline_parallel_layers_per_stage" in comments(
        export_config(UNEVEN, "torchtitan")
    )


def test_torchtitan_even_split_uses_layers_per_stage() -> None:
    assert _toml(EVEN)["parallelism"]["pipeline_parallel_layers_per_stage"] == 3
    assert _toml(INTERLEAVED)["parallelism"]["pipeline_parallel_layers_per_stage"] == 3  # [3, 3, 2, 2]


# ---------------------------------------------------------------------------------------------- DeepSpeed


@pytest.mark.parametrize("config", ALL)
def test_deepspeed_values(config: TunedConfig) -> None:
    doc = json.loads(export_config(config, "deepspeed"))
    assert doc["train_batch_size"] == config.global_batch_size
    assert doc["train_micro_batch_size_per_gpu"] == config.micro_batch_size
    assert doc["gradient_accumulation_steps"] == config.num_microbatches
    # DeepSpeed's own identity: train_batch_size = micro x accumulation x (world / num_stages)
    stages = doc["pipeline"]["stages"]
    assert stages == config.pipeline_degree
    assert doc["train_batch_size"] == (
        doc["train_micro_batch_size_per_gpu"] * doc["gradient_accumulation_steps"] * config.gpus // stages
    )
    assert all(isinstance(line, str) for line in doc["_comment"])
    call = next(line for line in doc["_comment"] if "PipelineModule(" in line)
    assert f"num_stages={stages}" in call
    assert f'partition_method="{doc["pipeline"]["partition"]}"' in call


def test_deepspeed_uneven_split_is_named_and_bounded() -> None:
    doc = json.loads(export_config(UNEVEN, "deepspeed"))
    assert doc["pipeline"]["partition"] == "parameters"
    text = "\n".join(doc["_comment"])
    assert "parts = [0, 3, 5, 7, 10]" in text
    assert re.search(r"Not expressible in DeepSpeed:\n\s+- the split \[3, 2, 2, 3\] as a partition_method", text)


def test_deepspeed_uniform_split_and_checkpointing() -> None:
    doc = json.loads(export_config(make_config(split=(3, 3, 2, 2), ckpt=True), "deepspeed"))
    assert doc["pipeline"] == {"stages": 4, "partition": "uniform", "activation_checkpoint_interval": 3}
    assert json.loads(export_config(EVEN, "deepspeed"))["pipeline"]["activation_checkpoint_interval"] == 0


@pytest.mark.parametrize(("config", "said"), [(INTERLEAVED, "does not carry over"), (GPIPE, "schedule GPipe")])
def test_deepspeed_schedules_it_lacks(config: TunedConfig, said: str) -> None:
    text = "\n".join(json.loads(export_config(config, "deepspeed"))["_comment"])
    assert said in text.split("Notes:")[0]


# ---------------------------------------------------------------------------------------------- Megatron-LM


def _megatron_args(config: TunedConfig) -> argparse.Namespace:
    text = export_config(config, "megatron")
    body = re.search(r"^AUTOTUNE_MEGATRON_ARGS=\(\n(.*?)^\)$", text, re.DOTALL | re.MULTILINE)
    assert body, text
    parser = argparse.ArgumentParser(allow_abbrev=False, exit_on_error=False)
    for flag in (
        "--pipeline-model-parallel-size", "--num-layers", "--micro-batch-size", "--global-batch-size",
        "--num-layers-per-virtual-pipeline-stage", "--decoder-first-pipeline-num-layers",
        "--decoder-last-pipeline-num-layers", "--recompute-num-layers",
    ):
        parser.add_argument(flag, type=int)
    parser.add_argument("--pipeline-model-parallel-layout")
    parser.add_argument("--recompute-granularity", choices=["full", "selective"])
    parser.add_argument("--recompute-method", choices=["uniform", "block"])
    return parser.parse_args(shlex.split(body.group(1)))  # unknown flags raise


def _megatron_split(args: argparse.Namespace) -> list[int]:
    """The decoder layers Megatron puts on each stage, following its own rules."""
    pp, n = args.pipeline_model_parallel_size, args.num_layers
    if args.pipeline_model_parallel_layout:
        layout = args.pipeline_model_parallel_layout.replace(",", "")  # Megatron's parse_str_to_list
        layout = re.sub(r"\(([^)]+)\)\*(\d+)", lambda m: m.group(1) * int(m.group(2)), layout)
        layout = re.sub(r"(.)\*(\d+)", lambda m: m.group(1) * int(m.group(2)), layout)
        assert layout[0] == "E" and layout[-1] == "L" and set(layout) <= set("Et|L")
        stages = layout.split("|")
        assert len(stages) % pp == 0
        return [stage.count("t") for stage in stages]
    if args.num_layers_per_virtual_pipeline_stage:
        k = args.num_layers_per_virtual_pipeline_stage
        assert n % (pp * k) == 0
        return [k] * (n // k)
    first, last = args.decoder_first_pipeline_num_layers, args.decoder_last_pipeline_num_layers
    middle_stages = pp - (first is not None) - (last is not None)
    rest = n - (first or 0) - (last or 0)
    assert rest % middle_stages == 0
    middle = [rest // middle_stages] * middle_stages
    return ([first] if first is not None else []) + middle + ([last] if last is not None else [])


@pytest.mark.parametrize("config", [UNEVEN, EVEN, INTERLEAVED, INTERLEAVED_UNEVEN, GPIPE, CKPT_BF16, DATA_PARALLEL])
def test_megatron_values_and_split(config: TunedConfig) -> None:
    args = _megatron_args(config)
    assert args.pipeline_model_parallel_size == config.pipeline_degree
    assert args.num_layers == config.model_layers
    assert args.micro_batch_size == config.micro_batch_size
    assert args.global_batch_size == config.global_batch_size
    # Megatron: dp = world / pp (no tp, cp), num_microbatches = global / (micro x dp)
    dp = config.gpus // args.pipeline_model_parallel_size
    assert dp == config.data_parallel_degree
    assert args.global_batch_size // (args.micro_batch_size * dp) == config.num_microbatches
    assert _megatron_split(args) == list(config.layers_per_stage)


def test_megatron_picks_the_plainest_flags() -> None:
    assert _megatron_args(UNEVEN).decoder_first_pipeline_num_layers == 3
    assert _megatron_args(make_config(split=(2, 3, 3, 3))).decoder_last_pipeline_num_layers is None
    assert _megatron_args(EVEN).pipeline_model_parallel_layout is None
    two_stages = _megatron_args(GPIPE)  # [6, 4]: the last stage takes the rest
    assert (two_stages.decoder_first_pipeline_num_layers, two_stages.pipeline_model_parallel_layout) == (6, None)
    assert _megatron_args(INTERLEAVED).pipeline_model_parallel_layout == "E,t*3|t*3|t*2|t*2,L"
    assert _megatron_args(make_config(split=(2, 3, 4, 1))).pipeline_model_parallel_layout == "E,t*2|t*3|t*4|t,L"


def test_megatron_checkpointing() -> None:
    args = _megatron_args(CKPT_BF16)
    assert (args.recompute_granularity, args.recompute_method, args.recompute_num_layers) == ("full", "uniform", 3)
    assert _megatron_args(UNEVEN).recompute_granularity is None


@pytest.mark.parametrize("config", [VHALF, VMIN_CKPT_BF16])
@pytest.mark.parametrize("fmt", list(ExportFormat))
def test_v_half_and_v_min_name_the_only_implementation(config: TunedConfig, fmt: ExportFormat) -> None:
    text = export_config(config, fmt)
    said = " ".join(json.loads(text)["_comment"]) if fmt is ExportFormat.deepspeed else comments(text)
    cannot, notes = said.split("Not expressible in ")[1].split("Notes:")
    assert f"schedule {config.schedule.value} (about {'1/2' if config.schedule is Schedule.V_HALF else '1/3'} of " \
           "1F1B's activation memory" in cannot
    assert "only public implementation is the sail-sg/zero-bubble-pipeline-parallelism fork of Megatron-LM" in cannot
    assert "may not fit the memory limit" in cannot
    setup = "half" if config.schedule is Schedule.V_HALF else "min"
    assert (f"--zero-bubble-v-schedule-mem-setup {setup}" in notes) == (fmt is ExportFormat.megatron)
    if fmt is ExportFormat.megatron:  # the fork's flags are a note, never in the upstream flag list
        assert "zero-bubble" not in text.split("AUTOTUNE_MEGATRON_ARGS=(")[1]
        assert _megatron_split(_megatron_args(config)) == [5, 5]


def test_checkpointing_and_data_parallelism_reach_every_target() -> None:
    config = VMIN_CKPT_BF16
    assert _toml(config)["activation_checkpoint"]["mode"] == "full"
    assert json.loads(export_config(config, "deepspeed"))["pipeline"]["activation_checkpoint_interval"] == 5
    assert _megatron_args(config).recompute_granularity == "full"
    dp = _toml(VHALF)["parallelism"]["data_parallel_replicate_degree"]
    deepspeed = json.loads(export_config(VHALF, "deepspeed"))
    implied = deepspeed["train_batch_size"] // (deepspeed["train_micro_batch_size_per_gpu"]
                                                * deepspeed["gradient_accumulation_steps"])
    assert dp == implied == VHALF.data_parallel_degree == 2
    assert "data-parallel size 2 as world size" in comments(export_config(VHALF, "megatron"))


def test_megatron_v_schedule_is_named_and_falls_back_to_an_even_split() -> None:
    text = export_config(ZBV, "megatron")
    assert "schedule ZBVZeroBubble: Megatron places virtual stages in a loop" in comments(text)
    assert _megatron_split(_megatron_args(ZBV)) == [5, 5]
