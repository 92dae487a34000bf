"""Feed an export to its trainer's own parser and config checks, where that trainer is importable, and read back
what it understood: pipeline degree, schedule, micro-batches, checkpointing, transformer layers per stage, data
parallelism (replicated or sharded), tensor parallelism and precision.

Each check runs the trainer's code in this process with its output captured (torchtitan: ConfigManager.parse_args,
ParallelDims on the config's world size and its own split and reshard-policy functions; DeepSpeed: DeepSpeedConfig
with the layout's data-parallel size, the optimizer checks of its engine, then the exported PipelineModule
subclass's _partition_layers; Megatron-LM: parse_args, validate_args and core_transformer_config_from_args). The
result is data; the CLI prints it.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
import io
import json
import logging
import math
import os
import re
import shlex
import sys
import types
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

from autotune.candidate import stage_bounds
from autotune.exports.deepspeed import deepspeed_split
from autotune.exports.megatron import megatron_plan
from autotune.exports.roles import LayerPlan
from autotune.exports.targets import (
    DISTRIBUTIONS,
    TRAINER_NAMES,
    ExportFormat,
    TargetVersion,
    installed_version,
    target_for_version,
)
from autotune.schedules import SCHEDULES
from autotune.tuned_config import TunedConfig

TORCHTITAN_BASE = ["--module", "llama3", "--config", "llama3_debugmodel"]
"""The config function the torchtitan flags are checked on top of (torchtitan's own debug model)."""
MEGATRON_MODEL_FLAGS = [
    "--hidden-size",
    "64",
    "--num-attention-heads",
    "4",
    "--seq-length",
    "32",
    "--max-position-embeddings",
    "32",
]
"""A small model shape, which Megatron's checks need and the export leaves to the user."""


def megatron_model_flags(tp: int) -> list[str]:
    """MEGATRON_MODEL_FLAGS with as many heads as tp needs (validate_args: heads divisible by tp), 16 per head."""
    heads = math.lcm(4, tp)
    return ["--hidden-size", str(16 * heads), "--num-attention-heads", str(heads), *MEGATRON_MODEL_FLAGS[4:]]


@dataclass(frozen=True, kw_only=True)
class Validation:
    """What the trainer's own checks said about an export."""

    status: Literal["validated", "rejected", "not_run"]
    """validated: accepted and read back as tuned; rejected: refused, or read back otherwise; not_run: no check."""
    against: str
    """The trainer and version checked against ("torchtitan 0.3.0"), or the trainer's name when not run."""
    detail: str
    """What was run and read back, what was refused, or why nothing ran."""

    def line(self) -> str:
        if self.status == "validated":
            return f"validated against {self.against}: {self.detail}"
        if self.status == "rejected":
            return f"rejected by {self.against}: {self.detail}"
        return f"not validated against {self.against}: {self.detail}"


def check_export(
    config: TunedConfig, fmt: ExportFormat, text: str, target: TargetVersion, plan: LayerPlan
) -> Validation:
    """Run the trainer's checks on `text` (the export of `config` for `target`)."""
    name = TRAINER_NAMES[fmt]
    module = {
        ExportFormat.torchtitan: "torchtitan.config",
        ExportFormat.deepspeed: "deepspeed",
        ExportFormat.megatron: "megatron.training.arguments",
    }[fmt]
    with _quiet():  # finding megatron.training.arguments imports its parent packages
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):
            found = False
    if not found:
        return Validation(
            status="not_run",
            against=name,
            detail=f"{module} is not importable in this environment "
            f"(install {DISTRIBUTIONS[fmt] if fmt is not ExportFormat.megatron else 'Megatron-LM'} "
            f"to check the export with its own code)",
        )
    version = installed_version(fmt)
    if version is not None:
        installed_row, _ = target_for_version(fmt, version)
        if installed_row.version != target.version:
            return Validation(
                status="not_run",
                against=f"{name} {version}",
                detail=f"the installed {name} {version} takes the keys of target {installed_row.version}, not "
                f"{target.version}; export with --target {installed_row.version} to check it here",
            )
    core = "core " if fmt is ExportFormat.megatron else ""
    against = f"{name} {core}{version}" if version else f"{name} (version unknown)"
    check = {
        ExportFormat.torchtitan: _torchtitan,
        ExportFormat.deepspeed: _deepspeed,
        ExportFormat.megatron: _megatron,
    }[fmt]
    try:
        problems, detail = check(config, text, target, plan)
    except _Rejected as exc:
        return Validation(status="rejected", against=against, detail=str(exc))
    if problems:
        return Validation(status="rejected", against=against, detail=f"{detail}; but {'; '.join(problems)}")
    return Validation(status="validated", against=against, detail=detail)


