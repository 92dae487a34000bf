"""Parent side of a trial: start one process per rank, watch for failure and timeout, name the culprit, clean up.

Ranks are forked from a fork server that has torch and the worker preloaded, so only the first trial of a tuner pays
for importing torch (~2 s here); later trials start in well under a second. Every rank dies with the fork server,
which dies with the tuner: a tuner killed with SIGKILL leaves no rank behind.

Who is to blame when a trial fails:
  1. a rank that raised an error of its own (not a broken connection), the earliest such;
  2. else a rank that died without writing an error (killed, segfault, os._exit);
  3. else the earliest rank with a communication error.
On a timeout, every live rank dumps its Python stack (faulthandler, SIGUSR1); a rank stuck outside
torch.distributed is the culprit, the ranks waiting in torch.distributed are its victims.
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import multiprocessing.connection
import os
import shutil
import signal
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from autotune.candidate import Candidate, Measurement, TrialError
from autotune.compat import TORCH_DISTRIBUTED_PATH
from autotune.errors import LaunchError
from autotune.model_file import ModelSpec
from autotune.trial import server
from autotune.trial.job import RankJob, start_rank

log = logging.getLogger(__name__)

FAILURE_GRACE_S = 3.0
"""After a rank fails, how long its peers get to notice and exit before they are killed."""
STACK_DUMP_WAIT_S = 0.5


@dataclass(frozen=True, kw_only=True)
class TrialOptions:
    steps: int = 5
    """Measured steps (the step time is their median)."""
    warmup: int = 2
    """Unmeasured steps first (at least 1: shapes, optimizer state; the last one measures memory)."""
    timeout_s: float = 300.0
    """The whole trial, start-up included."""
    memory_limit_bytes: int | None = None
    device: str = "cpu"
    keep_run_dir: bool = False
    """Keep the ranks' logs and stack dumps (for --debug)."""
    measure_wire_error: bool = False
    """For a bfloat16-wire candidate: also run one forward/backward of a float32-wire twin and report the gradients'
    relative error (Measurement.wire_grad_rel_error)."""


class TrialRunner(Protocol):
    """Runs one candidate for real; the search takes any object of this shape (tests pass fakes)."""

    def __call__(self, spec: ModelSpec, candidate: Candidate, options: TrialOptions) -> Measurement: ...


def run_trial(spec: ModelSpec, candidate: Candidate, options: TrialOptions) -> Measurement:
    """Run one candidate as a real multi-process pipelined training run and measure it. Never raises for a failed
    trial (oom, error, timeout are returned as data); raises LaunchError when ranks cannot be started at all."""
    candidate.validate(spec.n_layers)
    _check_device(options.device, candidate.world_size)
    ctx = server.context()
    run_dir = Path(tempfile.mkdtemp(prefix="autotune-trial-"))
    started = time.time()
    processes: list[Any] = []
    try:
        server_pid = server.start()
        for rank in range(candidate.world_size):
            job = RankJob(
                rank=rank,
                world_size=candidate.world_size,
                model_path=str(spec.path),
                split_at=spec.split_at,
                candidate=candidate.to_dict(),
                steps=options.steps,
                warmup=options.warmup,
                device=options.device,
                memory_limit_bytes=options.memory_limit_bytes,
                run_dir=str(run_dir),
                timeout_s=options.timeout_s,
                launched_at=started,
                parent_pid=server_pid,
                measure_wire_error=options.measure_wire_error,
            )
            process = ctx.Process(target=start_rank, args=(job,), name=f"autotune-rank-{rank}")
            with server.main_module_hidden():
                process.start()
            processes.append(process)
        timed_out = _wait(processes, deadline=started + options.timeout_s)
        stuck = _dump_stacks(processes, run_dir) if timed_out or _any_alive(processes) else {}
    finally:
        _kill_all(processes)
    try:
        return _measure(candidate, options, run_dir, processes, timed_out, stuck, time.time() - started)
    finally:
        if options.keep_run_dir:
            log.warning("rank logs kept in %s", run_dir)
        else:
            shutil.rmtree(run_dir, ignore_errors=True)


def _check_device(device: str, world_size: int) -> None:
    if device == "cuda":
        import torch

        available = torch.cuda.device_count()
        if available < world_size:
            raise LaunchError(
                f"{world_size} ranks need {world_size} GPUs but this machine has {available}; "
                f"pass --gpus {available}" + ("" if available else " or --device cpu")
            )
    elif device != "cpu":
        raise LaunchError(f"unknown device {device!r}; pass --device cpu or --device cuda")


def _wait(processes: list[Any], *, deadline: float) -> bool:
    """Wait until all ranks exit, a failed rank's peers had their grace, or the deadline. True on timeout."""
    failed_at: float | None = None
    while True:
        alive = [p for p in processes if p.exitcode is None]
        if not alive:
            return False
        now = time.time()
        if failed_at is None and any(p.exitcode not in (None, 0) for p in processes):
            failed_at = now
        if failed_at is not None and now - failed_at > FAILURE_GRACE_S:
            return False
        if now >= deadline:
            return True
        limit = deadline if failed_at is None else min(deadline, failed_at + FAILURE_GRACE_S)
        multiprocessing.connection.wait([p.sentinel for p in alive], timeout=max(0.0, min(limit - now, 1.0)))


