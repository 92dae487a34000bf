"""Options shared by several commands, declared once (STYLE.md: aliases, not copies per command), and the parsing of
the flag values Typer cannot parse itself."""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Annotated

import typer

from autotune.errors import UsageError
from autotune.exports import ExportFormat


class DeviceChoice(str, Enum):
    auto = "auto"
    cpu = "cpu"
    cuda = "cuda"


class WireDtypeChoice(str, Enum):
    """--wire-dtype choices: the candidate's WireDtype values."""

    float32 = "float32"
    bfloat16 = "bfloat16"


class PrecisionChoice(str, Enum):
    """--precision choices: the candidate's Precision values."""

    fp32 = "fp32"
    bf16 = "bf16"


PrecisionOpt = Annotated[
    PrecisionChoice | None,
    typer.Option(
        "--precision",
        help="fp32, or bf16: bfloat16 compute over float32 master weights, optimizer state and gradient reduction "
        "(FSDP2's mixed precision when sharded, torch.autocast otherwise). Default: the model file's PRECISION, "
        "else bf16 on cuda and fp32 on cpu.",
    ),
]
DataParallelOpt = Annotated[
    str,
    typer.Option(
        "--data-parallel",
        help="How data-parallel replicas may hold their stages, comma-separated: replicate (each holds its whole "
        "stages: DDP), shard (FSDP2: parameters, gradients and optimizer state split over the replicas; searched "
        "with and without resharding after each forward).",
    ),
]


def parse_data_parallel(text: str) -> tuple[str, ...]:
    """--data-parallel 'replicate,shard' -> ('replicate', 'shard'); one line naming the choices otherwise."""
    from autotune.candidate import DATA_PARALLEL_MODES

    modes = tuple(dict.fromkeys(part.strip().lower() for part in text.split(",") if part.strip()))
    wrong = [m for m in modes if m not in DATA_PARALLEL_MODES]
    if wrong or not modes:
        raise UsageError(
            f"--data-parallel {text!r}: {'unknown ' + ', '.join(wrong) if wrong else 'nothing given'}; "
            f"pass a comma-separated list of {', '.join(DATA_PARALLEL_MODES)}"
        )
    return modes


TensorParallelOpt = Annotated[
    str | None,
    typer.Option(
        "--tensor-parallel",
        help="Tensor-parallel degrees to search, comma-separated (1,2,4): each stage's layers split over that many "
        "consecutive ranks of a node with the model's own plan. Default: every degree the plan allows (its heads "
        "and sharded sizes divisible, at most a node's GPUs); 1 only for a model without a plan.",
    ),
]


def parse_degrees(text: str | None, flag: str) -> tuple[int, ...] | None:
    """'1,2,4' -> (1, 2, 4); None stays None; one line naming the flag otherwise."""
    if text is None:
        return None
    try:
        degrees = tuple(sorted({int(part) for part in text.split(",") if part.strip()}))
    except ValueError:
        degrees = ()
    if not degrees or degrees[0] < 1:
        raise UsageError(f"cannot read {flag} {text!r}; pass positive whole numbers separated by commas, e.g. 1,2")
    return degrees


AllowAsyncOpt = Annotated[
    bool,
    typer.Option(
        "--allow-async",
        help="Allow the asynchronous schedule 2BW (PipeDream-2BW): no flush between optimizer steps, two weight "
        "versions per stage, each update using the gradient of the weights one step older. It trains differently "
        "from the synchronous schedules, so it is never used without this flag.",
    ),
]

ExportTarget = ExportFormat
"""--format choices of `autotune export`: the exporter's own formats."""