class _Rejected(Exception):
    """The trainer's own code refused the export."""


@contextlib.contextmanager
def _quiet() -> Iterator[io.StringIO]:
    """Capture what the trainer prints (tyro's error boxes, Megatron's argument dump, warnings)."""
    buffer = io.StringIO()
    logging.disable(logging.WARNING)  # their loggers hold the real stdout / stderr; keep their chatter off them
    try:
        with contextlib.redirect_stdout(buffer), contextlib.redirect_stderr(buffer):
            yield buffer
    finally:
        logging.disable(logging.NOTSET)


def _refusal(output: str, exc: BaseException | None = None) -> str:
    """One line from a trainer's refusal: tyro's boxed message, else the exception's text."""
    text = " ".join(re.sub(r"[│╭╮╰╯─]+|-{3,}", " ", output).split())
    for marker in ("Unrecognized options:", "Error parsing", "error:", "Value error", "Invalid choice"):
        if marker in text:
            start = text.index(marker)
            return text[start : start + 300].split(" For full helptext")[0]
    message = f"{type(exc).__name__}: {exc}" if exc is not None else text[-300:]
    return " ".join(message.split())[:400]


def shell_array(text: str, name: str) -> list[str]:
    """The words of the bash array NAME=( ... ) in an export, as bash would split them."""
    body = re.search(rf"^{name}=\(\n(.*?)^\)$", text, re.DOTALL | re.MULTILINE)
    if body is None:
        raise _Rejected(f"the export has no {name}=( ... ) array")
    return shlex.split(body.group(1))


# ---------------------------------------------------------------------------------------------- torchtitan


