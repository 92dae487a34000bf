"""`autotune check`: does a tuned config still hold (for CI)?"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from autotune.cli.app import app, console, err_console, errors_to_exit_codes, print_json, start_fork_server
from autotune.cli.options import (
    DeviceChoice,
    JsonOpt,
    RunTimeoutOpt,
    StepsOpt,
    WarmupOpt,
    parse_seconds,
)
from autotune.errors import STATUS_EXIT_CODES


@app.command(
    epilog="Exit codes: 0 still fits and within tolerance, 1 regressed (or the trial failed), 2 the config "
    "does not match the model (or cannot be read), 3 no longer fits the memory limit, 4 cannot launch."
)
def check(
    config: Annotated[Path, typer.Argument(help="A tuned config written by autotune search.")],
    model: Annotated[Path | None, typer.Option(help="The model file. Default: the config's model path.")] = None,
    tolerance: Annotated[
        float,
        typer.Option(
            min=0,
            max=1,
            help="Allowed slowdown below the slowest run the search recorded of the config (its run-to-run noise), "
            "else below its recorded throughput.",
        ),
    ] = 0.05,
    repeats: Annotated[int, typer.Option(min=1, help="Runs at most, before a slowdown counts as a regression.")] = 3,
    memory_limit: Annotated[
        str | None, typer.Option("--memory-limit", help="Override the config's memory limit, e.g. 40GiB.")
    ] = None,
    steps: StepsOpt = 5,
    warmup: WarmupOpt = 2,
    timeout: RunTimeoutOpt = "300",
    device: Annotated[
        DeviceChoice | None,
        typer.Option(
            "--device",
            help="cuda: one GPU per rank (NCCL). cpu: one process per rank (gloo). Default: the device the config "
            "was tuned on.",
        ),
    ] = None,
    json_output: JsonOpt = False,
) -> None:
    """Re-run a tuned config's trial, for CI: does it still match the model, fit the memory limit, and run within
    `--tolerance` of the recorded throughput? A slow run is repeated (up to `--repeats`) and the median decides.

    Runs on the device the config was tuned on unless `--device` says otherwise.

    Example: `autotune check autotune.yaml --json`
    """
    with errors_to_exit_codes(json_output):
        timeout_s = parse_seconds(timeout, "--timeout")
        start_fork_server()
        from autotune.check import check_config, config_device, resolve_model
        from autotune.config_file import load_config
        from autotune.devices import cpu_oversubscription, resolve_device
        from autotune.trial import TrialOptions
        from autotune.units import format_bytes, parse_size
        from autotune.watchdog import MODEL_CHECK, time_limit

        tuned = load_config(config)
        with time_limit(timeout_s, path=model or Path(tuned.model), what=MODEL_CHECK):
            spec = resolve_model(tuned, config, model)
        limit = parse_size(memory_limit) if memory_limit else tuned.memory_limit_bytes
        options = TrialOptions(
            steps=steps,
            warmup=warmup,
            timeout_s=timeout_s,
            memory_limit_bytes=limit,
            device=resolve_device(config_device(tuned, device)),
        )
        oversubscribed = cpu_oversubscription(tuned.gpus, options.device)
        if oversubscribed:
            err_console.print(f"[yellow]warning:[/yellow] {oversubscribed}", highlight=False, soft_wrap=True)
        with err_console.status(f"checking {tuned.candidate.key} (limit {format_bytes(limit)})..."):
            result = check_config(tuned, spec, tolerance=tolerance, repeats=repeats, options=options)
        if json_output:
            print_json(result.to_dict())
        else:
            colour = "green" if result.status == "ok" else "red"
            console.print(f"[{colour}]{result.status}[/{colour}]: {result.message}", highlight=False)
        if STATUS_EXIT_CODES[result.status]:
            raise typer.Exit(STATUS_EXIT_CODES[result.status])
