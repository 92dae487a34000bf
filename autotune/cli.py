"""The `autotune` command: parse flags, call the library, render results, map errors to exit codes. No logic."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
from collections.abc import Iterator
from enum import Enum
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console

from autotune.errors import EXIT_INFEASIBLE, EXIT_INTERNAL, EXIT_INTERRUPTED, AutotuneError

EXIT_CODES_HELP = (
    "Exit codes: 0 ok, 1 internal error, 2 bad usage/config/model file, 3 nothing fits, 4 cannot launch, "
    "130 interrupted."
)

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


class WireDtypeChoice(str, Enum):
    """--wire-dtype choices: the candidate's WireDtype values."""

    float32 = "float32"
    bfloat16 = "bfloat16"


# Shared options, declared once (STYLE.md: aliases, not copies per command).
ModelArg = Annotated[Path, typer.Argument(help="Your model file: build_model(), make_batch(B), loss_fn(out, y).")]
GpusOpt = Annotated[
    int, typer.Option("--gpus", "-g", min=1, help="Ranks to run (GPUs, or CPU processes with --device cpu).")
]
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
        level=logging.DEBUG if debug else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )


@contextlib.contextmanager
def _errors_to_exit_codes(json_output: bool = False) -> Iterator[None]:
    """One line on stderr and the error's exit code; tracebacks only with --debug. With --json, stdout also gets
    one JSON object {"status": "error", "error": ..., "exit_code": ...}, so scripts always have one to parse."""
    try:
        yield
    except AutotuneError as exc:
        if _state["debug"]:
            raise
        err_console.print(f"[red]error:[/red] {exc}", highlight=False, soft_wrap=True)
        if json_output:
            _print_json({"status": "error", "error": str(exc), "exit_code": exc.exit_code})
        raise typer.Exit(exc.exit_code) from None
    except KeyboardInterrupt:
        err_console.print("interrupted", highlight=False)
        if json_output:
            _print_json({"status": "interrupted", "error": "interrupted", "exit_code": EXIT_INTERRUPTED})
        raise typer.Exit(EXIT_INTERRUPTED) from None


def _print_json(data: Any) -> None:
    sys.stdout.write(json.dumps(data, indent=2, default=str) + "\n")
    sys.stdout.flush()


