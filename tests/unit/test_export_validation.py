"""Exports fed to the trainers' own code (--validate): accepted and read back as tuned, refused when broken.

Each test skips cleanly where its trainer is not importable. CI installs torchtitan 0.3.0 and DeepSpeed 0.19.8;
Megatron-LM needs Python >= 3.12 (megatron-core 0.19.2 from PyPI ships megatron.training, or a Megatron-LM checkout
on PYTHONPATH).
"""

from __future__ import annotations

import dataclasses
import importlib.util

import pytest

from autotune.exports import Validation, export_config, validate_export
from autotune.exports.targets import ExportFormat, installed_version, target_for_version
from autotune.schedules import Schedule
from autotune.tuned_config import TunedConfig
from tests.unit.test_exports import make_config, with_roles


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


# The five: 2-rank 1F1B, uneven 1F1B, Interleaved1F1B, ZBV, checkpointed; as decoder LMs (roles known).
CASES = {
    "1f1b-2-ranks": with_roles(make_config(Schedule.ONE_F_ONE_B, (4, 4), pp=2, microbatches=4, batch=32)),
    "1f1b-uneven": with_roles(make_config(Schedule.ONE_F_ONE_B, (2, 4, 1, 3))),
    "interleaved": with_roles(make_config(Schedule.INTERLEAVED_1F1B, (3, 3, 2, 2), pp=2, dp=2, microbatches=4)),
    "zbv": with_roles(make_config(Schedule.ZBV_ZERO_BUBBLE, (3, 2, 2, 3), pp=2, microbatches=4, batch=32)),
    "checkpointed": with_roles(make_config(Schedule.ONE_F_ONE_B, (3, 3, 2, 2), ckpt=True)),
    "roles-unknown": make_config(Schedule.ONE_F_ONE_B, (3, 2, 2, 3)),
    # issue 23: data-parallel mode and precision
    "shard-bf16": with_roles(
        make_config(Schedule.ONE_F_ONE_B, (6, 4), pp=2, dp=2, microbatches=4, precision="bf16", mode="shard")
    ),
    "replicate-fp32": with_roles(make_config(Schedule.ONE_F_ONE_B, (6, 4), pp=2, dp=2, microbatches=4)),
    "replicate-bf16": with_roles(
        make_config(Schedule.ONE_F_ONE_B, (6, 4), pp=2, dp=2, microbatches=4, precision="bf16")
    ),
    "shard-reshard": with_roles(
        make_config(Schedule.INTERLEAVED_1F1B, (3, 3, 2, 2), pp=2, dp=2, microbatches=4, mode="shard", reshard=True)
    ),
    "fsdp-pp1": with_roles(
        make_config(Schedule.ONE_F_ONE_B, (10,), pp=1, dp=4, microbatches=4, precision="bf16", mode="shard")
    ),
    # issue 25: tensor parallelism beside a pipeline and replicas, and alone
    "tp2": with_roles(make_config(Schedule.ONE_F_ONE_B, (6, 4), pp=2, dp=2, microbatches=4, tp=2)),
    "tp4-pp1": with_roles(make_config(Schedule.ONE_F_ONE_B, (10,), pp=1, microbatches=4, tp=4)),
}


def _check(config: TunedConfig, fmt: str, target: str, text: str | None = None) -> Validation:
    text = text if text is not None else export_config(config, fmt, target)
    return validate_export(config, fmt, text, target)


# ---------------------------------------------------------------------------------------------- torchtitan

needs_torchtitan = pytest.mark.skipif(
    not _importable("torchtitan.config"), reason="torchtitan is not installed (pip install torchtitan==0.3.0)"
)


@needs_torchtitan
@pytest.mark.parametrize("name", list(CASES))
def test_torchtitan_accepts_and_reads_back(name: str) -> None:
    config = CASES[name]
    result = _check(config, "torchtitan", "0.3")
    assert result.status == "validated", result.line()
    assert result.against.startswith("torchtitan 0.3")
    said = result.detail
    assert f"pp {config.pipeline_degree}, schedule {config.schedule.value}," in said
    assert f"micro-batches {config.num_microbatches}," in said
    assert f"checkpointing {'full' if config.activation_checkpointing else 'none'}" in said
    dp, sharded = config.data_parallel_degree, config.candidate.sharded
    replicate, shard = (1, dp) if sharded else (dp, 1)
    dtype = "bfloat16" if config.precision == "bf16" else "float32"
    assert f"dp replicate {replicate}, dp shard {shard}, mixed_precision_param {dtype}, mixed_precision_reduce " in said
    if sharded:  # torchtitan's own get_fsdp_reshard_after_forward_policy on the parsed policy and pp
        assert f"reshard after forward {config.fsdp_reshard_after_forward}," in said
    tp = config.tensor_parallel_degree
    assert f"tp {tp}, {'sequence parallel False, ' if tp > 1 else ''}micro-batches" in said