def _torchtitan(c: TunedConfig, text: str, target: TargetVersion, plan: LayerPlan) -> tuple[list[str], str]:
    from torchtitan.config import ConfigManager  # type: ignore[import-not-found]

    if target.form == "toml":
        import tempfile

        with tempfile.NamedTemporaryFile("w", suffix=".toml", delete=False) as handle:
            handle.write(text)
        argv = ["--job.config_file", handle.name]
        how = "ConfigManager.parse_args(--job.config_file)"
    else:
        argv = TORCHTITAN_BASE + shell_array(text, "AUTOTUNE_TORCHTITAN_ARGS")
        how = f"ConfigManager.parse_args({' '.join(TORCHTITAN_BASE)} + the flags)"
    with _quiet() as output:
        try:
            job = ConfigManager().parse_args(argv)
        except (SystemExit, Exception) as exc:  # noqa: BLE001 - tyro exits 2; its checks raise ValueError and more
            raise _Rejected(f"{how}: {_refusal(output.getvalue(), exc)}") from None
    if target.form == "toml":
        os.unlink(argv[1])
    par, training = job.parallelism, job.training
    read: dict[str, Any] = {
        "pp": par.pipeline_parallel_degree,
        "schedule": par.pipeline_parallel_schedule,
        **_torchtitan_data_parallel(par, training, c),
    }
    if target.version == "main":
        # micro-batches per pipeline x gradient-accumulation steps, from the token counts
        per_pipeline = par.num_pp_microbatches if c.pipeline_degree > 1 else 1
        tokens_per_round = training.num_tokens_per_microbatch_per_dp_rank * per_pipeline * c.data_parallel_degree
        read["micro-batches"] = per_pipeline * (training.num_tokens_per_train_step // tokens_per_round)
    elif c.pipeline_degree > 1:
        read["micro-batches"] = training.local_batch_size // par.pipeline_parallel_microbatch_size
    else:
        read["micro-batches"] = training.global_batch_size // (training.local_batch_size * c.data_parallel_degree)
    ac = job.activation_checkpoint
    if ac is None:
        mode = "none"
    elif isinstance(getattr(ac, "mode", None), str):  # 0.2: [activation_checkpoint] mode
        mode = ac.mode
    else:  # 0.3 and main: the subcommand's config class, FullAC.Config -> full
        mode = type(ac).__qualname__.split(".")[0].removesuffix("AC").lower()
    read["checkpointing"] = mode
    if c.pipeline_degree > 1:
        read["blocks per stage"] = _torchtitan_split(par, c, plan)
    v_fallback = c.schedule.value in ("VHalf", "VMin")
    sharded = c.candidate.sharded
    want: dict[str, Any] = {
        "pp": c.pipeline_degree,
        "schedule": "ZBVZeroBubble" if v_fallback else c.schedule.value,
        "dp replicate": 1 if sharded else c.data_parallel_degree,
        "dp shard": c.data_parallel_degree if sharded else 1,
        "mixed_precision_param": "bfloat16" if c.precision == "bf16" else "float32",
        "mixed_precision_reduce": "float32",
        "fsdp_reshard_after_forward": ("always" if c.fsdp_reshard_after_forward else "never") if sharded else "default",
        "micro-batches": c.num_microbatches,
        "checkpointing": "full" if c.activation_checkpointing else "none",
    }
    if sharded:
        want["reshard after forward"] = c.fsdp_reshard_after_forward
    want["tp"] = c.tensor_parallel_degree
    if c.tensor_parallel_degree > 1:
        want["sequence parallel" if target.version != "0.2" else "loss parallel"] = False
    if c.pipeline_degree > 1:
        want["blocks per stage"] = plan.block_split
    return _compare(read, want, f"{how} accepted the export and read back")


def _torchtitan_data_parallel(par: Any, training: Any, c: TunedConfig) -> dict[str, Any]:
    """The data- and tensor-parallel degrees as torchtitan's ParallelDims resolves them on the config's world size (it
    refuses degrees whose product is not the world size), the precision, the reshard policy with the boolean
    torchtitan's own get_fsdp_reshard_after_forward_policy makes of it at this pp, and with tp > 1 whether sequence
    (0.3, main) or loss (0.2) parallelism is on."""
    from torchtitan.distributed import ParallelDims  # type: ignore[import-not-found]

    with _quiet() as output:
        try:
            if hasattr(ParallelDims, "from_config"):  # 0.3 and main
                dims = ParallelDims.from_config(par, c.gpus)
            else:  # 0.2: the trainer builds it from the same fields (train.py init_distributed)
                dims = ParallelDims(
                    dp_shard=par.data_parallel_shard_degree,
                    dp_replicate=par.data_parallel_replicate_degree,
                    cp=par.context_parallel_degree,
                    tp=par.tensor_parallel_degree,
                    pp=par.pipeline_parallel_degree,
                    ep=par.expert_parallel_degree,
                    etp=par.expert_tensor_parallel_degree,
                    world_size=c.gpus,
                )
        except Exception as exc:  # noqa: BLE001 - ParallelDims asserts
            refusal = _refusal(output.getvalue(), exc)
            raise _Rejected(f"ParallelDims on world size {c.gpus}: {refusal}") from None
    read: dict[str, Any] = {
        "dp replicate": dims.dp_replicate,
        "dp shard": dims.dp_shard,
        "mixed_precision_param": training.mixed_precision_param,
        "mixed_precision_reduce": training.mixed_precision_reduce,
        "fsdp_reshard_after_forward": par.fsdp_reshard_after_forward,
    }
    if dims.dp_shard > 1:
        try:
            from torchtitan.distributed.fsdp import get_fsdp_reshard_after_forward_policy  # type: ignore[import-not-found]
        except ImportError:  # 0.2 resolves the policy inline in apply_fsdp: the same rule
            read["reshard after forward"] = {"always": True, "never": False}.get(
                par.fsdp_reshard_after_forward, not dims.pp_enabled
            )
        else:
            read["reshard after forward"] = get_fsdp_reshard_after_forward_policy(
                par.fsdp_reshard_after_forward, dims.pp_enabled
            )
    read["tp"] = dims.tp
    if dims.tp > 1 and hasattr(par, "enable_sequence_parallel"):  # 0.3 and main
        read["sequence parallel"] = par.enable_sequence_parallel
    elif dims.tp > 1:  # 0.2: sequence parallel always; loss parallel unless disabled
        read["loss parallel"] = not par.disable_loss_parallel
    return read


def _torchtitan_split(par: Any, c: TunedConfig, plan: LayerPlan) -> list[int]:
    """Transformer blocks per stage as torchtitan computes them from the parsed settings."""
    if par.module_fqns_per_model_part is not None:
        parts = par.module_fqns_per_model_part
        if not plan.known:
            return [len(part) for part in parts]
        return [sum(1 for name in part if name.startswith("layers.")) for part in parts]
    from torchtitan.distributed import pipeline_parallel as pipeline  # type: ignore[import-not-found]

    dims = types.SimpleNamespace(pp=par.pipeline_parallel_degree)
    model = types.SimpleNamespace(layers=[None] * plan.blocks)
    generate = getattr(pipeline, "_generate_llm_fqn_per_model_part", None) or pipeline.generate_llm_fqn_per_model_part
    with _quiet():
        if hasattr(pipeline, "_get_pipeline_metadata"):  # 0.3 and main
            stages, layers, first, last = pipeline._get_pipeline_metadata(dims, par, model)
        else:  # 0.2: the same arithmetic inline in pipeline_llm
            first, last, layers = (
                par.pipeline_parallel_first_stage_less_layers,
                par.pipeline_parallel_last_stage_less_layers,
                plan.blocks,
            )
            per_stage = par.pipeline_parallel_layers_per_stage
            multi = SCHEDULES[c.schedule].placement != "single"
            stages = (
                math.ceil((layers + first + last) / per_stage)
                if per_stage
                else par.pipeline_parallel_degree * (2 if multi else 1)
            )
        parts = generate(stages, layers, first, last)
    return [sum(1 for name in part if name.startswith("layers.")) for part in parts]


# ---------------------------------------------------------------------------------------------- DeepSpeed


class _LayoutMpu:
    """The pp x dp layout as the model-parallel unit DeepSpeedConfig asks for its data-parallel size."""

    def __init__(self, pp: int, dp: int) -> None:
        self.pp, self.dp = pp, dp

    def get_data_parallel_world_size(self) -> int:
        return self.dp

    def get_model_parallel_world_size(self) -> int:
        return 1

    def get_pipeline_model_parallel_world_size(self) -> int:
        return self.pp


def _deepspeed(c: TunedConfig, text: str, target: TargetVersion, plan: LayerPlan) -> tuple[list[str], str]:
    import torch.distributed as dist

    doc = json.loads(text)
    with _quiet() as output:
        try:
            import deepspeed  # type: ignore[import-not-found]
            from deepspeed.runtime.config import DeepSpeedConfig  # type: ignore[import-not-found]
        except Exception as exc:  # noqa: BLE001 - whatever the trainer's code raises is its refusal
            raise _Rejected(f"import deepspeed: {_refusal(output.getvalue(), exc)}") from None
        started = not dist.is_initialized()
        if started:  # DeepSpeedConfig asks the mpu for the data-parallel size only inside a process group
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        try:  # the process group is gone afterwards, whatever the trainer's checks said
            try:
                deepspeed.comm.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)
                ds = DeepSpeedConfig(doc, mpu=_LayoutMpu(c.pipeline_degree, c.data_parallel_degree))
            except (SystemExit, Exception) as exc:  # noqa: BLE001 - the trainer's checks raise assert, ValueError
                raise _Rejected(f"DeepSpeedConfig: {_refusal(output.getvalue(), exc)}") from None
            try:
                optimizer = _deepspeed_optimizer(ds)
            except (SystemExit, Exception) as exc:  # noqa: BLE001 - NotImplementedError for a dtype mix it refuses
                raise _Rejected(f"PipelineEngine's optimizer checks: {_refusal(output.getvalue(), exc)}") from None
        finally:
            if started and dist.is_initialized():
                dist.destroy_process_group()
    read: dict[str, Any] = {
        "train_batch_size": ds.train_batch_size,
        "micro-batches": ds.gradient_accumulation_steps,
        "micro-batch size": ds.train_micro_batch_size_per_gpu,
        "activation_checkpoint_interval": ds.pipeline["activation_checkpoint_interval"],
        "use_reentrant": ds.pipeline.get("use_reentrant", True),
        "bf16": ds.bfloat16_config.enabled,
        "zero stage": int(ds.zero_optimization_stage),
        "grad_accum_dtype": ds.grad_accum_dtype,
        "optimizer": optimizer,
    }
    dual = SCHEDULES[c.schedule].placement == "v"
    parts, phases = _deepspeed_parts(doc, c.pipeline_degree, c.model_layers, dual)
    read["parts"] = parts
    want_parts = stage_bounds(deepspeed_split(c))
    want: dict[str, Any] = {
        "train_batch_size": c.global_batch_size,
        "micro-batches": c.num_microbatches,
        "micro-batch size": c.micro_batch_size,
        "activation_checkpoint_interval": max(c.layers_per_stage) if c.activation_checkpointing else 0,
        "use_reentrant": not c.activation_checkpointing,
        "parts": want_parts,
        "bf16": c.precision == "bf16",
        "zero stage": 1 if c.candidate.sharded else 0,
        "grad_accum_dtype": "fp32" if c.candidate.sharded and c.precision == "bf16" else None,
    }
    problems, detail = _compare(
        read,
        want,
        f"DeepSpeedConfig accepted the config with the pp {c.pipeline_degree} x dp "
        f"{c.data_parallel_degree} layout, and the export's PipelineModule subclass, through DeepSpeed's own "
        f"_partition_layers{' (DualPipeVModule: stages doubled, rank r also holding stage 2pp-1-r)' if dual else ''} "
        f"on each of the {c.pipeline_degree} stages, read back",
    )
    mirrored = [(want_parts[r], want_parts[r + 1]) for r in range(len(want_parts) - 1)]
    for rank, bounds in enumerate(phases):
        expected = [mirrored[rank]] + ([mirrored[2 * c.pipeline_degree - 1 - rank]] if dual else [])
        if bounds != expected:
            problems.append(f"rank {rank} builds layers {bounds}, not {expected}")
    return problems, detail