def _start_fork_server() -> None:
    """Rank processes fork from a server that imports torch; start it now so that its import overlaps this
    process's own (torch, the model file, profiling) instead of following it."""
    from autotune.trial import server

    server.start()


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
            "--schedule",
            "-s",
            help="GPipe, 1F1B, Interleaved1F1B, LoopedBFS, InterleavedZeroBubble, ZBVZeroBubble, DualPipeV, VHalf "
            "or VMin (case-insensitive).",
        ),
    ],
    layers_per_stage: Annotated[
        str | None,
        typer.Option(help="Layer count per stage, comma-separated, e.g. 3,5. Default: uniform."),
    ] = None,
    dp: Annotated[int, typer.Option("--dp", min=1, help="Data-parallel replicas; pipeline degree = gpus / dp.")] = 1,
    activation_checkpointing: Annotated[
        bool,
        typer.Option("--activation-checkpointing", help="Recompute each stage's forward in its backward."),
    ] = False,
    wire_dtype: Annotated[
        WireDtypeChoice,
        typer.Option(
            "--wire-dtype",
            help="dtype of activations and gradients sent between stages. bfloat16 also measures the gradients' "
            "relative error against a float32 twin on the first warm-up step.",
        ),
    ] = WireDtypeChoice.float32,
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
    with _errors_to_exit_codes(json_output):
        _start_fork_server()
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
            activation_checkpointing=activation_checkpointing,
            wire_dtype=wire_dtype.value,
        )
        candidate.validate(spec.n_layers)
        options = TrialOptions(
            steps=steps,
            warmup=warmup,
            timeout_s=timeout,
            memory_limit_bytes=parse_size(memory_limit) if memory_limit else None,
            device=resolve_device(device.value),
            keep_run_dir=_state["debug"],
            measure_wire_error=wire_dtype is WireDtypeChoice.bfloat16,
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
    table.add_row("activation checkpointing", "yes" if c.activation_checkpointing else "no")
    table.add_row("between stages", c.wire_dtype)
    if m.status == "ok":
        table.add_row("step time (median)", f"{m.step_time_ms:.1f} ms")
        table.add_row("throughput", f"{m.throughput_samples_per_s:.1f} samples/s")
        table.add_row("peak memory per rank", ", ".join(format_bytes(b) for b in m.peak_memory_bytes))
        table.add_row("loss", f"{m.loss:.4f}" if m.loss is not None else "-")
        if m.wire_grad_rel_error is not None:
            table.add_row("bf16 gradient error", f"{m.wire_grad_rel_error:.2%} relative to float32 between stages")
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
            "--format",
            "-f",
            case_sensitive=False,
            help="torchtitan: --section.key flags in a bash array (0.3, main) or a TOML snippet (0.2). deepspeed: a "
            "JSON config with the PipelineModule code that holds the split. megatron: flags in a bash array.",
        ),
    ],
    target: Annotated[
        str | None,
        typer.Option(
            "--target",
            "-t",
            metavar="VERSION",
            help="Trainer version: torchtitan 0.2 | 0.3 | main, deepspeed 0.19, megatron 0.19 | main. "
            "Default: the installed trainer's version, else the newest release.",
        ),
    ] = None,
    validate: Annotated[
        bool,
        typer.Option(
            "--validate",
            help="Run the installed trainer's own parser and config checks on the export and read back what it "
            "understood; exit 1 if it refuses the export or reads back other values.",
        ),
    ] = False,
) -> None:
    """Print a tuned config as another trainer's settings, for one trainer version (stamped in the output).

    torchtitan 0.3 / main: a bash array AUTOTUNE_TORCHTITAN_ARGS, one `--section.key value` per line and the
    `activation-checkpoint:full|none` subcommand last; pass it after your own flags:
    `torchrun ... -m torchtitan.train --module llama3 --config llama3_8b "${AUTOTUNE_TORCHTITAN_ARGS[@]}"`.
    DeepSpeed: the JSON config, whose `_autotune_pipeline_module` lines are the PipelineModule subclass that cuts
    the model at the tuned boundaries. Megatron-LM: a bash array AUTOTUNE_MEGATRON_ARGS.

    Comments name whatever the target cannot express (a schedule it lacks, bf16 activations between stages) and
    what to check. Megatron and torchtitan count transformer blocks: the config's layer_roles (or LAYER_ROLES in
    the model file) says which layers are embedding, blocks and head.

    Example: `autotune export autotune.yaml --format torchtitan --validate > torchtitan_args.sh`
    """
    with _errors_to_exit_codes():
        from autotune.exports import export_config, validate_export
        from autotune.tuned_config import load_config

        tuned = load_config(config)
        text = export_config(tuned, fmt.value, target)
    sys.stdout.write(text)
    sys.stdout.flush()
    if validate:
        with _errors_to_exit_codes():
            result = validate_export(tuned, fmt.value, text, target)
        err_console.print(result.line(), highlight=False, soft_wrap=True, markup=False)
        if result.status == "rejected":
            raise typer.Exit(1)


MicroBatchOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--micro-batch-size",
        "-M",
        help="Micro-batch sizes to profile, repeatable or comma-separated (8,32). Default: powers of two dividing B, "
        "and B (at most 6).",
    ),
]
RepeatsOpt = Annotated[int, typer.Option("--repeats", min=1, help="Timed repeats per micro-batch size (medians).")]


@app.command("profile", epilog=EXIT_CODES_HELP)
def profile_command(
    model: ModelArg,
    batch_size: BatchOpt,
    micro_batch_size: MicroBatchOpt = None,
    repeats: RepeatsOpt = 5,
    device: DeviceOpt = DeviceChoice.auto,
    json_output: JsonOpt = False,
) -> None:
    """Measure every layer in place at several micro-batch sizes: forward, input-grad and weight-grad backward time,
    saved-activation, output and parameter bytes (one thread on CPU, like one rank).

    Example: `autotune profile recipes/mlp.py --batch-size 64 --device cpu`
    """
    with _errors_to_exit_codes(json_output):
        from autotune.devices import resolve_device

        chosen = resolve_device(device.value)
        _, result = _load_and_profile(model, batch_size, chosen, _parse_sizes(micro_batch_size), repeats)
        if json_output:
            _print_json(result.to_dict())
        else:
            _render_profile(result)


