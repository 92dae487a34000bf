"""`autotune search`: run autotune.tune (profile, plan, real trials, config, report) and show what it found."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from autotune.cli.app import (
    EXIT_CODES_HELP,
    app,
    command_line,
    console,
    err_console,
    errors_to_exit_codes,
    print_json,
    start_fork_server,
)
from autotune.cli.options import (
    AllowAsyncOpt,
    BatchOpt,
    DataParallelOpt,
    DeviceChoice,
    DeviceOpt,
    EveryBlockOpt,
    GpusOpt,
    JsonOpt,
    MemoryOpt,
    ModelArg,
    PrecisionOpt,
    SplitAtOpt,
    StepsOpt,
    TensorParallelOpt,
    WarmupOpt,
    parse_data_parallel,
    parse_degrees,
    parse_seconds,
    parse_split_at,
)
from autotune.cli.progress import TerminalReporter
from autotune.errors import EXIT_INTERRUPTED


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
        typer.Option(help="Optuna storage URL (sqlite:///x.db, postgresql://...). Default: `.autotune/<study>.db`"),
    ] = None,
    study_name: Annotated[str | None, typer.Option(help="Default: `<model>-<device>-g<gpus>-b<batch>`.")] = None,
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
    steps: StepsOpt = 5,
    warmup: WarmupOpt = 2,
    trial_timeout: Annotated[
        str | None,
        typer.Option(
            help="How long one trial may take before it counts as hung (300, 90s, 10m), the same for every trial. "
            "Default: each trial's own "
            "bound from its predicted step time: max(300, 120 + 3 x predicted step x (warm-up + measured steps + 2, "
            "+2 for a bfloat16 wire)); a 60 s step gets 1740 s. torch.distributed's own timeout (NCCL's "
            "watchdog) is the trial's + 60 s.",
        ),
    ] = None,
    worker: Annotated[
        str | None,
        typer.Option(
            help="This search's name when several share one study (--storage, --study-name, --resume); its "
            "--trials counts its own launches. Default: the host name (and CUDA_VISIBLE_DEVICES)."
        ),
    ] = None,
    device: DeviceOpt = DeviceChoice.auto,
    split_at: SplitAtOpt = None,
    every_block: EveryBlockOpt = False,
    precision: PrecisionOpt = None,
    data_parallel: DataParallelOpt = "replicate,shard",
    tensor_parallel: TensorParallelOpt = None,
    allow_async: AllowAsyncOpt = False,
    json_output: JsonOpt = False,
    gpus_per_node: Annotated[
        int | None,
        typer.Option(min=1, help="Under torchrun/srun over several nodes: ranks per node (--gpus is the total). "
                     "Default: the CUDA device count; required with --device cpu."),
    ] = None,
) -> None:
    """Find the fastest pipeline configuration by real trial runs: B/M, layer split, schedule, pp x dp x tp
    (tensor parallel where the model has a plan), activation checkpointing, the dtype between stages and, with
    replicas, whether they replicate or shard (FSDP2) their stages, under the memory limit. Writes the tuned config
    and a report.

    How: profile the layers, simulate every schedule x B/M x balanced split, try the planner's best first (and the
    rule-of-thumb default, for comparison), then let Optuna's TPE sampler propose more. A candidate the simulator
    says cannot fit, or cannot come within 20 % of the best measured one, is recorded as pruned and not launched.
    Failed trials (oom, error, timeout) are recorded with their reason. At the end the top 3 are re-run side by side
    and the best median wins, so a lucky run on a noisy machine does not decide. `--allow-async` adds the
    asynchronous 2BW (one-step-stale updates, no flush between steps) to the schedules planned and tried.

    Ctrl-C stops the running trial, writes the best config so far and exits 130; `--resume` continues the study.

    Several nodes: start the same command on every node with `torchrun --nnodes N --nproc-per-node 1 ...
    -m autotune search ...` or `srun --ntasks-per-node 1 autotune search ...`. Node 0 runs the study and writes
    the config and report; the others run their ranks of each trial.

    Example: `autotune search recipes/mlp.py --gpus 2 --device cpu --batch-size 256 --trials 12`
    """
    with errors_to_exit_codes(json_output):
        from autotune.cluster.env import detect

        env = detect()
        cluster = None
        if env.n_nodes > 1:
            per_node = _gpus_per_node(gpus, gpus_per_node, env.n_nodes, device.value)
            cluster = _join_cluster(env, per_node)
            if cluster is None:
                return
        start_fork_server()
        from autotune.tune import TuneRequest, tune
        from autotune.units import parse_duration, parse_size

        request = TuneRequest(
            model=model,
            gpus=gpus,
            batch_size=batch_size,
            device=device.value,
            trials=trials,
            timeout_s=parse_duration(timeout) if timeout else None,
            memory_limit_bytes=parse_size(memory_limit) if memory_limit else None,
            storage=storage,
            study_name=study_name,
            resume=resume,
            seed=seed,
            steps=steps,
            warmup=warmup,
            trial_timeout_s=parse_seconds(trial_timeout, "--trial-timeout"),
            output=output,
            min_improvement=min_improvement,
            report_dir=report_dir,
            split_at=parse_split_at(split_at),
            profile_every_block=every_block,
            precision=precision.value if precision is not None else None,
            data_parallel_modes=parse_data_parallel(data_parallel),
            tensor_parallel_degrees=parse_degrees(tensor_parallel, "--tensor-parallel"),
            allow_async=allow_async,
            command=command_line(),
            worker=worker,
            gpus_per_node=cluster.gpus_per_node if cluster is not None else None,
            inter_node_link=_probe(cluster, device.value) if cluster is not None else None,
            intra_node_link=_probe_inside(device.value, cluster.gpus_per_node if cluster is not None else gpus),
        )
        if cluster is None:
            outcome = tune(request, TerminalReporter())
        else:
            code, reason = 1, "node 0 failed"
            try:
                outcome = tune(request, TerminalReporter(), runner=cluster)
                code, reason = 0, "done"
            except KeyboardInterrupt:
                code, reason = EXIT_INTERRUPTED, "interrupted"
                raise
            finally:
                cluster.shutdown(code, reason)
        summary = search_summary(outcome)
        if json_output:
            print_json(summary)
        else:
            render_search(outcome.result, summary)
        if outcome.interrupted:
            raise typer.Exit(EXIT_INTERRUPTED)


def _gpus_per_node(gpus: int, gpus_per_node: int | None, n_nodes: int, device: str) -> int:
    """Ranks per node of a multi-node search: --gpus-per-node, else (cuda) this node's device count."""
    from autotune.errors import UsageError

    if gpus_per_node is None:
        if device == "cpu":
            raise UsageError("with --device cpu over several nodes, pass --gpus-per-node (ranks per node)")
        import torch

        gpus_per_node = torch.cuda.device_count()
        if gpus_per_node < 1:
            raise UsageError("no CUDA device on this node: pass --device cpu and --gpus-per-node")
    if gpus != n_nodes * gpus_per_node:
        raise UsageError(f"--gpus {gpus} is not {n_nodes} nodes x {gpus_per_node} ranks per node; pass --gpus "
                         f"{n_nodes * gpus_per_node} (the total)")
    return gpus_per_node