def _any_alive(processes: list[Any]) -> bool:
    return any(p.exitcode is None for p in processes)


def _dump_stacks(processes: list[Any], run_dir: Path) -> dict[int, bool]:
    """Ask live ranks for their stacks; True for a rank stuck outside torch.distributed."""
    live = {rank: p for rank, p in enumerate(processes) if p.exitcode is None}
    for p in live.values():
        try:
            os.kill(p.pid, signal.SIGUSR1)
        except ProcessLookupError:
            pass
    time.sleep(STACK_DUMP_WAIT_S)
    return {rank: _stuck_outside_comms(run_dir / f"stack-{rank}.txt") for rank in live}


def _stuck_outside_comms(stack_file: Path) -> bool:
    """faulthandler prints each thread innermost frame first; look at the thread running the worker."""
    try:
        text = stack_file.read_text()
    except OSError:
        return False
    for block in text.split("\n\n"):
        if "worker.py" not in block:
            continue
        frames = [line.strip() for line in block.splitlines() if line.strip().startswith("File ")]
        if frames:
            return TORCH_DISTRIBUTED_PATH not in frames[0]
    return False


def _kill_all(processes: list[Any]) -> None:
    for p in processes:
        if p.exitcode is None:
            p.kill()
    for p in processes:
        p.join(timeout=5)


def _measure(
    candidate: Candidate,
    options: TrialOptions,
    run_dir: Path,
    processes: list[Any],
    timed_out: bool,
    stuck: dict[int, bool],
    wall_time_s: float,
) -> Measurement:
    results = {r: _read(run_dir / f"result-{r}.json") for r in range(candidate.world_size)}
    errors = {r: _read(run_dir / f"error-{r}.json") for r in range(candidate.world_size)}
    per_rank = [r for r in results.values() if r is not None]
    if len(per_rank) == candidate.world_size:
        per_step = [max(steps) for steps in zip(*(r["step_times_ms"] for r in per_rank))]
        step_ms = statistics.median(per_step)
        losses = [r["loss"] for r in per_rank if r["loss"] is not None]
        wire_errors = [r["wire_grad_rel_error"] for r in per_rank if r.get("wire_grad_rel_error") is not None]
        phases = {k: max(r["phases_s"].get(k, 0.0) for r in per_rank) for k in per_rank[0]["phases_s"]}
        return Measurement(
            status="ok",
            step_time_ms=step_ms,
            step_times_ms=tuple(per_step),
            throughput_samples_per_s=candidate.global_batch_size / (step_ms / 1000),
            peak_memory_bytes=tuple(int(r["peak_memory_bytes"]) for r in per_rank),
            peak_activation_bytes=tuple(int(r["peak_activation_bytes"]) for r in per_rank),
            loss=sum(losses) / len(losses) if losses else None,
            phases_s=phases,
            wire_grad_rel_error=max(wire_errors) if wire_errors else None,
            candidate=candidate,
            wall_time_s=wall_time_s,
            device=options.device,
        )
    error = _blame(errors, processes, timed_out, stuck, options.timeout_s, run_dir)
    return Measurement(
        status=error.kind, error=error, candidate=candidate, wall_time_s=wall_time_s, device=options.device
    )


def _blame(
    errors: dict[int, dict[str, Any] | None],
    processes: list[Any],
    timed_out: bool,
    stuck: dict[int, bool],
    timeout_s: float,
    run_dir: Path,
) -> TrialError:
    own = sorted((e for e in errors.values() if e and not e["comms"]), key=lambda e: e["at"])
    if own:
        first = own[0]
        where = f" at {first['where']}" if first.get("where") else ""
        return TrialError(
            rank=first["rank"],
            kind=first["kind"],
            message=first["message"] + where,
            bytes_requested=first.get("bytes_requested"),
        )
    if timed_out:
        culprits = [rank for rank, outside in sorted(stuck.items()) if outside]
        rank = culprits[0] if culprits else None
        waiting = ", ".join(str(r) for r in sorted(stuck) if r != rank) or "none"
        what = f"rank {rank} hung outside torch.distributed" if rank is not None else "every live rank waits on a peer"
        return TrialError(
            rank=rank, kind="timeout", message=f"no result within {timeout_s:g} s: {what}; waiting ranks: {waiting}"
        )
    silent = [r for r, p in enumerate(processes) if p.exitcode not in (0, None) and not errors.get(r)]
    if silent:
        rank = silent[0]
        code = processes[rank].exitcode
        how = f"killed by signal {-code}" if code is not None and code < 0 else f"exited with code {code}"
        return TrialError(
            rank=rank, kind="error", message=f"rank {rank} {how} without an error{_log_tail(run_dir, rank)}"
        )
    comms = sorted((e for e in errors.values() if e), key=lambda e: e["at"])
    if comms:
        first = comms[0]
        return TrialError(rank=first["rank"], kind="error", message=first["message"])
    return TrialError(rank=None, kind="error", message="the ranks exited without a result")


def _log_tail(run_dir: Path, rank: int) -> str:
    try:
        lines = [line for line in (run_dir / f"log-{rank}.txt").read_text().splitlines() if line.strip()]
    except OSError:
        return ""
    return f"; last output: {lines[-1][:200]}" if lines else ""


def _read(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
