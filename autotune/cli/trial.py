"""`autotune trial`: run one configuration for real and show what it measured."""

from __future__ import annotations

from enum import Enum
from typing import Annotated, Any

import typer

from autotune.cli.app import (
    EXIT_CODES_HELP,
    app,
    console,
    debugging,
    err_console,
    errors_to_exit_codes,
    print_json,
    start_fork_server,
)
from autotune.cli.options import (
    AllowAsyncOpt,
    BatchOpt,
    DeviceChoice,
    DeviceOpt,
    GpusOpt,
    JsonOpt,
    MemoryOpt,
    ModelArg,
    PrecisionOpt,
    RunTimeoutOpt,
    SplitAtOpt,
    StepsOpt,
    WarmupOpt,
    WireDtypeChoice,
    parse_seconds,
    parse_split,
    parse_split_at,
)
from autotune.errors import STATUS_EXIT_CODES


class DataParallelChoice(str, Enum):
    """--data-parallel choices of one trial: the candidate's DataParallelMode values."""

    replicate = "replicate"
    shard = "shard"


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
            "or VMin (case-insensitive); 2BW with --allow-async.",
        ),
    ],
    layers_per_stage: Annotated[
        str | None,
        typer.Option(help="Layer count per stage, comma-separated, e.g. 3,5. Default: uniform."),
    ] = None,
    dp: Annotated[
        int, typer.Option("--dp", min=1, help="Data-parallel replicas; pipeline degree = gpus / (dp x tp).")
    ] = 1,
    tensor_parallel: Annotated[
        int,
        typer.Option(
            "--tensor-parallel",
            "--tp",
            min=1,
            help="Tensor-parallel degree: each stage's layers split over this many consecutive ranks with the model's "
            "own plan (a Hugging Face model's, or TP_PLAN / tp_plan(model) in the model file).",
        ),
    ] = 1,
    activation_checkpointing: Annotated[
        bool,
        typer.Option("--activation-checkpointing", help="Recompute each stage's forward in its backward."),
    ] = False,
    wire_dtype: Annotated[
        WireDtypeChoice,
        typer.Option(
            "--wire-dtype",
            help="dtype of activations and gradients sent between stages (fp32 precision; bf16 sends bfloat16). "
            "bfloat16 also measures the gradients' relative error against a float32 wire on the first "
            "micro-batches, through the same stages (not when sharded).",
        ),
    ] = WireDtypeChoice.float32,
    precision: PrecisionOpt = None,
    data_parallel: Annotated[
        DataParallelChoice,
        typer.Option(
            "--data-parallel",
            help="How the --dp replicas hold their stages: replicate (each holds them whole: DDP) or shard (FSDP2: "
            "parameters, gradients and optimizer state split over the replicas; needs --dp 2 or more).",
        ),
    ] = DataParallelChoice.replicate,
    reshard_after_forward: Annotated[
        bool,
        typer.Option(
            "--reshard-after-forward/--no-reshard-after-forward",
            help="With --data-parallel shard: free each stage's gathered parameters after every micro-batch's "
            "forward and gather them again (less memory, an all-gather per micro-batch); default: keep them "
            "gathered for the step.",
        ),
    ] = False,
    allow_async: AllowAsyncOpt = False,
    steps: StepsOpt = 5,
    warmup: WarmupOpt = 2,
    timeout: RunTimeoutOpt = "300",
    memory_limit: MemoryOpt = None,
    device: DeviceOpt = DeviceChoice.auto,
    split_at: SplitAtOpt = None,
    json_output: JsonOpt = False,
) -> None:
    """Run ONE configuration for real: N rank processes, torch's pipeline schedule, a few optimizer steps.

    Reports the median step time, throughput and each rank's peak memory. A run that fails is still a result:
    status `oom`, `timeout` or `error`, with the rank that caused it (exit 3 for oom, 1 for error or timeout).
    2BW (with --allow-async) runs the measured steps as one pipeline, filled and drained once: the step time is the
    whole run's time over the steps.

    Example: `autotune trial recipes/mlp.py --gpus 2 --device cpu --batch-size 32 --microbatches 4 --schedule 1F1B`
    """
    with errors_to_exit_codes(json_output):
        timeout_s = parse_seconds(timeout, "--timeout")
        start_fork_server()
        from autotune.candidate import Candidate, uniform_split
        from autotune.devices import cpu_oversubscription, default_precision, resolve_device
        from autotune.errors import UsageError
        from autotune.model_file import check_model, load_model_file
        from autotune.schedules import (
            SCHEDULES,
            TIED_ASYNC,
            check_async_allowed,
            default_stages_per_rank,
            parse_schedule,
        )
        from autotune.trial import TrialOptions, run_trial
        from autotune.units import parse_size
        from autotune.watchdog import MODEL_CHECK, time_limit

        chosen = parse_schedule(schedule)
        check_async_allowed([chosen], allow_async)
        if gpus % (dp * tensor_parallel):
            what = f"--dp {dp} x --tensor-parallel {tensor_parallel}" if tensor_parallel > 1 else f"--dp {dp}"
            raise UsageError(f"--gpus {gpus} is not a multiple of {what}; pass degrees whose product divides {gpus}")
        if data_parallel is DataParallelChoice.shard and dp == 1:
            raise UsageError("--data-parallel shard needs --dp 2 or more (one replica has nothing to shard over); "
                             "pass --dp, or --data-parallel replicate")
        if reshard_after_forward and data_parallel is not DataParallelChoice.shard:
            raise UsageError("--reshard-after-forward applies to --data-parallel shard only; add --data-parallel "
                             "shard or leave it off")
        with time_limit(timeout_s, path=model, what=MODEL_CHECK):
            spec = load_model_file(model, split_at=parse_split_at(split_at))
            check_model(spec, batch_size)
        if SCHEDULES[chosen].asynchronous and spec.shared:
            raise UsageError(f"{model}: {TIED_ASYNC}")
        if tensor_parallel > 1:
            from autotune.models import plan_for_degree

            plan_for_degree(spec, tensor_parallel)  # no plan, or a degree it cannot take: one line, before launch
        if spec.has_batchnorm and microbatches > 1:
            from autotune.tune import batchnorm_warning

            err_console.print(f"[yellow]warning:[/yellow] {batchnorm_warning(spec)}", highlight=False)
        pp = gpus // (dp * tensor_parallel)
        split = parse_split(layers_per_stage) or uniform_split(spec.n_layers, pp * default_stages_per_rank(chosen))
        device_choice = resolve_device(device.value)
        candidate = Candidate(
            schedule=chosen,
            pipeline_degree=pp,
            data_parallel_degree=dp,
            global_batch_size=batch_size,
            n_microbatches=microbatches,
            layers_per_stage=split,
            activation_checkpointing=activation_checkpointing,
            wire_dtype=wire_dtype.value,
            precision=precision.value if precision else default_precision(device_choice, spec.precision),
            data_parallel_mode=data_parallel.value,
            reshard_after_forward=reshard_after_forward,
            tensor_parallel_degree=tensor_parallel,
        )
        candidate.validate(spec.n_layers)
        options = TrialOptions(
            steps=steps,
            warmup=warmup,
            timeout_s=timeout_s,
            memory_limit_bytes=parse_size(memory_limit) if memory_limit else None,
            device=device_choice,
            keep_run_dir=debugging(),
            measure_wire_error=wire_dtype is WireDtypeChoice.bfloat16,
        )
        oversubscribed = cpu_oversubscription(gpus, options.device)
        if oversubscribed:
            err_console.print(f"[yellow]warning:[/yellow] {oversubscribed}", highlight=False, soft_wrap=True)
        with err_console.status(f"running {candidate.key} on {gpus} {options.device} rank(s)..."):
            measurement = run_trial(spec, candidate, options)
        if json_output:
            print_json(measurement.to_dict())
        else:
            render_measurement(measurement)
        if STATUS_EXIT_CODES[measurement.status]:
            raise typer.Exit(STATUS_EXIT_CODES[measurement.status])