def _join_cluster(env: Any, gpus_per_node: int) -> Any:
    """Node 0: the trial runner over every node, once all joined. Other nodes: serve node 0's trials until it is
    done, then exit with its code (None returned only for a clean end)."""
    from autotune.cluster.env import die_with_launcher
    from autotune.cluster.node import Cluster, serve, stop_on_sigterm

    if env.launcher == "torchrun":
        die_with_launcher()
    stop_on_sigterm()
    if env.node == 0:
        cluster = Cluster(env, gpus_per_node)
        with err_console.status(f"waiting for {env.n_nodes - 1} more node(s) to join..."):
            cluster.join()
        return cluster
    start_fork_server()
    code = serve(env, gpus_per_node, say=lambda text: err_console.print(text, highlight=False))
    if code:
        raise typer.Exit(code)
    return None


def _probe(cluster: Any, device: str) -> tuple[float, float, float | None, bool] | None:
    """The inter-node link, measured once before profiling (node 0 <-> node 1), and said on stderr."""
    from autotune.devices import resolve_device

    with err_console.status("probing the link between node 0 and node 1..."):
        measured = cluster.probe(resolve_device(device))
    if measured is None:
        err_console.print("[yellow]the inter-node link probe failed: planning as if inside one node[/yellow]")
    else:
        from autotune.units import format_rate

        latency, bandwidth, reduced, same_host = measured
        collective = f" (all-reduce {format_rate(reduced)})" if reduced else ""
        host = "; both nodes are one machine, sharing its cores" if same_host else ""
        err_console.print(f"inter-node link (node 0 <-> node 1, probed): {latency * 1e6:.0f} us, "
                          f"{format_rate(bandwidth)}{collective}{host}", highlight=False, soft_wrap=True)
    return measured


def _probe_inside(device: str, gpus_here: int) -> tuple[float, float] | None:
    """On CUDA, where this machine runs two or more of the search's GPUs: the link between two of them (GPU 0 <->
    GPU 1), measured once before profiling and said on stderr, for the planner in place of the CUDA defaults
    (guesses: NVLink, NVSwitch and PCIe differ several times). None on the CPU stand-in, whose link is calibrated
    (bench/calibrate.py), and on one GPU."""
    from autotune.devices import resolve_device

    if gpus_here < 2 or resolve_device(device) != "cuda":
        return None
    import torch

    if torch.cuda.device_count() < 2:
        return None
    from autotune.trial.launch import probe_local_link

    with err_console.status("probing the link between GPU 0 and GPU 1..."):
        measured = probe_local_link("cuda")
    if measured is None:
        err_console.print("[yellow]the link probe between GPU 0 and GPU 1 failed: planning with the CUDA defaults"
                          "[/yellow]")
    else:
        latency, bandwidth = measured
        err_console.print(f"link inside the node (GPU 0 <-> GPU 1, probed): {latency * 1e6:.0f} us, "
                          f"{bandwidth / 1e9:.1f} GB/s", highlight=False)
    return measured


def search_summary(outcome: Any) -> dict[str, Any]:
    """The --json object of a search."""
    result = outcome.result
    best = result.best
    return {
        "status": "interrupted" if result.interrupted else "ok",
        "config": str(outcome.config_path),
        "config_written": outcome.config_written,
        "kept_existing_config": outcome.kept_existing_config,
        "report": str(outcome.report_dir / "report.md"),
        "study": result.study_name,
        "storage": result.storage,
        "best": best.to_dict(),
        "best_trial": result.best_trial,
        "trials": len(result.records),
        "launched": result.launched,
        "worker": outcome.worker,
        "launched_by_worker": outcome.launched_by_worker,
        "chosen_by": result.chosen_by,
        "feasible": result.feasible,
        "pruned": sum(1 for r in result.records if r.outcome == "pruned"),
        "wall_time_s": result.wall_time_s,
        "too_noisy_to_separate_leaders": result.too_noisy,
        "leaders": [
            {"candidate": leader.candidate.key, "step_time_ms": leader.step_time_ms, "runs": list(leader.step_times_ms)}
            for leader in result.leaders[:5]
        ],
    }


def render_search(result: Any, summary: dict[str, Any]) -> None:
    from rich.table import Table

    table = Table(title="fastest configurations (median over every run; those re-run side by side first)")
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
