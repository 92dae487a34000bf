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


@needs_torchtitan
def test_torchtitan_refuses_a_broken_export() -> None:
    text = export_config(CASES["1f1b-uneven"], "torchtitan", "0.3")
    renamed = _check(CASES["1f1b-uneven"], "torchtitan", "0.3", text.replace("microbatch_size", "microbatch_sizes"))
    assert renamed.status == "rejected" and "--parallelism.pipeline_parallel_microbatch_sizes" in renamed.detail
    graphs = _check(CASES["1f1b-uneven"], "torchtitan", "0.3", text.replace("    --training.disable_cuda_graphs\n", ""))
    assert graphs.status == "rejected" and "CUDA graphs do not support pipeline parallelism" in graphs.detail
    wrong = _check(CASES["1f1b-uneven"], "torchtitan", "0.3", text.replace("degree 4\n", "degree 2\n"))
    assert wrong.status == "rejected" and "pp is 2, not the tuned 4" in wrong.detail


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
