"""Exports: each parses in its target's format and carries the config's values; what cannot be said is said so."""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import re
import shlex
import sys
from pathlib import Path
from typing import Any

import pytest

from autotune.candidate import Candidate
from autotune.errors import UsageError
from autotune.exports import ExportFormat, export_config, stage_bounds
from autotune.exports import targets as targets_module
from autotune.schedules import Schedule
from autotune.tuned_config import Environment, MeasuredResult, TunedConfig


@pytest.fixture(autouse=True)
def no_trainer_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    """Exports default to the installed trainer's version; these tests pin "none installed" (the newest release)."""
    monkeypatch.setattr(targets_module, "installed_version", lambda fmt: None)


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
    roles: bool = False,
    precision: str = "fp32",
    mode: str = "replicate",
    reshard: bool = False,
    tp: int = 1,
) -> TunedConfig:
    return TunedConfig(
        model="model.py",  # no such file: roles come from the config or are unknown
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
            precision=precision,  # type: ignore[arg-type]
            data_parallel_mode=mode,  # type: ignore[arg-type]
            reshard_after_forward=reshard,
            tensor_parallel_degree=tp,
        ),
        layer_roles=("embedding", *["block"] * (sum(split) - 2), "head") if roles else None,
        memory_limit_bytes=None,
        measured=MeasuredResult(step_time_ms=100.0, throughput_samples_per_s=640.0,
                                peak_memory_bytes=(1,) * pp * dp * tp),
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


def with_roles(config: TunedConfig) -> TunedConfig:
    """The same config for a decoder LM: embedding, transformer blocks, head."""
    return dataclasses.replace(config, layer_roles=("embedding", *["block"] * (config.model_layers - 2), "head"))


DUALPIPEV = make_config(Schedule.DUAL_PIPE_V, (3, 2, 2, 3), pp=2, microbatches=4, batch=32, ckpt=True)
# Data-parallel modes and precision (issue 23): FSDP2-sharded and replicated, bf16 and fp32.
SHARD_BF16 = make_config(Schedule.ONE_F_ONE_B, (6, 4), pp=2, dp=2, microbatches=4, precision="bf16", mode="shard")
SHARD_RESHARD = make_config(Schedule.INTERLEAVED_1F1B, (3, 3, 2, 2), pp=2, dp=2, microbatches=4, mode="shard",
                            reshard=True)
REPLICATE_FP32 = make_config(Schedule.ONE_F_ONE_B, (6, 4), pp=2, dp=2, microbatches=4)
REPLICATE_BF16 = make_config(Schedule.ONE_F_ONE_B, (6, 4), pp=2, dp=2, microbatches=4, precision="bf16")
BF16_WIRE = make_config(Schedule.ONE_F_ONE_B, (6, 4), pp=2, dp=2, microbatches=4, precision="bf16", wire="bfloat16",
                        mode="shard")
FSDP = make_config(Schedule.ONE_F_ONE_B, (10,), pp=1, dp=4, microbatches=4, precision="bf16", mode="shard")  # pp 1
MODES = [SHARD_BF16, SHARD_RESHARD, REPLICATE_FP32, REPLICATE_BF16, BF16_WIRE, FSDP]
# Tensor parallelism inside the stages (issue 25): beside a pipeline and replicas, beside FSDP, alone.
TP2 = make_config(Schedule.ONE_F_ONE_B, (6, 4), pp=2, dp=2, microbatches=4, tp=2)
TP2_SHARD_BF16 = make_config(Schedule.INTERLEAVED_1F1B, (3, 3, 2, 2), pp=2, dp=2, microbatches=4, precision="bf16",
                             mode="shard", tp=2)
TP_ONLY = make_config(Schedule.ONE_F_ONE_B, (10,), pp=1, microbatches=4, tp=4)
TENSOR_PARALLEL = [TP2, TP2_SHARD_BF16, TP_ONLY]
ALL = [UNEVEN, EVEN, INTERLEAVED, INTERLEAVED_UNEVEN, ZBV, GPIPE, CKPT_BF16, VHALF, VMIN_CKPT_BF16, DATA_PARALLEL]
ALL += MODES + TENSOR_PARALLEL
ALL += [with_roles(c) for c in ALL] + [DUALPIPEV]


def comments(text: str) -> str:
    """The # comment lines as one paragraph, wrapping undone; for DeepSpeed's JSON, its "_comment" lines."""
    if text.lstrip().startswith("{"):
        return " ".join(line.strip() for line in json.loads(text)["_comment"])
    return " ".join(line.lstrip("#").strip() for line in text.splitlines() if line.startswith("#"))


def test_stage_bounds() -> None:
    assert stage_bounds([3, 2, 2, 3]) == [0, 3, 5, 7, 10]


def test_unknown_format() -> None:
    with pytest.raises(UsageError, match="unknown export format 'nemo'; pass --format with one of: torchtitan"):
        export_config(UNEVEN, "nemo")


