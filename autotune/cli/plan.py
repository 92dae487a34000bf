"""`autotune profile` and `autotune plan`: the per-layer costs, and the candidates ranked by simulation."""

from __future__ import annotations

from typing import Annotated, Any

import typer

from autotune.cli.app import EXIT_CODES_HELP, app, console, err_console, errors_to_exit_codes, print_json
from autotune.cli.options import (
    BatchOpt,
    DeviceChoice,
    DeviceOpt,
    GpusOpt,
    JsonOpt,
    MemoryOpt,
    MicroBatchOpt,
    ModelArg,
    RepeatsOpt,
    SplitAtOpt,
    parse_sizes,
    parse_split_at,
)
from autotune.cli.progress import TerminalReporter


@app.command("profile", epilog=EXIT_CODES_HELP)
def profile_command(
    model: ModelArg,
    batch_size: BatchOpt,
    micro_batch_size: MicroBatchOpt = None,
    repeats: RepeatsOpt = 5,
    device: DeviceOpt = DeviceChoice.auto,
    split_at: SplitAtOpt = None,
    json_output: JsonOpt = False,
) -> None:
    """Measure every layer in place at several micro-batch sizes: forward, input-grad and weight-grad backward time,
    saved-activation, output and parameter bytes (one thread on CPU, like one rank).

    Example: `autotune profile recipes/mlp.py --batch-size 64 --device cpu`
    """
    with errors_to_exit_codes(json_output):
        from autotune.devices import resolve_device
        from autotune.tune import load_and_profile

        chosen = resolve_device(device.value)
        _, result = load_and_profile(
            model, batch_size, chosen, micro_batch_sizes=parse_sizes(micro_batch_size), repeats=repeats,
            reporter=TerminalReporter(), split_at=parse_split_at(split_at),
        )
        if json_output:
            print_json(result.to_dict())
        else:
            render_profile(result)


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
    split_at: SplitAtOpt = None,
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
    with errors_to_exit_codes(json_output):
        from autotune.devices import device_memory_bytes, resolve_device
        from autotune.plan import ensure_feasible, plan, recommended_microbatch_range
        from autotune.tune import load_and_profile
        from autotune.units import parse_size

        limit = parse_size(memory_limit) if memory_limit else None
        chosen = resolve_device(device.value)
        limit = limit if limit is not None else device_memory_bytes(chosen)
        _, profile = load_and_profile(
            model, batch_size, chosen, micro_batch_sizes=parse_sizes(micro_batch_size), repeats=repeats,
            reporter=TerminalReporter(), split_at=parse_split_at(split_at), gpus=gpus,
        )
        with err_console.status(f"planning {gpus} ranks..."):
            planned = plan(profile, gpus=gpus, batch_size=batch_size, memory_limit_bytes=limit)
        ensure_feasible(planned)
        shown = planned[:top]
        if json_output:
            print_json([p.to_dict() for p in shown])
        else:
            render_plan(shown, recommended_microbatch_range(planned), limit, gpus, batch_size)


def render_profile(profile: Any) -> None:
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


def render_plan(
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