@app.command("plan", epilog=EXIT_CODES_HELP)
def plan_command(
    model: ModelArg,
    gpus: GpusOpt,
    batch_size: BatchOpt,
    memory_limit: MemoryOpt = None,
    top: Annotated[int, typer.Option("--top", "-k", min=1, help="Candidates to show.")] = 10,
    micro_batch_size: MicroBatchOpt = None,
    repeats: RepeatsOpt = 5,
    device: DeviceOpt = DeviceChoice.auto,
    json_output: JsonOpt = False,
) -> None:
    """Profile the model, then simulate schedules x micro-batch counts (B/M) x balanced layer splits over N ranks
    and rank them by predicted throughput, with the B/M range worth trying. Nothing runs on N ranks: use
    `autotune trial` or `autotune search` to measure.

    Layouts: every pp x dp = N that the model and batch allow, pp = 1 (plain data parallelism) included; B/M and M
    are per replica. Activation checkpointing is ranked beside the rest: the fastest candidates also appear with it.

    `--json` prints a list of candidates: the config fields (pipeline_degree, data_parallel_degree, ...) plus
    predicted_step_time_ms, predicted_throughput_samples_per_s, predicted_peak_memory_bytes (one per pipeline rank;
    every replica holds the same) and feasible.

    Example: `autotune plan recipes/gpt.py --gpus 4 --batch-size 64 --device cpu --memory-limit 512MiB`
    """
    with _errors_to_exit_codes(json_output):
        from autotune.devices import device_memory_bytes, resolve_device
        from autotune.plan import ensure_feasible, plan, recommended_microbatch_range
        from autotune.units import parse_size

        limit = parse_size(memory_limit) if memory_limit else None
        chosen = resolve_device(device.value)
        limit = limit if limit is not None else device_memory_bytes(chosen)
        _, profile = _load_and_profile(model, batch_size, chosen, _parse_sizes(micro_batch_size), repeats)
        with err_console.status(f"planning {gpus} ranks..."):
            planned = plan(profile, gpus=gpus, batch_size=batch_size, memory_limit_bytes=limit)
        ensure_feasible(planned)
        shown = planned[:top]
        if json_output:
            _print_json([p.to_dict() for p in shown])
        else:
            _render_plan(shown, recommended_microbatch_range(planned), limit, gpus, batch_size)


def _load_and_profile(
    model: Path, batch_size: int, device: str, micro_batch_sizes: list[int] | None = None, repeats: int = 5
) -> tuple[Any, Any]:
    """Load and check the model file, then profile it with a progress bar on stderr: (spec, profile)."""
    from autotune.model_file import check_model, load_model_file
    from autotune.profile import profile_model

    spec = load_model_file(model)
    check_model(spec, batch_size)
    with _progress_bar(f"profiling {model.name} on {device}") as progress:
        profile = profile_model(
            spec, batch_size=batch_size, micro_batch_sizes=micro_batch_sizes, device=device, repeats=repeats,
            progress=progress,
        )
    return spec, profile


def _parse_sizes(values: list[str] | None) -> list[int] | None:
    if not values:
        return None
    from autotune.errors import UsageError

    try:
        sizes = [int(part) for value in values for part in value.split(",") if part.strip()]
    except ValueError:
        raise UsageError(f"cannot read --micro-batch-size {','.join(values)!r}; write sizes like 8,32") from None
    if not sizes or min(sizes) < 1:
        raise UsageError(f"--micro-batch-size needs sizes of at least 1, got {','.join(values)!r}")
    return sizes