@pytest.mark.parametrize("config", ALL)
@pytest.mark.parametrize("fmt", list(ExportFormat))
def test_every_export_says_what_it_cannot_express(config: TunedConfig, fmt: ExportFormat) -> None:
    text = export_config(config, fmt)
    said = " ".join(json.loads(text)["_comment"]) if fmt is ExportFormat.deepspeed else comments(text)
    cannot = said.split("Not expressible in ")[1].split("Notes:")[0]
    # a bf16 model sends bf16 activations in every target; an fp32 one cannot send them in bf16
    assert ("wire_dtype bfloat16" in cannot) == (config.wire_dtype == "bfloat16" and config.precision == "fp32")
    # FSDP2 shards parameters and gradients; DeepSpeed's pipeline and Megatron's distributed optimizer do not
    sharding = "FSDP2's sharding of parameters and gradients"
    assert (sharding in cannot) == (config.candidate.sharded and fmt is not ExportFormat.torchtitan)
    # torchtitan (0.3) and Megatron express tp; DeepSpeed's pipeline engine has none of its own
    tp = config.tensor_parallel_degree
    assert ("has no tensor parallelism of its own" in cannot) == (tp > 1 and fmt is ExportFormat.deepspeed)
    assert (f"x tp {tp}," in said) == (tp > 1)
    lacks = {  # schedules each target does not have
        ExportFormat.torchtitan: {Schedule.V_HALF, Schedule.V_MIN},
        ExportFormat.deepspeed: set(Schedule) - {Schedule.ONE_F_ONE_B, Schedule.DUAL_PIPE_V},
        ExportFormat.megatron: set(Schedule) - {Schedule.ONE_F_ONE_B, Schedule.INTERLEAVED_1F1B},
    }[fmt]
    assert (f"schedule {config.schedule.value}" in cannot) == (config.schedule in lacks)


# ---------------------------------------------------------------------------------------------- targets


@pytest.mark.parametrize("fmt", list(ExportFormat))
def test_every_version_is_stamped(fmt: ExportFormat) -> None:
    for row in targets_module.targets_for(fmt):
        text = export_config(UNEVEN, fmt, row.version)
        assert f"Target: {row.trainer_name} {row.version} (" in " ".join(comments(text).split()) or (
            f"Target: {row.trainer_name} {row.version} (" in " ".join(json.loads(text)["_comment"])
        )


def test_unknown_target() -> None:
    with pytest.raises(
        UsageError, match=r"unknown torchtitan target '0\.9'; pass --target with one of: 0\.2, 0\.3, main"
    ):
        export_config(UNEVEN, "torchtitan", "0.9")


@pytest.mark.parametrize(
    ("fmt", "installed", "version"),
    [
        (ExportFormat.torchtitan, None, "0.3"),  # not installed: the newest release
        (ExportFormat.torchtitan, "0.3.0", "0.3"),
        (ExportFormat.torchtitan, "0.2.2", "0.2"),
        (ExportFormat.torchtitan, "0.1.0", "0.2"),  # the 0.2 row covers "0.2.2 and older"
        (ExportFormat.torchtitan, "0.4.0.dev20261101", "main"),  # newer than any known release
        (ExportFormat.deepspeed, None, "0.19"),
        (ExportFormat.deepspeed, "0.19.8", "0.19"),
        (ExportFormat.deepspeed, "0.18.4", "0.19"),  # older than known: the oldest row, said so
        (ExportFormat.megatron, None, "0.19"),
        (ExportFormat.megatron, "0.19.2", "0.19"),
        (ExportFormat.megatron, "0.20.0", "main"),
    ],
)
def test_default_target_follows_the_installed_trainer(
    monkeypatch: pytest.MonkeyPatch, fmt: ExportFormat, installed: str | None, version: str
) -> None:
    monkeypatch.setattr(targets_module, "installed_version", lambda _: installed)
    row, why = targets_module.resolve_target(fmt)
    assert row.version == version
    assert (installed or "not installed") in why
    assert f"target {version}: " in " ".join(comments(export_config(UNEVEN, fmt)).split())


def test_explicit_target_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(targets_module, "installed_version", lambda _: "0.3.0")
    assert targets_module.resolve_target(ExportFormat.torchtitan, "v0.2.2")[0].version == "0.2"
    assert targets_module.resolve_target(ExportFormat.torchtitan, "MAIN")[0].version == "main"


# ---------------------------------------------------------------------------------------------- torchtitan


def _toml(config: TunedConfig) -> dict[str, Any]:
    if sys.version_info < (3, 11):
        pytest.skip("tomllib needs Python 3.11")
    import tomllib

    return tomllib.loads(export_config(config, "torchtitan", "0.2"))


def bash_array(text: str, name: str) -> list[str]:
    body = re.search(rf"^{name}=\(\n(.*?)^\)$", text, re.DOTALL | re.MULTILINE)
    assert body, text
    return shlex.split(body.group(1))


