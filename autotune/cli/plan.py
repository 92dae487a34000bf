"""`autotune profile` and `autotune plan`: the per-layer costs, and the candidates ranked by simulation."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from autotune.cli.app import EXIT_CODES_HELP, app, console, err_console, errors_to_exit_codes, print_json
from autotune.cli.options import (
    AllowAsyncOpt,
    BatchOpt,
    DataParallelOpt,
    DeviceChoice,
    DeviceOpt,
    EveryBlockOpt,
    JsonOpt,
    MemoryOpt,
    MicroBatchOpt,
    ModelArg,
    PrecisionOpt,
    RepeatsOpt,
    SplitAtOpt,
    TensorParallelOpt,
    parse_data_parallel,
    parse_degrees,
    parse_sizes,
    parse_split_at,
)
from autotune.cli.progress import TerminalReporter
from autotune.errors import UsageError


@app.command("profile", epilog=EXIT_CODES_HELP)
def profile_command(
    model: ModelArg,
    batch_size: BatchOpt,
    micro_batch_size: MicroBatchOpt = None,
    repeats: RepeatsOpt = 5,
    device: DeviceOpt = DeviceChoice.auto,
    split_at: SplitAtOpt = None,
    memory_limit: MemoryOpt = None,
    every_block: EveryBlockOpt = False,
    precision: PrecisionOpt = None,
    json_output: JsonOpt = False,
    output: Annotated[
        Path | None,
        typer.Option("--output", "-o", help="Also save the profile as JSON here, for `autotune plan --profile`."),
    ] = None,
) -> None:
    """Measure every block at several micro-batch sizes: forward, input-grad and weight-grad backward time,
    saved-activation, output and parameter bytes (one thread on CPU, like one rank). Blocks are made real a few at
    a time (up to 64 MiB of parameters; one at a time when larger), each as its own stage, and timed in place in one
    pass through them: the model never needs to fit there. Of blocks that are the same, four in a row are measured
    and the rest take their figures (`--profile-every-block` measures all). A micro-batch size that runs out of
    memory (`--memory-limit` binds the profiler as it binds trials) is left out and said so. `--precision bf16`
    measures each block under torch.autocast(bfloat16): bf16's times and activation bytes.

    `--output profile.json` saves it, so `autotune plan --profile profile.json --nodes N --gpus-per-node G` can plan
    a cluster run anywhere, without the model or its hardware.

    Example: `autotune profile recipes/mlp.py --batch-size 64 --device cpu --output profile.json`
    """
    with errors_to_exit_codes(json_output):
        from autotune.devices import resolve_device
        from autotune.tune import load_and_profile
        from autotune.units import parse_size

        chosen = resolve_device(device.value)
        _, result = load_and_profile(
            model, batch_size, chosen, micro_batch_sizes=parse_sizes(micro_batch_size), repeats=repeats,
            reporter=TerminalReporter(), split_at=parse_split_at(split_at), every_block=every_block,
            memory_limit_bytes=parse_size(memory_limit) if memory_limit else None,
            precision=precision.value if precision else None,
        )
        if output is not None:
            from autotune.files import atomic_write_json

            atomic_write_json(output, result.to_dict())
        if json_output:
            print_json(result.to_dict())
        else:
            render_profile(result)
            if output is not None:
                console.print(f"profile saved to {output}", highlight=False)


@app.command("plan", epilog=EXIT_CODES_HELP)
def plan_command(
    model: Annotated[Path | None, typer.Argument(help="Your model file (not needed with --profile).")] = None,
    gpus: Annotated[
        int | None,
        typer.Option("--gpus", "-g", min=1, help="Ranks to plan for. Default with --nodes: nodes x gpus-per-node."),
    ] = None,
    batch_size: Annotated[
        int | None, typer.Option("--batch-size", "-b", min=1, help="Global batch size B per optimizer step.")
    ] = None,
    memory_limit: MemoryOpt = None,
    top: Annotated[int, typer.Option("--top", "-k", min=1, help="Candidates to show.")] = 10,
    micro_batch_size: MicroBatchOpt = None,
    repeats: RepeatsOpt = 5,
    device: DeviceOpt = DeviceChoice.auto,
    split_at: SplitAtOpt = None,
    every_block: EveryBlockOpt = False,
    precision: PrecisionOpt = None,
    data_parallel: DataParallelOpt = "replicate,shard",
    tensor_parallel: TensorParallelOpt = None,
    allow_async: AllowAsyncOpt = False,
    json_output: JsonOpt = False,
    profile_path: Annotated[
        Path | None,
        typer.Option("--profile", help="Plan from a profile saved by `autotune profile --output` (nothing runs)."),
    ] = None,
    nodes: Annotated[int | None, typer.Option("--nodes", min=1, help="Nodes the ranks span.")] = None,
    gpus_per_node: Annotated[
        int | None, typer.Option("--gpus-per-node", min=1, help="Ranks per node (with --nodes, or alone).")
    ] = None,
    inter_node_bandwidth: Annotated[
        float | None,
        typer.Option("--inter-node-bandwidth", min=0.001, help="GB/s per rank between nodes. Default: 25 (cuda), "
                     "1.25 (cpu); an assumption, said in the output."),
    ] = None,
    inter_node_latency: Annotated[
        float | None,
        typer.Option("--inter-node-latency", min=0.0, help="Microseconds per message between nodes. Default: 10 "
                     "(cuda), 100 (cpu)."),
    ] = None,
) -> None:
    """Profile the model, then simulate schedules x micro-batch counts (B/M) x balanced layer splits over N ranks
    and rank them by predicted throughput, with the B/M range worth trying. Nothing runs on N ranks: use
    `autotune trial` or `autotune search` to measure.

    Layouts: every pp x dp = N that the model and batch allow, pp = 1 (plain data parallelism) included; B/M and M
    are per replica. Activation checkpointing is ranked beside the rest: the fastest candidates also appear with it.
    Replicas (dp > 1) either replicate their stages or shard them with FSDP2, keeping each stage gathered for the
    step (`shard`) or resharding after every forward (`shard/rs`, planned where keeping them does not fit: it only
    saves memory): pp 1 x shard is pure FSDP, so the ranking answers "pipeline or FSDP?" (`--data-parallel
    replicate` leaves shard out). Candidates train in the profile's precision
    (`--precision`; with `--profile`, the profile's, and another is refused). Tensor parallelism (`pp×dp×tp`, each
    stage split over tp consecutive ranks of a node with the model's own plan) is planned for every degree the
    model's plan allows (`--tensor-parallel` narrows it); with `--profile`, only the degrees `--tensor-parallel`
    names (the profile does not know the model's heads): its compute is divided over tp (90 % efficient assumed on
    cuda), the collectives its plan runs per block (all-reduces of the activations; the profile records how many)
    added on the intra-node link, parameters and the sharded activations divided. `--allow-async` ranks the
    asynchronous 2BW beside them (replicated dp, tp 1): its steady-state step, without the fill and drain a
    synchronous schedule pays every step, and two copies of each stage's weights.

    `--json` prints a list of candidates: the config fields (pipeline_degree, data_parallel_degree, ...) plus
    precision, data_parallel_mode, fsdp_reshard_after_forward, predicted_step_time_ms,
    predicted_throughput_samples_per_s, predicted_peak_memory_bytes (one per pipeline rank; every replica holds the
    same), feasible, and ranked_throughput_samples_per_s: the speed it is ranked by. A more
    even split predicted within 3 % of its configuration's fastest is ranked at that speed and says so in
    ranked_as (a `*` in the table), so it may stand above a slightly faster candidate.

    Several nodes (`--nodes N --gpus-per-node G`): sends between stages on different nodes and all-reduces over
    nodes take the inter-node link (`--inter-node-bandwidth`, `--inter-node-latency`), and layouts with a pipeline
    and replicas over several nodes are ranked in both rank orders: pp-inner (each pipeline inside a node) and
    dp-inner (each stage's replicas inside a node). `autotune search` on a cluster measures the link instead.

    Example: `autotune plan recipes/gpt.py --gpus 4 --batch-size 64 --device cpu --memory-limit 512MiB`;
    on a laptop for a cluster: `autotune plan --profile profile.json --nodes 128 --gpus-per-node 8 --batch-size 2048`
    """
    with errors_to_exit_codes(json_output):
        from autotune.devices import device_memory_bytes, resolve_device
        from autotune.plan import ensure_feasible, plan, recommended_microbatch_range
        from autotune.schedules import TIED_ASYNC, allowed_schedules
        from autotune.units import parse_size

        gpus, per_node = _ranks(gpus, nodes, gpus_per_node)
        modes = parse_data_parallel(data_parallel)
        limit = parse_size(memory_limit) if memory_limit else None
        if profile_path is not None:
            from autotune.costs import load_profile

            if model is not None:
                raise UsageError("pass either a model file or --profile, not both")
            profile = load_profile(profile_path)
            tp_degrees = _profile_tp_degrees(parse_degrees(tensor_parallel, "--tensor-parallel"), gpus, per_node)
            if precision is not None and precision.value != profile.precision:
                raise UsageError(
                    f"{profile_path} was profiled in {profile.precision}, not {precision.value}; profile again with "
                    f"`autotune profile ... --precision {precision.value} --output {profile_path}` (or drop "
                    f"--precision to plan in {profile.precision})"
                )
            batch_size = batch_size or profile.batch_size
            if batch_size is None:
                raise UsageError(f"{profile_path} does not say its batch size; pass --batch-size")
            if limit is None and profile.device.startswith("cuda"):
                raise UsageError("planning a cuda profile without its GPU: pass --memory-limit, e.g. 80GiB")
        else:
            from autotune.tune import load_and_profile

            if model is None or batch_size is None:
                raise UsageError("pass a model file and --batch-size, or --profile PROFILE.json")
            chosen = resolve_device(device.value)
            limit = limit if limit is not None else device_memory_bytes(chosen)
            from autotune.tune import search_tp_degrees

            spec, profile = load_and_profile(
                model, batch_size, chosen, micro_batch_sizes=parse_sizes(micro_batch_size), repeats=repeats,
                reporter=TerminalReporter(), split_at=parse_split_at(split_at), gpus=gpus, every_block=every_block,
                memory_limit_bytes=limit, precision=precision.value if precision else None,
                state_shards=gpus if "shard" in modes else 1,
            )
            tp_degrees = search_tp_degrees(spec, gpus, per_node, parse_degrees(tensor_parallel, "--tensor-parallel"))
        link = _node_link(profile, inter_node_bandwidth, inter_node_latency) if per_node else None
        from autotune.graph_cache import planning

        if allow_async and profile.shared_parameters:
            err_console.print(f"[yellow]warning:[/yellow] --allow-async: {TIED_ASYNC}; planning the synchronous "
                              "schedules only", highlight=False)
        with err_console.status(f"planning {gpus} ranks..."), planning():
            planned = plan(profile, gpus=gpus, batch_size=batch_size, memory_limit_bytes=limit, link=link,
                           gpus_per_node=per_node, data_parallel_modes=modes, tensor_parallel_degrees=tp_degrees,
                           schedules=allowed_schedules(allow_async, tied=bool(profile.shared_parameters)))
        ensure_feasible(planned)
        shown = planned[:top]
        if json_output:
            print_json([p.to_dict() for p in shown])
        else:
            render_plan(shown, recommended_microbatch_range(planned), limit, gpus, batch_size)
            for line in tensor_parallel_lines(planned):
                console.print(line, highlight=False)
            link_nodes = per_node or gpus
            if link is not None and link.inter_node_bandwidth_bytes_per_s and link.inter_node_latency_s is not None:
                console.print(
                    f"{gpus // link_nodes} nodes of {link_nodes}; inter-node link assumed "
                    f"{link.inter_node_bandwidth_bytes_per_s / 1e9:g} GB/s, {link.inter_node_latency_s * 1e6:g} us "
                    f"per message (--inter-node-bandwidth, --inter-node-latency); `autotune search` measures it.",
                    highlight=False,
                )


def _profile_tp_degrees(asked: tuple[int, ...] | None, gpus: int, per_node: int | None) -> tuple[int, ...]:
    """--tensor-parallel with --profile: the degrees named (1 when none), each dividing the ranks and a node."""
    node = per_node or gpus
    for tp in asked or ():
        if gpus % tp or node % tp:
            raise UsageError(f"--tensor-parallel {tp} does not divide the {node} GPUs of a node; use a divisor of "
                             f"{node}")
    return asked or (1,)


def tensor_parallel_lines(planned: list[Any]) -> list[str]:
    """Per tp degree > 1 that was planned: its best candidate against the best overall, and what its collectives
    cost (why it ranks where it does)."""
    if not planned:
        return []
    pool = [p for p in planned if p.estimate.feasible] or planned
    top = pool[0].estimate
    lines = []
    for tp in sorted({p.candidate.tensor_parallel_degree for p in pool} - {1}):
        best = next(p for p in pool if p.candidate.tensor_parallel_degree == tp)
        e = best.estimate
        lines.append(
            f"tensor parallel {tp}: best {best.candidate.key} at {e.step_time_ms:.1f} ms per step "
            f"({e.step_time_ms / top.step_time_ms:.2f}x the best), of which {e.tensor_parallel_ms:.1f} ms are its tp "
            f"collectives on the slowest rank"
        )
    return lines


def _ranks(gpus: int | None, nodes: int | None, gpus_per_node: int | None) -> tuple[int, int | None]:
    """(total ranks, ranks per node or None for one machine) from --gpus, --nodes and --gpus-per-node."""
    if nodes is not None and gpus_per_node is None:
        if gpus is None or gpus % nodes:
            raise UsageError("--nodes needs --gpus-per-node (or a --gpus that nodes divide)")
        gpus_per_node = gpus // nodes
    if nodes is not None and gpus_per_node is not None:
        if gpus is not None and gpus != nodes * gpus_per_node:
            raise UsageError(f"--gpus {gpus} is not --nodes {nodes} x --gpus-per-node {gpus_per_node}; drop --gpus")
        gpus = nodes * gpus_per_node
    if gpus is None:
        raise UsageError("pass --gpus, or --nodes and --gpus-per-node")
    if gpus_per_node is not None and gpus % gpus_per_node:
        raise UsageError(f"--gpus {gpus} is not a whole number of nodes of {gpus_per_node}; pass a multiple")
    return gpus, (gpus_per_node if gpus_per_node is not None and gpus > gpus_per_node else None)


def _node_link(profile: Any, bandwidth_gb_s: float | None, latency_us: float | None) -> Any:
    """The profile's link (LinkModel.for_profile) with an inter-node entry: the flags, or the documented assumption."""
    from autotune.simulate import LinkModel

    cuda = profile.device.startswith("cuda")
    bandwidth = (bandwidth_gb_s if bandwidth_gb_s is not None else (25.0 if cuda else 1.25)) * 1e9
    latency = (latency_us if latency_us is not None else (10.0 if cuda else 100.0)) * 1e-6
    base = LinkModel.for_profile(profile)
    return base.with_probe(inter_latency_s=latency, inter_bandwidth_bytes_per_s=bandwidth)


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
    if profile.infeasible_micro_batch_sizes:
        console.print(
            f"out of memory for one block at micro-batch size(s) "
            f"{', '.join(map(str, profile.infeasible_micro_batch_sizes))}: no candidate can use them",
            highlight=False,
        )
    if profile.too_small_micro_batch_sizes:
        console.print(
            f"failed to train at micro-batch size(s) {', '.join(map(str, profile.too_small_micro_batch_sizes))} "
            f"while larger ones ran: no candidate can use them",
            highlight=False,
        )


def render_plan(
    planned: list[Any], recommended: tuple[int, int], limit: int | None, gpus: int, batch_size: int
) -> None:
    from rich import box
    from rich.table import Table

    from autotune.units import format_bytes

    precision = planned[0].candidate.precision if planned else "fp32"
    title = f"plan: {gpus} ranks, batch {batch_size}, {precision}" + (
        f", limit {format_bytes(limit)}/rank" if limit else "")
    table = Table(title=title, box=box.SIMPLE_HEAD, collapse_padding=True, pad_edge=False)  # ten columns in 80
    columns = ("#", "pp×dp×tp", "schedule", "B/M", "M", "split", "step ms", "samples/s", "bubble", "peak mem")
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
            f"{c.pipeline_degree}×{c.data_parallel_degree}×{c.tensor_parallel_degree}" + _data_parallel_label(c),
            c.schedule.value + (" +ckpt" if c.activation_checkpointing else "")
            + (" dp-inner" if c.rank_order == "dp-inner" else ""),
            str(c.n_microbatches),
            str(c.micro_batch_size),
            ",".join(map(str, c.layers_per_stage)),
            f"{e.step_time_ms:.1f}" + ("*" if p.even_split_of else ""),
            f"{e.throughput_samples_per_s:.1f}",
            f"{e.bubble_fraction:.0%}",
            peak if e.feasible else f"[red]{peak}[/red]",
        )
    console.print(table)
    if any(p.even_split_of for p in planned):
        from autotune.partition import EVEN_WITHIN

        console.print(
            f"* a more even split of a configuration whose fastest split is predicted within {EVEN_WITHIN:.0%}: "
            "ranked at that split's speed (the profile's noise cannot tell them apart; `--json` names the split).",
            highlight=False,
        )
    if any(p.candidate.sharded for p in planned):
        console.print(
            "shard: FSDP2 over the dp replicas, each stage gathered for the step; shard/rs: resharded after every "
            "forward and gathered again (less memory, more all-gathers).",
            highlight=False,
        )
    lo, hi = recommended
    span = f"{lo}" if lo == hi else f"{lo} to {hi}"
    console.print(
        f"recommended B/M: {span} per replica (within 5% of the best predicted throughput). Predictions come from a "
        f"one-device profile; measure with `autotune trial` or `autotune search`.",
        highlight=False,
    )



def _data_parallel_label(c: Any) -> str:
    """ shard or shard/rs after pp×dp for sharded candidates; nothing for replicas."""
    if not c.sharded:
        return ""
    return " shard/rs" if c.reshard_after_forward else " shard"