def _deepspeed_optimizer(ds: Any) -> str:
    """The optimizer wrapper DeepSpeed's PipelineEngine would build for this config, by its own rules: the ZeRO stage
    check of PipelineEngine.__init__ (mirrored: it is inline there) and DeepSpeedEngine._do_optimizer_sanity_check,
    run on a bare engine that holds only the parsed config."""
    import torch
    from deepspeed.runtime import engine as ds_engine  # type: ignore[import-not-found]
    from deepspeed.runtime.pipe.engine import PipelineEngine  # type: ignore[import-not-found]
    from deepspeed.runtime.zero.config import ZeroStageEnum  # type: ignore[import-not-found]

    if ds.zero_optimization_stage >= ZeroStageEnum.gradients:
        raise _Rejected(
            f"PipelineEngine: ZeRO-2 and ZeRO-3 are incompatible with pipeline parallelism (zero_optimization.stage "
            f"{int(ds.zero_optimization_stage)})"
        )
    bare = PipelineEngine.__new__(PipelineEngine)
    torch.nn.Module.__init__(bare)
    bare._config, bare.pipeline_parallelism, bare.global_rank = ds, True, 0
    wrapper = bare._do_optimizer_sanity_check(torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))]))
    names = {
        ds_engine.ZERO_OPTIMIZATION: f"ZeRO stage {int(ds.zero_optimization_stage)}",
        ds_engine.BFLOAT16: "BF16_Optimizer",
        ds_engine.FP16: "FP16_Optimizer",
        ds_engine.DDP_BFLOAT16: "FP16_Optimizer over bfloat16",
        None: "the torch optimizer itself",
    }
    return names.get(wrapper, str(wrapper))