def _flags(config: TunedConfig, target: str = "0.3") -> tuple[dict[str, Any], list[str]]:
    """The documented format: one --section.key and its value(s) per line of the array; bare words (subcommands)."""
    text = export_config(config, "torchtitan", target)
    body = re.search(r"^AUTOTUNE_TORCHTITAN_ARGS=\(\n(.*?)^\)$", text, re.DOTALL | re.MULTILINE)
    assert body, text
    flags: dict[str, Any] = {}
    bare: list[str] = []
    for line in body.group(1).splitlines():
        words = shlex.split(line)
        if words[0].startswith("--"):
            flags[words[0][2:]] = True if len(words) == 1 else words[1] if len(words) == 2 else words[1:]
        else:
            bare += words
    assert list(itertools.chain.from_iterable(shlex.split(line) for line in body.group(1).splitlines())) == (
        bash_array(text, "AUTOTUNE_TORCHTITAN_ARGS")
    )
    return flags, bare


def _torchtitan_split(config: TunedConfig, fqns: list[list[str]] | None, par: dict[str, Any]) -> list[int]:
    """Transformer blocks (or, roles unknown, layers) per stage as torchtitan would build them."""
    from autotune.exports.torchtitan import torchtitan_blocks

    if fqns is not None:
        if config.layer_roles is None:
            return [len(part) for part in fqns]
        return [sum(name.startswith("layers.") for name in part) for part in fqns]
    blocks = config.model_layers - 2
    first = int(par.get("parallelism.pipeline_parallel_first_stage_less_layers", 1))
    last = int(par.get("parallelism.pipeline_parallel_last_stage_less_layers", 1))
    k = par.get("parallelism.pipeline_parallel_layers_per_stage")
    multi = config.schedule not in (Schedule.GPIPE, Schedule.ONE_F_ONE_B)
    stages = math.ceil((blocks + first + last) / int(k)) if k else config.pipeline_degree * (2 if multi else 1)
    split = torchtitan_blocks(stages, blocks, first, last)
    assert split is not None
    return split


def _titan_degrees(config: TunedConfig) -> tuple[int, int]:
    """(data_parallel_replicate_degree, data_parallel_shard_degree): replicas are replicate, FSDP2 is shard."""
    dp = config.data_parallel_degree
    return (1, dp) if config.data_parallel_mode == "shard" else (dp, 1)


def _titan_param_dtype(config: TunedConfig) -> str:
    return {"fp32": "float32", "bf16": "bfloat16"}[config.precision]  # torchtitan's own default is bfloat16


def _titan_reshard(config: TunedConfig) -> str | None:
    """Written only when sharded, and never as "default" (not pp_enabled: right for one pp, wrong for the other)."""
    if config.data_parallel_mode != "shard":
        return None
    return "always" if config.fsdp_reshard_after_forward else "never"


def _expected_blocks(config: TunedConfig) -> list[int]:
    split = list(config.layers_per_stage)
    if config.layer_roles is None:
        return split
    return [n - (s == 0) - (s == len(split) - 1) for s, n in enumerate(split)]


@pytest.mark.parametrize("config", ALL)
def test_torchtitan_toml_values(config: TunedConfig) -> None:
    doc = _toml(config)
    training, par = doc["training"], doc["parallelism"]
    assert par["pipeline_parallel_degree"] == config.pipeline_degree
    v_memory = config.schedule in (Schedule.V_HALF, Schedule.V_MIN)  # torchtitan has neither: same V placement
    assert par["pipeline_parallel_schedule"] == ("ZBVZeroBubble" if v_memory else config.schedule.value)
    assert (par["data_parallel_replicate_degree"], par["data_parallel_shard_degree"]) == _titan_degrees(config)
    assert (training["mixed_precision_param"], training["mixed_precision_reduce"]) == (
        _titan_param_dtype(config),
        "float32",
    )
    assert par.get("fsdp_reshard_after_forward") == _titan_reshard(config)
    tp = config.tensor_parallel_degree
    assert par.get("tensor_parallel_degree", 1) == tp
    assert par.get("disable_loss_parallel", False) == (tp > 1)  # the logits gathered whole, as measured
    assert training["global_batch_size"] == config.global_batch_size
    if config.pipeline_degree == 1:
        # no pipeline: torchtitan accumulates global // (local x dp) micro-batches
        accumulation = training["global_batch_size"] // (training["local_batch_size"] * config.data_parallel_degree)
        assert training["local_batch_size"] == config.micro_batch_size
        assert accumulation == config.num_microbatches
        return
    assert par["pipeline_parallel_microbatch_size"] == config.micro_batch_size
    # torchtitan: n_microbatches = local_batch_size // pipeline_parallel_microbatch_size
    assert training["local_batch_size"] // par["pipeline_parallel_microbatch_size"] == config.num_microbatches
    assert training["local_batch_size"] * config.data_parallel_degree == config.global_batch_size
    assert doc["activation_checkpoint"]["mode"] == ("full" if config.activation_checkpointing else "none")
    flat = {f"parallelism.{k}": v for k, v in par.items()}
    assert _torchtitan_split(config, par.get("module_fqns_per_model_part"), flat) == _expected_blocks(config)