@needs_torchtitan
def test_torchtitan_refuses_a_wrong_tensor_parallel_degree_or_sequence_parallel() -> None:
    config = CASES["tp2"]
    text = export_config(config, "torchtitan", "0.3")
    dropped = _check(config, "torchtitan", "0.3", text.replace("    --parallelism.tensor_parallel_degree 2\n", ""))
    # ParallelDims refuses pp x dp x tp that is not the world size the config was tuned on (8)
    assert dropped.status == "rejected" and dropped.detail.startswith("ParallelDims on world size 8:")
    sp = _check(config, "torchtitan", "0.3", text.replace("    --parallelism.no_enable_sequence_parallel\n", ""))
    assert sp.status == "rejected" and "sequence parallel is True, not the tuned False" in sp.detail


@needs_torchtitan
@pytest.mark.parametrize(
    ("name", "read"),
    [
        (
            "shard-bf16",
            "dp replicate 1, dp shard 2, mixed_precision_param bfloat16, mixed_precision_reduce float32, "
            "fsdp_reshard_after_forward never, reshard after forward False,",
        ),
        (
            "replicate-fp32",
            "dp replicate 2, dp shard 1, mixed_precision_param float32, mixed_precision_reduce float32, "
            "fsdp_reshard_after_forward default,",
        ),
        (
            "fsdp-pp1",  # pp 1: torchtitan's default would reshard; the export keeps the stage gathered, as tuned
            "dp replicate 1, dp shard 4, mixed_precision_param bfloat16, mixed_precision_reduce float32, "
            "fsdp_reshard_after_forward never, reshard after forward False,",
        ),
        ("shard-reshard", "fsdp_reshard_after_forward always, reshard after forward True,"),
    ],
)
def test_torchtitan_reads_back_data_parallelism_and_precision(name: str, read: str) -> None:
    result = _check(CASES[name], "torchtitan", "0.3")
    assert result.status == "validated", result.line()
    assert read in result.detail


@needs_torchtitan
def test_torchtitan_refuses_wrong_data_parallelism_or_precision() -> None:
    fp32 = CASES["replicate-fp32"]
    text = export_config(fp32, "torchtitan", "0.3")
    # torchtitan's default param dtype is bfloat16: an fp32 export that leaves it out trains in bf16
    dropped = _check(fp32, "torchtitan", "0.3", text.replace("    --training.mixed_precision_param float32\n", ""))
    assert dropped.status == "rejected" and "mixed_precision_param is bfloat16, not the tuned float32" in dropped.detail
    text = export_config(CASES["shard-bf16"], "torchtitan", "0.3")
    product = _check(CASES["shard-bf16"], "torchtitan", "0.3", text.replace("shard_degree 2", "shard_degree 3"))
    assert product.status == "rejected" and product.detail.startswith("ParallelDims on world size 4:")
    policy = _check(CASES["shard-bf16"], "torchtitan", "0.3", text.replace("forward never", "forward sometimes"))
    assert policy.status == "rejected" and "invalid choice 'sometimes'" in policy.detail
    pp1 = CASES["fsdp-pp1"]
    default = export_config(pp1, "torchtitan", "0.3").replace("forward never", "forward default")
    wrong = _check(pp1, "torchtitan", "0.3", default)
    assert wrong.status == "rejected" and "reshard after forward is True, not the tuned False" in wrong.detail


@needs_torchtitan
def test_torchtitan_refuses_a_broken_export() -> None:
    text = export_config(CASES["1f1b-uneven"], "torchtitan", "0.3")
    renamed = _check(CASES["1f1b-uneven"], "torchtitan", "0.3", text.replace("microbatch_size", "microbatch_sizes"))
    assert renamed.status == "rejected" and "--parallelism.pipeline_parallel_microbatch_sizes" in renamed.detail
    graphs = _check(CASES["1f1b-uneven"], "torchtitan", "0.3", text.replace("    --training.disable_cuda_graphs\n", ""))
    assert graphs.status == "rejected" and "CUDA graphs do not support pipeline parallelism" in graphs.detail
    wrong = _check(CASES["1f1b-uneven"], "torchtitan", "0.3", text.replace("degree 4\n", "degree 2\n"))
    # torchtitan's ParallelDims refuses degrees that do not multiply to the world size the config was tuned on
    assert wrong.status == "rejected" and "ParallelDims on world size 4:" in wrong.detail
    assert "pp(2) != WORLD_SIZE(4)" in wrong.detail


@needs_torchtitan
def test_torchtitan_other_target_is_not_run_against_the_installed_version() -> None:
    result = _check(CASES["1f1b-uneven"], "torchtitan", "main")
    assert result.status == "not_run" and "export with --target 0.3 to check it here" in result.detail


# ---------------------------------------------------------------------------------------------- DeepSpeed

needs_deepspeed = pytest.mark.skipif(
    not _importable("deepspeed"), reason="DeepSpeed is not installed (pip install deepspeed==0.19.8)"
)


@needs_deepspeed
@pytest.mark.parametrize("name", list(CASES))
def test_deepspeed_accepts_and_keeps_the_boundaries(name: str) -> None:
    config = CASES[name]
    result = _check(config, "deepspeed", "0.19")
    assert result.status == "validated", result.line()
    assert f"train_batch_size {config.global_batch_size}, micro-batches {config.num_microbatches}" in result.detail
    assert f"bf16 {config.precision == 'bf16'}, zero stage {1 if config.candidate.sharded else 0}," in result.detail