ModelArg = Annotated[Path, typer.Argument(help="Your model file: build_model(), make_batch(B), loss_fn(out, y).")]
GpusOpt = Annotated[
    int, typer.Option("--gpus", "-g", min=1, help="Ranks to run (GPUs, or CPU processes with --device cpu).")
]
BatchOpt = Annotated[int, typer.Option("--batch-size", "-b", min=1, help="Global batch size B per optimizer step.")]
MemoryOpt = Annotated[
    str | None,
    typer.Option(
        "--memory-limit",
        help="Per-rank memory cap, e.g. 40GiB. Default: the GPU's memory less 2 GiB for the CUDA context and NCCL "
        "buffers and 5 % of the rest for fragmentation (none on CPU).",
    ),
]
DeviceOpt = Annotated[
    DeviceChoice, typer.Option("--device", help="cuda: one GPU per rank (NCCL). cpu: one process per rank (gloo).")
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON object on stdout and nothing else.")]
StepsOpt = Annotated[int, typer.Option("--steps", min=1, help="Measured steps per run (the median is reported).")]
WarmupOpt = Annotated[
    int, typer.Option("--warmup", min=1, help="Unmeasured steps before them; the last one measures memory.")
]
RunTimeoutOpt = Annotated[
    str,
    typer.Option(
        "--timeout",
        help="How long a run (and the model check before it) may take before it counts as hung: 300, 90s, 10m.",
    ),
]
MicroBatchOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--micro-batch-size",
        "-M",
        help="Micro-batch sizes to profile, repeatable or comma-separated (8,32). Default: powers of two dividing B, "
        "and B (at most 6); `plan` stops at the largest micro-batch a candidate over --gpus can use.",
    ),
]
SplitAtOpt = Annotated[
    str | None,
    typer.Option(
        "--split-at",
        help="Cut the model between these modules: names or globs, comma-separated, e.g. 'model.layers.*'. "
        "Default: SPLIT_AT or split_points(model) in the model file, else autotune's own cut (an nn.Sequential's "
        "layers; the blocks of Hugging Face decoder LMs, timm ViT and torchvision ResNet; else repeated blocks).",
    ),
]
EveryBlockOpt = Annotated[
    bool,
    typer.Option(
        "--profile-every-block",
        help="Measure every block, not one of each set of blocks that are the same (class, structure, shapes, "
        "attributes such as a sliding window).",
    ),
]
RepeatsOpt = Annotated[int, typer.Option("--repeats", min=1, help="Timed repeats per micro-batch size (medians).")]


def parse_split(text: str | None) -> tuple[int, ...] | None:
    """--layers-per-stage 3,5 -> (3, 5)."""
    if text is None:
        return None
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise UsageError(f"cannot read --layers-per-stage {text!r}; write layer counts like 3,5") from None


def parse_split_at(text: str | None) -> tuple[str, ...] | None:
    """--split-at 'model.layers.*,lm_head' -> ("model.layers.*", "lm_head"); None when not given."""
    if text is None:
        return None
    patterns = tuple(p.strip() for p in text.split(",") if p.strip())
    if not patterns:
        raise UsageError("--split-at needs module names or globs, e.g. --split-at 'model.layers.*'")
    return patterns


def parse_sizes(values: list[str] | None) -> list[int] | None:
    """--micro-batch-size 8,32 -M 64 -> [8, 32, 64]."""
    if not values:
        return None
    try:
        sizes = [int(part) for value in values for part in value.split(",") if part.strip()]
    except ValueError:
        raise UsageError(f"cannot read --micro-batch-size {','.join(values)!r}; write sizes like 8,32") from None
    if not sizes or min(sizes) < 1:
        raise UsageError(f"--micro-batch-size needs sizes of at least 1, got {','.join(values)!r}")
    return sizes


def parse_seconds(text: str | None, flag: str) -> float | None:
    """A duration flag's value in seconds (300, 90s, 10m, 1h30m), at least one second; None stays None."""
    if text is None:
        return None
    from autotune.units import parse_duration

    seconds = parse_duration(text)
    if seconds < 1:
        raise UsageError(f"{flag} {text} is under a second; pass at least 1s")
    return seconds