@contextlib.contextmanager
def _progress_bar(description: str) -> Iterator[Any]:
    """A transient progress bar on stderr, and the callback that advances it."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total}"),
        TimeElapsedColumn(),
        console=err_console,
        transient=True,
    ) as bar:
        task = bar.add_task(description, total=None)

        def advance(completed: int, total: int, what: str) -> None:
            bar.update(task, completed=completed, total=total, description=f"{description}: {what}")

        yield advance


def _render_profile(profile: Any) -> None:
    from rich.table import Table

    from autotune.units import format_bytes

    largest = profile.micro_batch_sizes[-1]
    table = Table(title=f"per layer, micro-batch size {largest} ({profile.device})")
    for column in ("#", "layer", "params", "fwd ms", "in-grad ms", "w-grad ms", "saved", "output"):
        table.add_column(column, justify="left" if column == "layer" else "right")
    for i, layer in enumerate(profile.layers):
        table.add_row(
            str(i),
            layer.name,
            format_bytes(layer.parameter_bytes),
            f"{layer.forward_ms[-1]:.3f}",
            f"{layer.backward_input_ms[-1]:.3f}",
            f"{layer.backward_weight_ms[-1]:.3f}",
            format_bytes(layer.saved_bytes[-1]),
            format_bytes(layer.output_bytes[-1]),
        )
    if profile.loss_forward_ms:
        table.add_row(
            "",
            "loss_fn",
            "",
            f"{profile.loss_forward_ms[-1]:.3f}",
            f"{profile.loss_backward_ms[-1]:.3f}",
            "",
            format_bytes(profile.loss_saved_bytes[-1]),
            "",
        )
    console.print(table)

    sizes = Table(title="whole model per micro-batch (loss included)")
    for column in ("M", "forward ms", "input-grad ms", "weight-grad ms", "ms per sample", "saved"):
        sizes.add_column(column, justify="right")
    for m in profile.micro_batch_sizes:
        costs = profile.layer_costs(m)
        forward = sum(c.forward_ms for c in costs)
        backward_input = sum(c.backward_input_ms for c in costs)
        backward_weight = sum(c.backward_weight_ms for c in costs)
        sizes.add_row(
            str(m),
            f"{forward:.3f}",
            f"{backward_input:.3f}",
            f"{backward_weight:.3f}",
            f"{(forward + backward_input + backward_weight) / m:.4f}",
            format_bytes(sum(c.saved_bytes for c in costs)),
        )
    console.print(sizes)
    console.print(
        f"parameters {format_bytes(profile.parameter_bytes)}, optimizer step {profile.optimizer_step_ms:.3f} ms, "
        f"optimizer state {format_bytes(profile.optimizer_state_bytes)}",
        highlight=False,
    )


def _render_plan(
    planned: list[Any], recommended: tuple[int, int], limit: int | None, gpus: int, batch_size: int
) -> None:
    from rich import box
    from rich.table import Table

    from autotune.units import format_bytes

    title = f"plan: {gpus} ranks, batch {batch_size}" + (f", limit {format_bytes(limit)}/rank" if limit else "")
    table = Table(title=title, box=box.SIMPLE_HEAD, collapse_padding=True, pad_edge=False)  # ten columns in 80
    columns = ("#", "pp×dp", "schedule", "B/M", "M", "split", "step ms", "samples/s", "bubble", "peak mem")
    for column in columns:
        text = column in ("schedule", "split")  # these wrap; numbers stay whole on a narrow terminal
        table.add_column(
            column,
            justify="left" if text else "right",
            no_wrap=not text,
            overflow="fold",
            min_width={"schedule": 11, "split": 5}.get(column),
        )
    for i, p in enumerate(planned, start=1):
        c, e = p.candidate, p.estimate
        peak = format_bytes(max(e.peak_memory_bytes))  # the fullest rank; the limit is in the title
        table.add_row(
            str(i),
            f"{c.pipeline_degree}×{c.data_parallel_degree}",
            c.schedule.value + (" +ckpt" if c.activation_checkpointing else ""),
            str(c.n_microbatches),
            str(c.micro_batch_size),
            ",".join(map(str, c.layers_per_stage)),
            f"{e.step_time_ms:.1f}",
            f"{e.throughput_samples_per_s:.1f}",
            f"{e.bubble_fraction:.0%}",
            peak if e.feasible else f"[red]{peak}[/red]",
        )
    console.print(table)
    lo, hi = recommended
    span = f"{lo}" if lo == hi else f"{lo} to {hi}"
    console.print(
        f"recommended B/M: {span} per replica (within 5% of the best predicted throughput). Predictions come from a "
        f"one-device profile; measure with `autotune trial` or `autotune search`.",
        highlight=False,
    )


@app.command(epilog=EXIT_CODES_HELP)
def search(
    model: ModelArg,
    gpus: GpusOpt,
    batch_size: BatchOpt,
    trials: Annotated[
        int, typer.Option("--trials", "-n", min=2, help="Real trial runs to spend (leader re-runs included).")
    ] = 20,
    timeout: Annotated[str | None, typer.Option(help="Stop launching trials after this long, e.g. 20m.")] = None,
    memory_limit: MemoryOpt = None,
    storage: Annotated[
        str | None,
        typer.Option(help="Optuna storage URL (sqlite:///x.db, postgresql://...). Default: .autotune/<study>.db"),
    ] = None,
    study_name: Annotated[str | None, typer.Option(help="Default: <model>-<device>-g<gpus>-b<batch>.")] = None,
    resume: Annotated[
        bool, typer.Option("--resume", help="Continue an interrupted study; finished trials are kept.")
    ] = False,
    output: Annotated[Path, typer.Option("--output", "-o", help="Where to write the tuned config.")] = Path(
        "autotune.yaml"
    ),
    report_dir: Annotated[Path, typer.Option(help="Where to write the report.")] = Path("autotune-report"),
    min_improvement: Annotated[
        float,
        typer.Option(
            help="Keep an existing --output config unless the new best beats it by more than this (0.03 = 3 %)."
        ),
    ] = 0.03,
    seed: Annotated[int, typer.Option(help="Sampler seed.")] = 0,
    steps: Annotated[int, typer.Option(min=1, help="Measured steps per trial.")] = 5,
    warmup: Annotated[int, typer.Option(min=1, help="Unmeasured steps per trial.")] = 2,
    trial_timeout: Annotated[float, typer.Option(min=1, help="Seconds before one trial counts as hung.")] = 300.0,
    device: DeviceOpt = DeviceChoice.auto,
    json_output: JsonOpt = False,
) -> None:
    """Find the fastest pipeline configuration by real trial runs: B/M, layer split, schedule, pp x dp, activation
    checkpointing and the dtype between stages, under the memory limit. Writes the tuned config and a report.

    How: profile the layers, simulate every schedule x B/M x balanced split, try the planner's best first (and the
    rule-of-thumb default, for comparison), then let Optuna's TPE sampler propose more. A candidate the simulator
    says cannot fit, or cannot come within 20 % of the best measured one, is recorded as pruned and not launched.
    Failed trials (oom, error, timeout) are recorded with their reason. At the end the top 3 are re-run side by side
    and the best median wins, so a lucky run on a noisy machine does not decide.

    Ctrl-C stops the running trial, writes the best config so far and exits 130; `--resume` continues the study.

    Example: `autotune search recipes/mlp.py --gpus 2 --device cpu --batch-size 256 --trials 12`
    """
    with _errors_to_exit_codes(json_output):
        _start_fork_server()
        _search(**locals())


def _search(
    *,
    model: Path,
    gpus: int,
    batch_size: int,
    trials: int,
    timeout: str | None,
    memory_limit: str | None,
    storage: str | None,
    study_name: str | None,
    resume: bool,
    output: Path,
    report_dir: Path,
    min_improvement: float,
    seed: int,
    steps: int,
    warmup: int,
    trial_timeout: float,
    device: DeviceChoice,
    json_output: bool,
) -> None:
    from autotune.devices import device_memory_bytes, resolve_device
    from autotune.plan import ensure_feasible, plan
    from autotune.search import SearchOptions, default_storage, default_study_name, explain_infeasible, run_search
    from autotune.trial import TrialOptions
    from autotune.units import parse_duration, parse_size

    chosen = resolve_device(device.value)
    limit = parse_size(memory_limit) if memory_limit else device_memory_bytes(chosen)
    timeout_s = parse_duration(timeout) if timeout else None
    spec, profile = _load_and_profile(model, batch_size, chosen)
    name = study_name or default_study_name(model, gpus, batch_size, chosen)
    url = storage or default_storage(name)
    incumbent = _incumbent(output, spec, gpus, batch_size)
    with err_console.status(f"planning {gpus} ranks..."):
        planned = plan(profile, gpus=gpus, batch_size=batch_size, memory_limit_bytes=limit)
    ensure_feasible(planned)
    options = SearchOptions(
        gpus=gpus,
        batch_size=batch_size,
        n_trials=trials,
        timeout_s=timeout_s,
        memory_limit_bytes=limit,
        study_name=name,
        storage=url,
        resume=resume,
        seed=seed,
        incumbent=incumbent.candidate if incumbent else None,
        trial=TrialOptions(
            steps=steps, warmup=warmup, timeout_s=trial_timeout, memory_limit_bytes=limit, device=chosen
        ),
    )
    with _SearchProgress(trials) as reporter:
        result = run_search(spec, profile, planned, options, study_name=name, storage=url, reporter=reporter)
    if result.best is None:
        if result.interrupted:
            raise KeyboardInterrupt
        if any(r.outcome in ("oom", "pruned") for r in result.records) and limit is not None:
            raise explain_infeasible(result, limit)
        from autotune.errors import AutotuneError

        raise AutotuneError("no trial ran successfully; run `autotune report` on the study to see each reason")
    kept, written = _write_config(result, spec, model, output, limit, incumbent, min_improvement, chosen)
    from autotune.report import write_search_report

    report_path = write_search_report(
        result, spec=spec, profile=profile, config_path=output, report_dir=report_dir, memory_limit_bytes=limit
    )
    summary = _search_summary(result, output, kept, written, report_path)
    if json_output:
        _print_json(summary)
    else:
        _render_search(result, summary)
    if result.interrupted:
        raise typer.Exit(EXIT_INTERRUPTED)


def _incumbent(output: Path, spec: Any, gpus: int, batch_size: int) -> Any:
    """The config already at --output, when it is for this model, GPU count and batch size."""
    if not output.exists():
        return None
    from autotune.errors import ConfigError
    from autotune.tuned_config import load_config

    try:
        config = load_config(output)
    except ConfigError as exc:
        err_console.print(f"[yellow]warning:[/yellow] ignoring the existing {output}: {exc}", highlight=False)
        return None
    if (config.model_layers, config.gpus, config.global_batch_size) != (spec.n_layers, gpus, batch_size):
        err_console.print(
            f"[yellow]warning:[/yellow] {output} is for another model, GPU count or batch size; it will be replaced",
            highlight=False,
        )
        return None
    return config


def _write_config(
    result: Any,
    spec: Any,
    model: Path,
    output: Path,
    limit: int | None,
    incumbent: Any,
    min_improvement: float,
    device: str,
) -> tuple[bool, bool]:
    """Write the best config unless the existing one holds within min_improvement. Returns (kept_old, wrote_new)."""
    from autotune.tuned_config import (
        Environment,
        PredictedResult,
        SearchSummary,
        TunedConfig,
        mask_password,
        save_config,
    )

    best = result.best
    if incumbent is not None:
        old = next((leader for leader in result.leaders if leader.candidate.key == incumbent.candidate.key), None)
        new_ms = best.step_time_ms
        if old is not None and (
            old.candidate.key == best.candidate.key or old.step_time_ms <= new_ms * (1 + min_improvement)
        ):
            return True, False
    estimate = result.best_estimate
    config = TunedConfig.from_measurement(
        best,
        model=str(model),
        memory_limit_bytes=limit,
        model_layers=spec.n_layers,
        predicted=PredictedResult(
            step_time_ms=estimate.step_time_ms, peak_memory_bytes=tuple(estimate.peak_memory_bytes)
        )
        if estimate
        else None,
        search=SearchSummary(
            study=result.study_name,
            storage=mask_password(result.storage),
            trials=len(result.records),
            feasible=result.feasible,
            best_trial=result.best_trial,
        ),
        environment=Environment.current(device),
    )
    save_config(config, output, command="autotune " + " ".join(sys.argv[1:]))
    return False, True


def _search_summary(result: Any, output: Path, kept: bool, written: bool, report: Path) -> dict[str, Any]:
    best = result.best
    return {
        "status": "interrupted" if result.interrupted else "ok",
        "config": str(output),
        "config_written": written,
        "kept_existing_config": kept,
        "report": str(report / "report.md"),
        "study": result.study_name,
        "storage": result.storage,
        "best": best.to_dict(),
        "best_trial": result.best_trial,
        "trials": len(result.records),
        "launched": result.launched,
        "feasible": result.feasible,
        "pruned": sum(1 for r in result.records if r.outcome == "pruned"),
        "wall_time_s": result.wall_time_s,
        "too_noisy_to_separate_leaders": result.too_noisy,
        "leaders": [
            {"candidate": leader.candidate.key, "step_time_ms": leader.step_time_ms, "runs": list(leader.step_times_ms)}
            for leader in result.leaders[:5]
        ],
    }


def _render_search(result: Any, summary: dict[str, Any]) -> None:
    from rich.table import Table

    table = Table(title="fastest configurations (median over every run)")
    for column in ("#", "candidate", "step ms", "samples/s", "runs"):
        table.add_column(column, justify="right" if column != "candidate" else "left")
    for i, leader in enumerate(result.leaders[:5], start=1):
        table.add_row(
            str(i),
            leader.candidate.key,
            f"{leader.step_time_ms:.1f}",
            f"{leader.candidate.global_batch_size / leader.step_time_ms * 1000:.0f}",
            str(len(leader.step_times_ms)),
        )
    console.print(table)
    if summary["kept_existing_config"]:
        console.print(f"kept the existing {summary['config']}: the new best does not beat it by the required margin")
    else:
        console.print(f"wrote {summary['config']} and {summary['report']}")
    console.print(
        f"{summary['trials']} trials ({summary['launched']} launched, {summary['pruned']} pruned, "
        f"{summary['feasible']} ok) in {summary['wall_time_s']:.0f} s; study {summary['study']} in {summary['storage']}"
    )
    if result.too_noisy:
        console.print("[yellow]the two fastest are within measurement noise: either is a sound choice[/yellow]")


class _SearchProgress:
    """Live progress on stderr: trials run of the budget, each trial's result, the best so far, time left."""

    def __init__(self, budget: int) -> None:
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        self.progress = Progress(
            TextColumn("[bold]trials"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("left"),
            TimeRemainingColumn(),
            TextColumn("{task.description}"),
            console=err_console,
            transient=False,
        )
        self.task = self.progress.add_task("", total=budget)

    def __enter__(self) -> _SearchProgress:
        self.progress.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.progress.__exit__(*exc)

    def phase(self, text: str) -> None:
        self.progress.console.print(f"[dim]{text}[/dim]", highlight=False)

    def trial(self, record: Any, best: Any, launched: int, budget: int) -> None:
        colour = {"ok": "green", "pruned": "dim", "oom": "yellow"}.get(record.outcome, "red")
        key = record.candidate.key if record.candidate else "(invalid)"
        if record.outcome == "ok":
            what = f"{record.throughput_samples_per_s:.0f} samples/s"
        else:
            what = record.reason[:120]
        self.progress.console.print(
            f"#{record.number:<3} [{colour}]{record.outcome:<8}[/{colour}] {key}  {what}", highlight=False
        )
        best_text = f"best {best.throughput_samples_per_s:.0f} samples/s ({best.candidate.key})" if best else ""
        self.progress.update(self.task, completed=launched, description=best_text)


@app.command(
    epilog="Exit codes: 0 still fits and within tolerance, 1 regressed (or the trial failed), 2 the config "
    "does not match the model (or cannot be read), 3 no longer fits the memory limit, 4 cannot launch."
)
def check(
    config: Annotated[Path, typer.Argument(help="A tuned config written by autotune search.")],
    model: Annotated[Path | None, typer.Option(help="The model file. Default: the config's model path.")] = None,
    tolerance: Annotated[float, typer.Option(min=0, max=1, help="Allowed slowdown vs the recorded throughput.")] = 0.05,
    repeats: Annotated[int, typer.Option(min=1, help="Runs at most, before a slowdown counts as a regression.")] = 3,
    memory_limit: Annotated[
        str | None, typer.Option("--memory-limit", help="Override the config's memory limit, e.g. 40GiB.")
    ] = None,
    steps: Annotated[int, typer.Option(min=1, help="Measured steps per run.")] = 5,
    warmup: Annotated[int, typer.Option(min=1, help="Unmeasured steps per run.")] = 2,
    device: DeviceOpt = DeviceChoice.auto,
    json_output: JsonOpt = False,
) -> None:
    """Re-run a tuned config's trial, for CI: does it still match the model, fit the memory limit, and run within
    `--tolerance` of the recorded throughput? A slow run is repeated (up to `--repeats`) and the median decides.

    Example: `autotune check autotune.yaml --device cpu --json`
    """
    with _errors_to_exit_codes(json_output):
        _start_fork_server()
        from autotune.check import check_config, resolve_model
        from autotune.devices import resolve_device
        from autotune.trial import TrialOptions
        from autotune.tuned_config import load_config
        from autotune.units import format_bytes, parse_size

        tuned = load_config(config)
        spec = resolve_model(tuned, config, model)
        limit = parse_size(memory_limit) if memory_limit else tuned.memory_limit_bytes
        options = TrialOptions(
            steps=steps, warmup=warmup, memory_limit_bytes=limit, device=resolve_device(device.value)
        )
        with err_console.status(f"checking {tuned.candidate.key} (limit {format_bytes(limit)})..."):
            result = check_config(tuned, spec, tolerance=tolerance, repeats=repeats, options=options)
        if json_output:
            _print_json(result.to_dict())
        else:
            colour = "green" if result.status == "ok" else "red"
            console.print(f"[{colour}]{result.status}[/{colour}]: {result.message}", highlight=False)
        codes = {"ok": 0, "regressed": EXIT_INTERNAL, "failed": EXIT_INTERNAL, "oom": EXIT_INFEASIBLE}
        if codes[result.status]:
            raise typer.Exit(codes[result.status])


@app.command(
    "report",
    epilog="Exit codes: 0 written, 1 internal error, 2 no such config or study, a masked password in the config's "
    "storage URL (pass --storage), or the report folder cannot be written.",
)
def report_command(
    config: Annotated[
        Path | None,
        typer.Argument(
            help="A tuned config written by `autotune search`; its search.storage and search.study name the study."
        ),
    ] = None,
    storage: Annotated[
        str | None,
        typer.Option(help="Optuna storage URL of the study; overrides the config's (whose password is masked)."),
    ] = None,
    study_name: Annotated[str | None, typer.Option(help="The study's name; overrides the config's.")] = None,
    report_dir: Annotated[Path, typer.Option(help="Where to write report.md, figures/ and report.html.")] = Path(
        "autotune-report"
    ),
) -> None:
    """Rebuild the report of a search from its study: report.md with figures/*.png beside it, and one self-contained
    report.html (figures inlined, opens offline). It says which config was chosen, by how much it beats the
    rule-of-thumb default and why, with every trial, the warnings that apply and the exports.

    Example: `autotune report autotune.yaml --report-dir autotune-report` or
    `autotune report --storage sqlite:///.autotune/mlp-cpu-g2-b256.db --study-name mlp-cpu-g2-b256`
    """
    with _errors_to_exit_codes():
        from autotune.errors import AutotuneError
        from autotune.model_file import load_model_file
        from autotune.report import write_search_report
        from autotune.report.source import load_study, locate_study

        source = locate_study(config, storage, study_name)
        result, profile, setup = load_study(source)
        spec = None
        model = Path(str(setup.get("model") or profile.model or ""))
        if model.name and model.is_file():
            try:
                spec = load_model_file(model)
            except AutotuneError as exc:
                err_console.print(f"[yellow]warning:[/yellow] no BatchNorm check: {exc}", highlight=False)
        with err_console.status(f"writing the report of study {source.study_name}..."):
            written = write_search_report(
                result,
                spec=spec,
                profile=profile,
                config_path=source.config_path,
                report_dir=report_dir,
                memory_limit_bytes=setup.get("memory_limit_bytes"),
                setup=setup,
            )
    console.print(
        f"wrote {written / 'report.md'} (figures in {written / 'figures'}) and {written / 'report.html'}",
        highlight=False,
        soft_wrap=True,
    )


def main() -> None:
    """Console entry point. Once a command is done, the interpreter's teardown is skipped (with torch loaded it costs
    ~0.7 s): output is flushed first, files are already written atomically and the study committed, and the fork
    server and any rank exit on their own when this process does."""
    try:
        app()
        code = 0
    except SystemExit as exc:
        if isinstance(exc.code, str):
            sys.stderr.write(exc.code + "\n")
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