@pytest.mark.parametrize("config", ALL)
@pytest.mark.parametrize("target", ["0.3", "main"])
def test_torchtitan_flags_values(config: TunedConfig, target: str) -> None:
    flags, bare = _flags(config, target)
    assert bare == [f"activation-checkpoint:{'full' if config.activation_checkpointing else 'none'}"]
    assert flags["parallelism.pipeline_parallel_degree"] == str(config.pipeline_degree)
    degrees = (flags["parallelism.data_parallel_replicate_degree"], flags["parallelism.data_parallel_shard_degree"])
    assert tuple(map(int, degrees)) == _titan_degrees(config)
    assert flags["training.mixed_precision_param"] == _titan_param_dtype(config)
    assert flags["training.mixed_precision_reduce"] == "float32"
    assert flags.get("parallelism.fsdp_reshard_after_forward") == _titan_reshard(config)
    tp = config.tensor_parallel_degree
    assert int(flags.get("parallelism.tensor_parallel_degree", 1)) == tp
    assert ("parallelism.no_enable_sequence_parallel" in flags) == (tp > 1)  # as measured: no sequence parallel
    assert ("training.disable_cuda_graphs" in flags) == (config.pipeline_degree > 1)
    if target == "main":
        per_sample = int(flags["training.num_tokens_per_microbatch_per_dp_rank"]) // config.micro_batch_size
        assert per_sample == 2048  # torchtitan's default; no SEQ_LEN in a model file here
        assert int(flags["training.num_tokens_per_train_step"]) == config.global_batch_size * per_sample
        assert "training.local_batch_size" not in flags and "parallelism.pipeline_parallel_microbatch_size" not in flags
        if config.pipeline_degree > 1:
            assert flags["parallelism.num_pp_microbatches"] == str(config.num_microbatches)
    elif config.pipeline_degree > 1:
        local, micro = (
            int(flags["training.local_batch_size"]),
            int(flags["parallelism.pipeline_parallel_microbatch_size"]),
        )
        assert local // micro == config.num_microbatches
    if config.pipeline_degree > 1:
        fqns = flags.get("parallelism.module_fqns_per_model_part")
        parts = None if fqns is None else [part.split(",") for part in ([fqns] if isinstance(fqns, str) else fqns)]
        assert _torchtitan_split(config, parts, flags) == _expected_blocks(config)


def test_torchtitan_counts_blocks_and_names_the_head() -> None:
    roles = with_roles(UNEVEN)  # blocks [2, 2, 2, 2]
    flags, _ = _flags(roles)
    assert flags["parallelism.pipeline_parallel_last_stage_less_layers"] == "0"  # (8 + 1 + 0) / 4: 3, 2, 2, 2
    assert "parallelism.module_fqns_per_model_part" not in flags
    uneven = with_roles(make_config(split=(2, 4, 1, 3)))  # blocks [1, 4, 1, 2]
    flags, _ = _flags(uneven)
    assert flags["parallelism.module_fqns_per_model_part"] == [
        "tok_embeddings,layers.0",
        "layers.1,layers.2,layers.3,layers.4",
        "layers.5",
        "layers.6,layers.7,norm,lm_head",
    ]
    assert _toml(uneven)["parallelism"]["module_fqns_per_model_part"][-1][-2:] == ["norm", "output"]  # 0.2's name
    assert "the split [1, 4, 1, 2] (transformer blocks per stage) through torchtitan's layer counts" in comments(
        export_config(uneven, "torchtitan")
    )


def test_torchtitan_without_roles_names_sequential_children() -> None:
    flags, _ = _flags(UNEVEN)
    assert flags["parallelism.module_fqns_per_model_part"] == ["0,1,2", "3,4", "5,6", "7,8,9"]
    assert "set layer_roles in the config (or LAYER_ROLES in the model file)" in comments(
        export_config(UNEVEN, "torchtitan")
    )


@pytest.mark.parametrize(
    ("args", "blocks"),
    [  # torchtitan 0.3.0's _generate_llm_fqn_per_model_part, run by hand on these numbers
        ((4, 8, 1, 1), [2, 3, 2, 1]),
        ((4, 8, 1, 0), [2, 2, 2, 2]),
        ((2, 6, 1, 1), [3, 3]),
        ((3, 6, 1, 1), [2, 3, 1]),
        ((1, 6, 1, 1), [6]),
        ((4, 2, 1, 1), [0, 1, 1, 0]),  # the first stage holds only the embedding, the last only norm + head
        ((2, 4, 3, 1), [1, 3]),
        ((3, 2, 2, 1), None),  # input weight 2 > (2 + 2 + 1) // 3 = 1 layer per stage: torchtitan refuses
    ],
)
def test_torchtitan_blocks_mirrors_torchtitan(args: tuple[int, int, int, int], blocks: list[int] | None) -> None:
    from autotune.exports.torchtitan import torchtitan_blocks

    assert torchtitan_blocks(*args) == blocks