def _deepspeed_parts(doc: dict[str, Any], pp: int, layers: int, dual: bool) -> tuple[list[int], list[list[Any]]]:
    """Run the snippet's class's _partition_layers for every pipeline rank, without building the layers."""
    import torch

    namespace: dict[str, Any] = {}
    exec("\n".join(doc["_autotune_pipeline_module"]), namespace)  # the export's own code, as a user runs it
    cls = namespace["TunedDualPipeVModule" if dual else "TunedPipelineModule"]
    parts: list[int] = []
    phases: list[list[Any]] = []
    for rank in range(pp):
        module = cls.__new__(cls)
        torch.nn.Module.__init__(module)
        module.num_stages, module.stage_id, module.global_rank = pp, rank, rank
        module._layer_specs = [None] * layers
        try:
            with _quiet():
                module._partition_layers(method="uniform")
        except Exception as exc:  # noqa: BLE001 - whatever the trainer's code raises is its refusal
            raise _Rejected(f"_partition_layers on stage {rank}: {type(exc).__name__}: {exc}") from None
        parts = list(module.parts)
        phases.append(list(module.phase_bounds) if dual else [(module._local_start, module._local_stop)])
    return parts, phases


# ---------------------------------------------------------------------------------------------- Megatron-LM


def _megatron(c: TunedConfig, text: str, target: TargetVersion, plan: LayerPlan) -> tuple[list[str], str]:
    flags = shell_array(text, "AUTOTUNE_MEGATRON_ARGS")
    model_flags = megatron_model_flags(c.tensor_parallel_degree)
    argv = ["pretrain_gpt.py", *model_flags, *flags]
    exported = dict(re.findall(r"^export (\w+)=(\S+)$", text, flags=re.MULTILINE))  # what the script sets
    saved_argv, saved_env = sys.argv, {k: os.environ.get(k) for k in ("WORLD_SIZE", "RANK", *exported)}
    with _quiet() as output:
        try:
            sys.argv = argv
            os.environ.update(WORLD_SIZE=str(c.gpus), RANK="0", **exported)
            import megatron.training.arguments as arguments  # type: ignore[import-not-found]
            from megatron.training.arguments import (  # type: ignore[import-not-found]
                core_transformer_config_from_args,
                parse_args,
                validate_args,
            )

            args = parse_args()
            with _gpu_arch_stand_in(arguments):
                validate_args(args)
            config = core_transformer_config_from_args(args)
            blocks = _megatron_split(config)
        except (SystemExit, Exception) as exc:  # noqa: BLE001 - the trainer's checks raise assert, ValueError, ...
            raise _Rejected(
                f"parse_args + validate_args + core_transformer_config_from_args: {_refusal(output.getvalue(), exc)}"
            ) from None
        finally:
            sys.argv = saved_argv
            for key, value in saved_env.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
    read = {
        "pp": config.pipeline_model_parallel_size,
        "transformer layers": config.num_layers,
        "data-parallel size": args.data_parallel_size,
        "tp": config.tensor_model_parallel_size,
        "sequence parallel": bool(args.sequence_parallel),
        "blocks per stage": blocks,
        "recompute": config.recompute_granularity or "none",
        "bf16": bool(args.bf16),
        "distributed optimizer": bool(args.use_distributed_optimizer),
        "fp32 gradient accumulation and all-reduce": bool(args.accumulate_allreduce_grads_in_fp32),
    }
    expected_blocks = megatron_plan(c, plan).block_split
    want = {
        "pp": c.pipeline_degree,
        "transformer layers": plan.blocks,
        "data-parallel size": c.data_parallel_degree,
        "tp": c.tensor_parallel_degree,
        "sequence parallel": False,
        "blocks per stage": expected_blocks,
        "recompute": "full" if c.activation_checkpointing else "none",
        "bf16": c.precision == "bf16",
        "distributed optimizer": c.candidate.sharded,
    }
    if c.precision == "bf16":  # validate_args turns it on for bf16; fp32 gradients are float32 anyway
        want["fp32 gradient accumulation and all-reduce"] = True
    return _compare(
        read,
        want,
        f"parse_args + validate_args + core_transformer_config_from_args (with "
        f"{' '.join(model_flags)} for the model shape, WORLD_SIZE={c.gpus}) read back",
    )