def render_measurement(m: Any) -> None:
    from rich.table import Table

    from autotune.schedules import SCHEDULES
    from autotune.units import format_bytes

    c = m.candidate
    table = Table(title=f"trial {c.key}", show_header=False)
    table.add_row("status", f"[green]{m.status}[/green]" if m.status == "ok" else f"[red]{m.status}[/red]")
    table.add_row("schedule", c.schedule.value)
    if SCHEDULES[c.schedule].asynchronous:
        table.add_row("updates", "asynchronous: each uses the gradient of the weights one step older")
    table.add_row("pp x dp x tp", f"{c.pipeline_degree} x {c.data_parallel_degree} x {c.tensor_parallel_degree}")
    table.add_row("micro-batches (B/M)", f"{c.n_microbatches} of {c.micro_batch_size} samples")
    table.add_row("layers per stage", ", ".join(map(str, c.layers_per_stage)))
    table.add_row("activation checkpointing", "yes" if c.activation_checkpointing else "no")
    table.add_row("precision", "bf16 (float32 master weights)" if c.precision == "bf16" else "fp32")
    if c.data_parallel_degree > 1:
        mode = "shard (FSDP2)" if c.sharded else "replicate"
        table.add_row("data parallel", mode + (", reshard after forward" if c.reshard_after_forward else ""))
    table.add_row("between stages", "bfloat16" if c.precision == "bf16" else c.wire_dtype)
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