# ---------------------------------------------------------------------------------------------- DeepSpeed


def _deepspeed(config: TunedConfig) -> dict[str, Any]:
    return json.loads(export_config(config, "deepspeed"))


@pytest.mark.parametrize("config", ALL)
def test_deepspeed_values(config: TunedConfig) -> None:
    doc = _deepspeed(config)
    assert doc["train_batch_size"] == config.global_batch_size
    assert doc["train_micro_batch_size_per_gpu"] == config.micro_batch_size
    assert doc["gradient_accumulation_steps"] == config.num_microbatches
    # DeepSpeed's own identity: train_batch_size = micro x accumulation x (world / num_stages)
    assert doc["train_batch_size"] == (
        doc["train_micro_batch_size_per_gpu"] * doc["gradient_accumulation_steps"] * config.data_parallel_degree
    )
    bf16, sharded = config.precision == "bf16", config.data_parallel_mode == "shard"
    assert doc.get("bf16") == ({"enabled": True} if bf16 else None)
    assert doc.get("zero_optimization") == ({"stage": 1} if sharded else None)  # its pipeline refuses stages 2, 3
    # fp32 gradient accumulation, as tuned, where DeepSpeed accepts it: over bf16 parameters with ZeRO only
    assert doc.get("data_types") == ({"grad_accum_dtype": "fp32"} if bf16 and sharded else None)
    pipeline = doc.get("pipeline", {})
    assert "stages" not in pipeline and "partition" not in pipeline  # stored and never read by DeepSpeed
    if config.activation_checkpointing:
        assert pipeline["activation_checkpoint_interval"] == max(_deepspeed_split(config))
        assert pipeline["use_reentrant"] is False
    else:
        assert "activation_checkpoint_interval" not in pipeline
    code = "\n".join(doc["_autotune_pipeline_module"])
    compile(code, "<export>", "exec")
    parts = json.loads(re.search(r"^TUNED_PARTS = (\[[\d, ]+\])", code, re.MULTILINE).group(1))  # type: ignore[union-attr]
    assert parts == stage_bounds(_deepspeed_split(config))
    dual = config.schedule in (Schedule.ZBV_ZERO_BUBBLE, Schedule.DUAL_PIPE_V, Schedule.V_HALF, Schedule.V_MIN)
    assert ("class TunedDualPipeVModule(DualPipeVModule, TunedPipelineModule):" in code) == dual
    assert (pipeline.get("pipe_partitioned"), pipeline.get("grad_partitioned")) == (
        (False, False) if dual else (None, None)
    )