@needs_deepspeed
@pytest.mark.parametrize(
    ("name", "read"),
    [  # the optimizer DeepSpeed's engine would build, by its own _do_optimizer_sanity_check
        ("shard-bf16", "bf16 True, zero stage 1, grad_accum_dtype fp32, optimizer BF16_Optimizer,"),
        ("replicate-fp32", "bf16 False, zero stage 0, grad_accum_dtype None, optimizer the torch optimizer itself,"),
        ("replicate-bf16", "bf16 True, zero stage 0, grad_accum_dtype None, optimizer BF16_Optimizer,"),
        ("shard-reshard", "bf16 False, zero stage 1, grad_accum_dtype None, optimizer ZeRO stage 1,"),
    ],
)
def test_deepspeed_reads_back_precision_and_zero(name: str, read: str) -> None:
    result = _check(CASES[name], "deepspeed", "0.19")
    assert result.status == "validated", result.line()
    assert read in result.detail


@needs_deepspeed
def test_deepspeed_refuses_zero_2_and_a_dtype_mix_under_its_pipeline() -> None:
    shard = CASES["shard-bf16"]
    text = export_config(shard, "deepspeed", "0.19")
    zero2 = _check(shard, "deepspeed", "0.19", text.replace('"stage": 1', '"stage": 2'))
    assert zero2.status == "rejected" and "ZeRO-2 and ZeRO-3 are incompatible with pipeline parallelism" in zero2.detail
    fp32 = _check(shard, "deepspeed", "0.19", text.replace('"enabled": true', '"enabled": false'))
    assert fp32.status == "rejected" and "bf16 is False, not the tuned True" in fp32.detail
    replicate = CASES["replicate-bf16"]
    text = export_config(replicate, "deepspeed", "0.19")
    mix = text.replace('"bf16": {', '"data_types": {"grad_accum_dtype": "fp32"}, "bf16": {')
    refused = _check(replicate, "deepspeed", "0.19", mix)
    assert refused.status == "rejected" and "unsupported mix" in refused.detail


@needs_deepspeed
def test_deepspeed_refuses_a_broken_export() -> None:
    config = CASES["1f1b-uneven"]
    text = export_config(config, "deepspeed", "0.19")
    parts = _check(config, "deepspeed", "0.19", text.replace("[0, 2, 6, 7, 10]  #", "[0, 2, 6, 8, 10]  #"))
    assert parts.status == "rejected" and "parts is [0, 2, 6, 8, 10], not the tuned [0, 2, 6, 7, 10]" in parts.detail
    batch = _check(config, "deepspeed", "0.19", text.replace('"train_batch_size": 64', '"train_batch_size": 60'))
    assert batch.status == "rejected" and batch.detail.startswith("DeepSpeedConfig:")


# ---------------------------------------------------------------------------------------------- Megatron-LM

needs_megatron = pytest.mark.skipif(
    not _importable("megatron.training.arguments"),
    reason="Megatron-LM is not importable (Python >= 3.12: pip install megatron-core==0.19.2, or a checkout)",
)


def _megatron_target() -> str:
    """The row of the Megatron-LM found here (core 0.19 or main): validation runs only against its own version."""
    installed = installed_version(ExportFormat.megatron)
    assert installed is not None
    return target_for_version(ExportFormat.megatron, installed)[0].version


@needs_megatron
@pytest.mark.parametrize("name", list(CASES))
def test_megatron_validate_args_counts_transformer_layers(name: str) -> None:
    config = CASES[name]
    result = _check(config, "megatron", _megatron_target())
    assert result.status == "validated", result.line()
    blocks = config.model_layers - (2 if config.layer_roles else 0)
    assert f"transformer layers {blocks}," in result.detail
    bf16 = config.precision == "bf16"
    assert f"bf16 {bf16}, distributed optimizer {config.candidate.sharded}," in result.detail
    if bf16:
        assert "fp32 gradient accumulation and all-reduce True" in result.detail
    assert f"tp {config.tensor_parallel_degree}, sequence parallel False," in result.detail


@needs_megatron
def test_megatron_refuses_a_wrong_layer_count() -> None:
    config = CASES["1f1b-uneven"]
    target = _megatron_target()
    text = export_config(config, "megatron", target).replace("--num-layers 8\n", "--num-layers 10\n")
    result = _check(config, "megatron", target, text)
    assert result.status == "rejected", result.line()


def test_validation_says_why_not_when_the_trainer_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    import autotune.exports.validate as validate

    monkeypatch.setattr(validate.importlib.util, "find_spec", lambda name: None)
    result = _check(CASES["zbv"], "megatron", "0.19")
    assert result.status == "not_run"
    assert result.line().startswith("not validated against Megatron-LM: megatron.training.arguments is not importable")
    assert dataclasses.asdict(result)["status"] == "not_run"
