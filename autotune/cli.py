"""The `autotune` command: parse flags, call the library, render results, map errors to exit codes. No logic."""

from __future__ import annotations

import contextlib
import json
import logging
import sys
from collections.abc import Iterator
from enum import Enum
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console

from autotune.errors import EXIT_INFEASIBLE, EXIT_INTERNAL, EXIT_INTERRUPTED, AutotuneError

EXIT_CODES_HELP = "Exit codes: 0 ok, 1 internal error, 2 bad usage/config/model file, 3 nothing fits, 4 cannot launch, 130 interrupted."

app = typer.Typer(
    name="autotune",
    help="Tune pipeline-parallel PyTorch training: micro-batches (B/M), layer split, schedule, DP x PP, "
    "under a GPU memory limit. Start with `autotune search recipes/mlp.py --gpus 2 --device cpu --batch-size 64`.\n\n"
    + EXIT_CODES_HELP,
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="markdown",
)
console = Console()
err_console = Console(stderr=True)
_state: dict[str, bool] = {"debug": False}


class DeviceChoice(str, Enum):
    auto = "auto"
    cpu = "cpu"
    cuda = "cuda"


# Shared options, declared once (STYLE.md: aliases, not copies per command).
ModelArg = Annotated[Path, typer.Argument(help="Your model file: build_model(), make_batch(B), loss_fn(out, y).")]
GpusOpt = Annotated[int, typer.Option("--gpus", "-g", min=1, help="Ranks to run (GPUs, or CPU processes with --device cpu).")]
BatchOpt = Annotated[int, typer.Option("--batch-size", "-b", min=1, help="Global batch size B per optimizer step.")]
MemoryOpt = Annotated[
    str | None,
    typer.Option("--memory-limit", help="Per-rank memory cap, e.g. 40GiB. Default: the GPU's memory (none on CPU)."),
]
DeviceOpt = Annotated[
    DeviceChoice, typer.Option("--device", help="cuda: one GPU per rank (NCCL). cpu: one process per rank (gloo).")
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON object on stdout and nothing else.")]


@app.callback()
def _main(
    debug: Annotated[bool, typer.Option("--debug", help="Show tracebacks and debug logs.")] = False,
) -> None:
    _state["debug"] = debug
    logging.basicConfig(
        level=logging.DEBUG if debug else logging.WARNING, format="%(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )


@contextlib.contextmanager
def _errors_to_exit_codes() -> Iterator[None]:
    """One line on stderr and the error's exit code; tracebacks only with --debug."""
    try:
        yield
    except AutotuneError as exc:
        if _state["debug"]:
            raise
        err_console.print(f"[red]error:[/red] {exc}", highlight=False, soft_wrap=True)
        raise typer.Exit(exc.exit_code) from None
    except KeyboardInterrupt:
        err_console.print("interrupted", highlight=False)
        raise typer.Exit(EXIT_INTERRUPTED) from None


def _print_json(data: Any) -> None:
    sys.stdout.write(json.dumps(data, indent=2, default=str) + "\n")
    sys.stdout.flush()


def _parse_split(text: str | None) -> tuple[int, ...] | None:
    if text is None:
        return None
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        from autotune.errors import UsageError

        raise UsageError(f"cannot read --layers-per-stage {text!r}; write layer counts like 3,5") from None


@app.command(epilog=EXIT_CODES_HELP)
def trial(
    model: ModelArg,
    gpus: GpusOpt,
    batch_size: BatchOpt,
    microbatches: Annotated[int, typer.Option("--microbatches", "-m", min=1, help="B/M: micro-batches per step.")],
    schedule: Annotated[
        str,
        typer.Option(
            "--schedule", "-s",
            help="GPipe, 1F1B, Interleaved1F1B, LoopedBFS, InterleavedZeroBubble, ZBVZeroBubble or DualPipeV "
            "(case-insensitive).",
        ),
    ],
    layers_per_stage: Annotated[
        str | None,
        typer.Option(help="Layer count per stage, comma-separated, e.g. 3,5. Default: uniform."),
    ] = None,
    dp: Annotated[int, typer.Option("--dp", min=1, help="Data-parallel replicas; pipeline degree = gpus / dp.")] = 1,
    steps: Annotated[int, typer.Option(min=1, help="Measured steps (median is reported).")] = 5,
    warmup: Annotated[int, typer.Option(min=1, help="Unmeasured steps first; the last one measures memory.")] = 2,
    timeout: Annotated[float, typer.Option(min=1, help="Seconds before the trial counts as hung.")] = 300.0,
    memory_limit: MemoryOpt = None,
    device: DeviceOpt = DeviceChoice.auto,
    json_output: JsonOpt = False,
) -> None:
    """Run ONE configuration for real: N rank processes, torch's pipeline schedule, a few optimizer steps.

    Reports the median step time, throughput and each rank's peak memory. A run that fails is still a result:
    status `oom`, `timeout` or `error`, with the rank that caused it (exit 3 for oom, 1 for error or timeout).

    Example: `autotune trial recipes/mlp.py --gpus 2 --device cpu --batch-size 32 --microbatches 4 --schedule 1F1B`
    """
    with _errors_to_exit_codes():
        from autotune.candidate import Candidate, uniform_split
        from autotune.devices import resolve_device
        from autotune.errors import UsageError
        from autotune.model_file import check_model, load_model_file
        from autotune.schedules import default_stages_per_rank, parse_schedule
        from autotune.trial import TrialOptions, run_trial
        from autotune.units import parse_size

        chosen = parse_schedule(schedule)
        if gpus % dp:
            raise UsageError(f"--gpus {gpus} is not a multiple of --dp {dp}; pass a --dp that divides {gpus}")
        spec = load_model_file(model)
        check_model(spec, batch_size)
        pp = gpus // dp
        split = _parse_split(layers_per_stage) or uniform_split(spec.n_layers, pp * default_stages_per_rank(chosen))
        candidate = Candidate(
            schedule=chosen,
            pipeline_degree=pp,
            data_parallel_degree=dp,
            global_batch_size=batch_size,
            n_microbatches=microbatches,
            layers_per_stage=split,
        )
        candidate.validate(spec.n_layers)
        options = TrialOptions(
            steps=steps,
            warmup=warmup,
            timeout_s=timeout,
            memory_limit_bytes=parse_size(memory_limit) if memory_limit else None,
            device=resolve_device(device.value),
            keep_run_dir=_state["debug"],
        )
        with err_console.status(f"running {candidate.key} on {gpus} {options.device} rank(s)..."):
            measurement = run_trial(spec, candidate, options)
        if json_output:
            _print_json(measurement.to_dict())
        else:
            _render_measurement(measurement)
        if measurement.status != "ok":
            raise typer.Exit(EXIT_INFEASIBLE if measurement.status == "oom" else EXIT_INTERNAL)


def _render_measurement(m: Any) -> None:
    from rich.table import Table

    from autotune.units import format_bytes

    c = m.candidate
    table = Table(title=f"trial {c.key}", show_header=False)
    table.add_row("status", f"[green]{m.status}[/green]" if m.status == "ok" else f"[red]{m.status}[/red]")
    table.add_row("schedule", c.schedule.value)
    table.add_row("pp x dp", f"{c.pipeline_degree} x {c.data_parallel_degree}")
    table.add_row("micro-batches (B/M)", f"{c.n_microbatches} of {c.micro_batch_size} samples")
    table.add_row("layers per stage", ", ".join(map(str, c.layers_per_stage)))
    if m.status == "ok":
        table.add_row("step time (median)", f"{m.step_time_ms:.1f} ms")
        table.add_row("throughput", f"{m.throughput_samples_per_s:.1f} samples/s")
        table.add_row("peak memory per rank", ", ".join(format_bytes(b) for b in m.peak_memory_bytes))
        table.add_row("loss", f"{m.loss:.4f}" if m.loss is not None else "-")
    if m.error is not None:
        table.add_row("failed rank", str(m.error.rank) if m.error.rank is not None else "unknown")
        table.add_row("reason", m.error.message)
        if m.error.bytes_requested:
            table.add_row("bytes asked", format_bytes(m.error.bytes_requested))
    table.add_row("wall time", f"{m.wall_time_s:.2f} s")
    console.print(table)


class ExportTarget(str, Enum):
    """--format choices; the same names as autotune.exports.ExportFormat (a test keeps them equal)."""

    torchtitan = "torchtitan"
    deepspeed = "deepspeed"
    megatron = "megatron"


@app.command(epilog=EXIT_CODES_HELP)
def export(
    config: Annotated[Path, typer.Argument(help="A tuned config written by `autotune search --output`.")],
    fmt: Annotated[
        ExportTarget,
        typer.Option(
            "--format", "-f", case_sensitive=False,
            help="torchtitan: a TOML snippet. deepspeed: a JSON config. megatron: command-line flags.",
        ),
    ],
) -> None:
    """Print a tuned config as another trainer's settings: torchtitan TOML, DeepSpeed JSON or Megatron-LM flags.

    Comments in the output name whatever the target cannot express (a schedule it lacks, an arbitrary layer split,
    bf16 activations between stages) and what to check after loading it.

    Example: `autotune export autotune.yaml --format torchtitan > pipeline.toml`
    """
    with _errors_to_exit_codes():
        from autotune.exports import export_config
        from autotune.tuned_config import load_config

        text = export_config(load_config(config), fmt.value)
    sys.stdout.write(text)
    sys.stdout.flush()


def main() -> None:
    app()


if __name__ == "__main__":
    main()