@contextlib.contextmanager
def _gpu_arch_stand_in(arguments: Any) -> Iterator[None]:
    """Without a GPU, Megatron's validate_args cannot read the device's architecture (it asks torch.cuda, for the
    CUDA_DEVICE_MAX_CONNECTIONS advice given with tp > 1, which it only warns about): it reads Hopper's (9), the
    GPUs the exports are written for. On a GPU machine, the device's own."""
    import torch

    original = getattr(arguments, "get_device_arch_version", None)
    if original is None or torch.cuda.is_available():
        yield
        return
    arguments.get_device_arch_version = lambda: 9
    try:
        yield
    finally:
        arguments.get_device_arch_version = original


def _megatron_split(config: Any) -> list[int]:
    """Transformer layers per stage in model order, from Megatron's own parsed layout or layer counting."""
    pp = config.pipeline_model_parallel_size
    vpp = config.virtual_pipeline_model_parallel_size or 1
    layout = config.pipeline_model_parallel_layout
    if layout is not None:
        from megatron.core.transformer.enums import LayerType  # type: ignore[import-not-found]

        return [layout.layout[rank][stage].count(LayerType.decoder) for stage in range(vpp) for rank in range(pp)]
    from megatron.core.transformer.transformer_block import get_num_layers_to_build  # type: ignore[import-not-found]

    return [
        get_num_layers_to_build(config, vp_stage=stage if vpp > 1 else None, pp_rank=rank)
        for stage in range(vpp)
        for rank in range(pp)
    ]


def _compare(read: dict[str, Any], want: dict[str, Any], how: str) -> tuple[list[str], str]:
    detail = f"{how} " + ", ".join(f"{key} {value}" for key, value in read.items())
    problems = [f"{key} is {read[key]}, not the tuned {want[key]}" for key in want if read.get(key) != want[key]]
    return problems, detail