def _deepspeed_split(config: TunedConfig) -> list[int]:
    """What DeepSpeed can place: the tuned split for one stage per rank and for V placement (DualPipeV), else even."""
    if config.schedule in (Schedule.INTERLEAVED_1F1B, Schedule.LOOPED_BFS, Schedule.INTERLEAVED_ZERO_BUBBLE):
        return [config.model_layers // config.pipeline_degree] * config.pipeline_degree
    return list(config.layers_per_stage)


def test_deepspeed_uneven_split_is_held_by_the_subclass() -> None:
    text = "\n".join(_deepspeed(UNEVEN)["_comment"])
    assert "Not expressible in DeepSpeed: nothing" in text
    assert "cuts at parts = [0, 3, 5, 7, 10]" in text


def test_deepspeed_dual_pipe_v_is_expressible() -> None:
    said = " ".join(_deepspeed(DUALPIPEV)["_comment"])
    assert "Not expressible in DeepSpeed: nothing" in said
    assert "rank 0: stages 0 and 3; rank 1: stages 1 and 2" in said
    zbv = " ".join(_deepspeed(ZBV)["_comment"]).split("Notes:")[0]
    assert "below is DeepSpeed's DualPipeV over the same V placement and split" in zbv
    few = make_config(Schedule.ZBV_ZERO_BUBBLE, (3, 2, 2, 3), pp=2, microbatches=2, batch=16)  # torch's ZBV runs 2
    assert "DualPipeVEngine needs gradient_accumulation_steps >= 2 x pp = 4" in " ".join(_deepspeed(few)["_comment"])


@pytest.mark.parametrize(("config", "said"), [(INTERLEAVED, "does not carry over"), (GPIPE, "schedule GPipe")])
def test_deepspeed_schedules_it_lacks(config: TunedConfig, said: str) -> None:
    text = "\n".join(_deepspeed(config)["_comment"])
    assert said in text.split("Notes:")[0]


# ---------------------------------------------------------------------------------------------- Megatron-LM


def _megatron_args(config: TunedConfig, target: str | None = None) -> argparse.Namespace:
    words = bash_array(export_config(config, "megatron", target), "AUTOTUNE_MEGATRON_ARGS")
    parser = argparse.ArgumentParser(allow_abbrev=False, exit_on_error=False)
    for flag in (
        "--pipeline-model-parallel-size",
        "--num-layers",
        "--micro-batch-size",
        "--global-batch-size",
        "--num-layers-per-virtual-pipeline-stage",
        "--decoder-first-pipeline-num-layers",
        "--decoder-last-pipeline-num-layers",
        "--recompute-num-layers",
    ):
        parser.add_argument(flag, type=int)
    parser.add_argument("--tensor-model-parallel-size", type=int, default=1)
    parser.add_argument("--sequence-parallel", action="store_true")
    parser.add_argument("--pipeline-model-parallel-layout")
    parser.add_argument("--account-for-embedding-in-pipeline-split", action="store_true")
    parser.add_argument("--account-for-loss-in-pipeline-split", action="store_true")
    parser.add_argument("--recompute-granularity", choices=["full", "selective"])
    parser.add_argument("--recompute-method", choices=["uniform", "block"])
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument("--use-distributed-optimizer", action="store_true")
    return parser.parse_args(words)  # unknown flags raise


def _megatron_split(args: argparse.Namespace) -> list[int]:
    """The transformer layers Megatron puts on each stage, following its own rules (validate_args,
    TransformerConfig, get_num_layers_to_build)."""
    pp, n = args.pipeline_model_parallel_size, args.num_layers
    if args.pipeline_model_parallel_layout:
        layout = args.pipeline_model_parallel_layout.replace(",", "")  # Megatron's parse_str_to_list
        layout = re.sub(r"\(([^)]+)\)\*(\d+)", lambda m: m.group(1) * int(m.group(2)), layout)
        layout = re.sub(r"(.)\*(\d+)", lambda m: m.group(1) * int(m.group(2)), layout)
        assert layout.count("E") == 1 and layout.count("L") == 1 and set(layout) <= set("Et|L")
        stages = layout.split("|")
        assert len(stages) % pp == 0 and "E" in stages[0] and "L" in stages[-1]
        return [stage.count("t") for stage in stages]
    embedding, loss = args.account_for_embedding_in_pipeline_split, args.account_for_loss_in_pipeline_split
    if args.num_layers_per_virtual_pipeline_stage:
        k = args.num_layers_per_virtual_pipeline_stage
        assert not (embedding or loss) and n % (pp * k) == 0
        return [k] * (n // k)
    if embedding or loss:
        total = n + embedding + loss
        assert total % pp == 0
        split = [total // pp] * pp
        split[0] -= embedding
        split[-1] -= loss
        return split
    first, last = args.decoder_first_pipeline_num_layers, args.decoder_last_pipeline_num_layers
    middle_stages = pp - (first is not None) - (last is not None)
    rest = n - (first or 0) - (last or 0)
    assert rest % middle_stages == 0
    middle = [rest // middle_stages] * middle_stages
    return ([first] if first is not None else []) + middle + ([last] if last is not None else [])


@pytest.mark.parametrize(
    "config",
    [
        c
        for c in ALL
        if c.schedule not in (Schedule.ZBV_ZERO_BUBBLE, Schedule.DUAL_PIPE_V, Schedule.V_HALF, Schedule.V_MIN)
    ],
)
def test_megatron_values_and_split(config: TunedConfig) -> None:
    args = _megatron_args(config)
    assert args.pipeline_model_parallel_size == config.pipeline_degree
    roles = config.layer_roles is not None
    assert args.num_layers == config.model_layers - (2 if roles else 0)  # transformer blocks only
    assert args.micro_batch_size == config.micro_batch_size
    assert args.global_batch_size == config.global_batch_size
    # Megatron: dp = world / (tp x pp) (no cp), num_microbatches = global / (micro x dp)
    assert args.tensor_model_parallel_size == config.tensor_parallel_degree
    assert not args.sequence_parallel  # autotune's tp keeps activations whole between blocks
    dp = config.gpus // (args.tensor_model_parallel_size * args.pipeline_model_parallel_size)
    assert dp == config.data_parallel_degree
    assert args.global_batch_size // (args.micro_batch_size * dp) == config.num_microbatches
    assert _megatron_split(args) == _expected_blocks(config)
    assert ("assumes every one of the model's" in comments(export_config(config, "megatron"))) != roles
    assert args.bf16 == (config.precision == "bf16")
    assert args.use_distributed_optimizer == (config.data_parallel_mode == "shard")


def test_megatron_picks_the_plainest_flags() -> None:
    assert _megatron_args(UNEVEN).decoder_first_pipeline_num_layers == 3
    assert _megatron_args(make_config(split=(2, 3, 3, 3))).decoder_last_pipeline_num_layers is None
    assert _megatron_args(EVEN).pipeline_model_parallel_layout is None
    two_stages = _megatron_args(GPIPE)  # [6, 4]: the last stage takes the rest
    assert (two_stages.decoder_first_pipeline_num_layers, two_stages.pipeline_model_parallel_layout) == (6, None)
    assert _megatron_args(INTERLEAVED).pipeline_model_parallel_layout == "E,t*3|t*3|t*2|t*2,L"
    assert _megatron_args(make_config(split=(2, 3, 4, 1))).pipeline_model_parallel_layout == "E,t*2|t*3|t*4|t,L"


def test_megatron_with_roles_counts_embedding_and_loss() -> None:
    # recipes/gpt.py tuned as [3, 3, 2] over 3 ranks: 6 transformer blocks, [2, 3, 1] of them per stage
    gpt = with_roles(make_config(split=(3, 3, 2), pp=3, microbatches=8, batch=48))
    args = _megatron_args(gpt)
    assert args.num_layers == 6
    assert _megatron_split(args) == [2, 3, 1]
    even = _megatron_args(with_roles(make_config(split=(3, 3, 3, 3))))  # blocks [2, 3, 3, 2]: 10 + E + L = 12
    assert (even.account_for_embedding_in_pipeline_split, even.account_for_loss_in_pipeline_split) == (True, True)
    first = _megatron_args(with_roles(make_config(split=(3, 3, 3, 4))))  # blocks [2, 3, 3, 3]: 11 + E = 12
    assert first.account_for_embedding_in_pipeline_split and not first.account_for_loss_in_pipeline_split
    alone = _megatron_args(with_roles(make_config(split=(1, 4, 4, 3))))  # the first stage holds only the embedding
    assert alone.pipeline_model_parallel_layout == "E|t*4|t*4|t*2,L"


def test_megatron_checkpointing() -> None:
    args = _megatron_args(CKPT_BF16)
    assert (args.recompute_granularity, args.recompute_method, args.recompute_num_layers) == ("full", "uniform", 3)
    assert _megatron_args(with_roles(CKPT_BF16)).recompute_num_layers == 2  # blocks [2, 2, 2, 2]
    assert _megatron_args(UNEVEN).recompute_granularity is None


@pytest.mark.parametrize("config", [VHALF, VMIN_CKPT_BF16])
@pytest.mark.parametrize("fmt", list(ExportFormat))
def test_v_half_and_v_min_name_the_only_implementation(config: TunedConfig, fmt: ExportFormat) -> None:
    text = export_config(config, fmt)
    said = " ".join(json.loads(text)["_comment"]) if fmt is ExportFormat.deepspeed else comments(text)
    cannot, notes = said.split("Not expressible in ")[1].split("Notes:")
    assert (
        f"schedule {config.schedule.value} (about {'1/2' if config.schedule is Schedule.V_HALF else '1/3'} of "
        "1F1B's activation memory" in cannot
    )
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
    assert _deepspeed(config)["pipeline"]["activation_checkpoint_interval"] == 3
    assert _megatron_args(config).recompute_granularity == "full"
    dp = _toml(VHALF)["parallelism"]["data_parallel_replicate_degree"]
    deepspeed = _deepspeed(VHALF)
    implied = deepspeed["train_batch_size"] // (
        deepspeed["train_micro_batch_size_per_gpu"] * deepspeed["gradient_accumulation_steps"]
    )
    assert dp == implied == VHALF.data_parallel_degree == 2
    assert "data-parallel size 2 as world size" in comments(export_config(VHALF, "megatron"))


def test_megatron_v_schedule_is_named_and_falls_back_to_an_even_split() -> None:
    text = export_config(ZBV, "megatron")
    assert "schedule ZBVZeroBubble: Megatron places virtual stages in a loop" in comments(text)
    assert _megatron_split(_megatron_args(ZBV)) == [5, 5]
    assert _megatron_split(_megatron_args(with_roles(ZBV))) == [4, 4]


@pytest.mark.parametrize(
    ("fmt", "name"), [("torchtitan", "AUTOTUNE_TORCHTITAN_ARGS"), ("megatron", "AUTOTUNE_MEGATRON_ARGS")]
)
def test_flag_exports_are_bash_to_source(tmp_path: Path, fmt: str, name: str) -> None:
    import subprocess

    path = tmp_path / "args.sh"
    for config in (with_roles(INTERLEAVED_UNEVEN), CKPT_BF16):
        text = export_config(config, fmt, "main")
        path.write_text(text)
        script = f'source {shlex.quote(str(path))} && printf "%s\\n" "${{{name}[@]}}"'
        words = subprocess.run(["bash", "-c", script], capture_output=True, text=True, check=True).stdout.splitlines()
        assert words == bash_array(text, name)


# ---------------------------------------------------------------------------------------------- dp modes, precision


def _said(config: TunedConfig, fmt: str, target: str | None = None) -> tuple[str, str]:
    """(what the export says it cannot express, its notes), wrapping undone."""
    said = " ".join(comments(export_config(config, fmt, target)).split())
    cannot, notes = said.split("Not expressible in ")[1].split("Notes:")
    return cannot, notes


def test_torchtitan_reshard_is_spelled_out_where_its_default_differs() -> None:
    # pp 1: torchtitan's "default" reshards (not pp_enabled), so keeping the stage gathered must be written "never"
    flags, _ = _flags(FSDP)
    assert (flags["parallelism.data_parallel_shard_degree"], flags["parallelism.fsdp_reshard_after_forward"]) == (
        "4",
        "never",
    )
    assert "would reshard all but norm + head at pp 1" in _said(FSDP, "torchtitan")[1]
    # pp 2: "default" keeps it gathered, so resharding after every forward must be written "always"
    assert _flags(SHARD_RESHARD)[0]["parallelism.fsdp_reshard_after_forward"] == "always"
    assert "would keep them gathered at pp 2" in _said(SHARD_RESHARD, "torchtitan")[1]


def test_torchtitan_replicas_are_fully_shard_with_one_rank_shards() -> None:
    cannot, notes = _said(REPLICATE_BF16, "torchtitan", "0.3")
    assert cannot.startswith("torchtitan: nothing")
    assert "torchtitan 0.3 has no DDP; it runs fully_shard over a (replicate 2, shard 1) mesh" in notes
    assert "where autotune measured torch.autocast" in notes
    # 0.2 refuses DDP beside a pipeline, and turns mixed precision off there
    cannot, _ = _said(REPLICATE_BF16, "torchtitan", "0.2")
    assert '"DDP has not supported > 1D parallelism"' in cannot and "trains in float32" in cannot
    assert "wire_dtype" not in _said(BF16_WIRE, "torchtitan", "0.2")[0]  # FSDP keeps bf16 under 0.2's pipeline
    assert "DDP" not in _said(SHARD_BF16, "torchtitan", "0.2")[0]


def test_deepspeed_says_zero_1_is_the_most_its_pipeline_shards() -> None:
    cannot, notes = _said(SHARD_BF16, "deepspeed")
    assert '"ZeRO-2 and ZeRO-3 are incompatible with pipeline parallelism"' in cannot
    assert "shards only the optimizer state and the float32 master weights" in cannot
    assert "BF16_Optimizer" in notes and "gradients accumulated and all-reduced in float32" in notes
    cannot, notes = _said(REPLICATE_BF16, "deepspeed")
    assert "accumulates the micro-batches' gradients in bfloat16" in cannot
    assert "BF16_Optimizer even at ZeRO stage 0" in notes


def test_megatron_says_what_the_distributed_optimizer_does_not_shard() -> None:
    cannot, notes = _said(SHARD_BF16, "megatron")
    assert "--use-distributed-optimizer (ZeRO-1-like) shards the float32 main parameters and optimizer state" in cannot
    assert "every rank holds its stage's whole parameters and gradient buffer" in cannot
    assert "accumulate_allreduce_grads_in_fp32" in notes
    assert "--use-distributed-optimizer" not in _said(REPLICATE_BF16, "megatron")[0]


# ---------------------------------------------------------------------------------------------- tensor parallel


def test_tensor_parallel_in_every_target() -> None:
    cannot, notes = _said(TP2, "torchtitan", "0.3")
    assert cannot.startswith("torchtitan: nothing")
    assert "tensor_parallel_degree 2: torchtitan shards its own model with its own plan" in notes
    assert "parallelism.no_enable_sequence_parallel keeps activations whole between blocks, as measured" in notes
    assert "each rank holds 1/2 of the logits where autotune gathered them whole" in notes
    cannot, notes = _said(TP2, "torchtitan", "0.2")
    assert "torchtitan 0.2 applies SequenceParallel to every norm whenever tensor_parallel_degree > 1" in cannot
    assert "parallelism.disable_loss_parallel: the logits are gathered whole for the loss, as measured" in notes
    cannot, notes = _said(with_roles(TP2), "megatron")
    assert cannot.startswith("Megatron-LM: nothing")
    assert "--sequence-parallel is left off because autotune did not use it" in notes
    assert "data-parallel size 2 as world size / (tensor x pipeline" in notes
    cannot, notes = _said(TP2, "deepspeed")
    assert "topology=PipeModelDataParallelTopology(num_pp=2, num_mp=2, num_dp=2) in place of num_stages" in cannot
    assert "launch pp x dp = 4 ranks: each then holds its stage's whole layers, about 2 times" in cannot
    assert "launch 4 ranks (8 with the tensor-parallel topology above)" in notes
    for config in (UNEVEN, SHARD_BF16):  # tp 1: nothing about it anywhere
        for fmt in ExportFormat:
            text = export_config(config, fmt)
            words = ("tensor_parallel", "tensor-model", "tensor parallel", "sequence", " x tp ")
            assert [word for word in words if word in text] == [], fmt


@pytest.mark.parametrize("fmt", list(ExportFormat))
def test_an_asynchronous_schedule_is_not_exported(fmt: ExportFormat) -> None:
    """No trainer autotune exports to has an asynchronous schedule: 2BW is refused in one line, not written as a
    config the trainer would misread."""
    from autotune.errors import ConfigError

    with pytest.raises(ConfigError, match=f"2BW is asynchronous .* {fmt.value} has no asynchronous schedule"):
        export_config(make_config(Schedule.TWO_BW), fmt)
