"""Parent side of a trial: start one process per rank, watch for failure and timeout, name the culprit, clean up.

Ranks are forked from a fork server that has torch and the worker preloaded, so only the first trial of a tuner pays
for importing torch (~2 s here); later trials start in well under a second. Every rank dies with the fork server,
which dies with the tuner: a tuner killed with SIGKILL leaves no rank behind.

Who is to blame when a trial fails:
  1. a rank that raised an error of its own (not a broken connection), the earliest such;
  2. else a rank that died without writing an error (killed, segfault, os._exit);
  3. else the earliest rank with a communication error.
On a timeout, the culprit is the rank the others wait on by their progress (the schedule actions each completed:
trial.progress); where progress cannot tell, every live rank dumps its Python stack (faulthandler, SIGUSR1) and a
rank stuck outside torch.distributed is the culprit, the ranks waiting in torch.distributed its victims.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import multiprocessing
import multiprocessing.connection
import os
import shutil
import signal
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from autotune.candidate import Candidate, Measurement, TrialError
from autotune.compat import TORCH_DISTRIBUTED_PATH
from autotune.errors import LaunchError
from autotune.model_file import ModelSpec
from autotune.trial import server
from autotune.trial.entry import start_rank
from autotune.trial.job import RankJob
from autotune.trial.progress import hang_culprit, read_progress

log = logging.getLogger(__name__)

TRIAL_TIMEOUT_FLOOR_S = 300.0
"""The shortest bound a search gives a trial (the old fixed one): set-up the prediction does not see (a slow
build_model, a cold file cache, NCCL's start-up at scale) always has this long."""
TRIAL_SETUP_S = 120.0
"""Set-up on top of the predicted steps: the ranks' rendezvous, building their stages, the batch."""
STEP_TIME_SAFETY = 3.0
"""Each step may take this many times its prediction (first steps infer shapes and fill caches and the allocator;
the simulator's error) before the trial counts as hung."""
PROCESS_GROUP_MARGIN_S = 60.0
"""torch.distributed's own timeout (NCCL's watchdog) is the trial's plus this: the launcher, which dumps every
rank's stack and names the hung one, acts first; the watchdog only reaps what it could not."""

FAILURE_GRACE_S = 3.0
"""After a rank fails, how long its peers get to notice and exit before they are killed."""
STACK_DUMP_WAIT_S = 0.5
LIVE: list[Any] = []
"""This process's rank processes of the trial running now: a node told to stop kills them first (autotune.cluster)."""


@dataclass(frozen=True, kw_only=True)
class TrialOptions:
    steps: int = 5
    """Measured steps (the step time is their median)."""
    warmup: int = 2
    """Unmeasured steps first (at least 1: shapes, optimizer state; the last one measures memory)."""
    timeout_s: float = TRIAL_TIMEOUT_FLOOR_S
    """The whole trial, start-up included (a search derives it per trial: trial_timeout_s)."""
    process_group_timeout_s: float | None = None
    """torch.distributed's timeout of one collective or receive (NCCL's watchdog aborts a rank past it); None:
    timeout_s + PROCESS_GROUP_MARGIN_S."""
    memory_limit_bytes: int | None = None
    device: str = "cpu"
    keep_run_dir: bool = False
    """Keep the ranks' logs and stack dumps (for --debug)."""
    measure_wire_error: bool = False
    """For a bfloat16-wire candidate: also run the first micro-batches (the fewest its schedule runs) forward and
    backward with a float32 wire and with its own, through the same stages, and report the gradients' relative error
    on a strided sample of them (Measurement.wire_grad_rel_error). Its memory counts in the trial's peak. Skipped
    (None) for bf16 compute and for sharded candidates (trial.worker.measures_wire_error)."""


def trial_timeout_s(options: TrialOptions, predicted_step_s: float) -> float:
    """How long a trial of a step predicted at predicted_step_s may take before it counts as hung:

        max(TRIAL_TIMEOUT_FLOOR_S, TRIAL_SETUP_S + STEP_TIME_SAFETY x steps x predicted_step_s)

    where steps counts what a rank runs: the warm-up steps (the last one, memory-tracked, twice: on CPU it runs
    every operator through Python), one more untracked step, the measured steps, and for a bfloat16 wire with
    measure_wire_error its two forward/backward passes on the first micro-batches (counted as two steps). The
    defaults (2 warm-up, 5 measured) give 9 steps: a 60 s step gets 1740 s, a 1 s step the floor of 300 s. A
    prediction that is not a finite number gets the floor: a hang is always bounded."""
    steps = max(options.warmup, 1) + 1 + 1 + options.steps + (2 if options.measure_wire_error else 0)
    if not math.isfinite(predicted_step_s) or predicted_step_s < 0:
        return TRIAL_TIMEOUT_FLOOR_S
    return max(TRIAL_TIMEOUT_FLOOR_S, TRIAL_SETUP_S + STEP_TIME_SAFETY * steps * predicted_step_s)


def process_group_timeout_s(options: TrialOptions) -> float:
    """torch.distributed's timeout for the trial's ranks: options.process_group_timeout_s, else the trial's bound +
    PROCESS_GROUP_MARGIN_S."""
    return options.process_group_timeout_s or options.timeout_s + PROCESS_GROUP_MARGIN_S


class TrialRunner(Protocol):
    """Runs one candidate for real; the search takes any object of this shape (tests pass fakes)."""

    def __call__(self, spec: ModelSpec, candidate: Candidate, options: TrialOptions) -> Measurement: ...


def run_trial(spec: ModelSpec, candidate: Candidate, options: TrialOptions) -> Measurement:
    """Run one candidate as a real multi-process pipelined training run and measure it. Never raises for a failed
    trial (oom, error, timeout are returned as data); raises LaunchError when ranks cannot be started at all."""
    candidate.validate(spec.n_layers)
    _check_device(options.device, candidate.world_size)
    started = time.time()
    outcome = run_ranks(str(spec.path), candidate, options, ranks=range(candidate.world_size), split_at=spec.split_at)
    return measure(candidate, options, [outcome], time.time() - started)


def probe_local_link(device: str, timeout_s: float = 60.0) -> tuple[float, float] | None:
    """(latency s, bandwidth bytes/s) of one send between two ranks of this machine (GPU 0 <-> GPU 1 on CUDA, over
    NCCL), measured as the inter-node probe measures its link (trial.probe); None when the probe failed."""
    outcome = run_ranks("", None, TrialOptions(timeout_s=timeout_s, device=device), ranks=range(2), kind="probe",
                        world_size=2)
    result = outcome.results.get(0)
    if result is None:
        return None
    return float(result["latency_s"]), float(result["bandwidth_bytes_per_s"])


@dataclass(frozen=True, kw_only=True)
class RanksOutcome:
    """What one machine's ranks of a trial left behind, by global rank (JSON-able: it crosses nodes)."""

    node: int | None
    """The node these ranks ran on; None on one machine."""
    results: dict[int, dict[str, Any] | None]
    """result-<rank>.json of each rank, None where it wrote none."""
    errors: dict[int, dict[str, Any] | None]
    """error-<rank>.json of each rank, None where it wrote none."""
    exitcodes: dict[int, int | None]
    """Exit code of each rank process (None: still alive when killed)."""
    stuck: dict[int, bool]
    """Ranks alive at the end: True when stuck outside torch.distributed."""
    timed_out: bool
    """The deadline (or the coordinator's timeout abort) ended the wait."""
    log_tails: dict[int, str]
    """Last line of output of each rank that exited non-zero without an error file."""
    progress: dict[int, list[int]] = dataclasses.field(default_factory=dict)
    """(runs, inside, done) of each rank that ran its schedule (trial.progress), read at the end."""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RanksOutcome:
        ints = lambda d: {int(k): v for k, v in d.items()}  # noqa: E731 - JSON keys are strings
        return cls(node=data["node"], results=ints(data["results"]), errors=ints(data["errors"]),
                   exitcodes=ints(data["exitcodes"]), stuck=ints(data["stuck"]), timed_out=data["timed_out"],
                   log_tails=ints(data["log_tails"]), progress=ints(data.get("progress", {})))


def run_ranks(
    model_path: str,
    candidate: Candidate | None,
    options: TrialOptions,
    *,
    ranks: range,
    node: int | None = None,
    store: str | None = None,
    watch: Callable[[bool], tuple[bool, str | None]] | None = None,
    kind: str = "run",
    world_size: int | None = None,
    split_at: tuple[str, ...] | None = None,
) -> RanksOutcome:
    """Start the given global ranks of a trial on this machine (local rank = position in `ranks`), wait for them
    (deadline, failure grace), dump the stacks of ranks still alive, kill, and collect what they left.
    store: the trial's rendezvous on the launcher's store (autotune.cluster); None: a file in the run dir.
    watch(failed_here) -> (a rank elsewhere failed, abort reason): polled while waiting, for multi-node trials.
    kind probe: the link probe's two ranks (candidate None, world_size 2)."""
    ctx = server.context()
    run_dir = Path(tempfile.mkdtemp(prefix="autotune-trial-"))
    started = time.time()
    processes: list[Any] = []
    try:
        server_pid = server.start()
        for local_rank, rank in enumerate(ranks):
            job = RankJob(
                rank=rank,
                world_size=candidate.world_size if candidate is not None else int(world_size or 0),
                model_path=model_path,
                split_at=split_at,
                candidate=candidate.to_dict() if candidate is not None else {},
                steps=options.steps,
                warmup=options.warmup,
                device=options.device,
                memory_limit_bytes=options.memory_limit_bytes,
                run_dir=str(run_dir),
                timeout_s=options.timeout_s,
                process_group_timeout_s=process_group_timeout_s(options),
                launched_at=started,
                parent_pid=server_pid,
                measure_wire_error=options.measure_wire_error,
                local_rank=local_rank,
                local_world_size=len(ranks),
                store=store,
                kind=kind,
            )
            process = ctx.Process(target=start_rank, args=(job,), name=f"autotune-rank-{rank}")
            with server.main_module_hidden():
                process.start()
            processes.append(process)
        LIVE[:] = processes
        timed_out = _wait(processes, deadline=started + options.timeout_s, watch=watch)
        stuck = _dump_stacks(processes, run_dir, ranks) if timed_out or _any_alive(processes) else {}
    finally:
        _kill_all(processes)
        LIVE[:] = []
    try:
        by_rank = dict(zip(ranks, processes, strict=False))
        errors = {r: _read(run_dir / f"error-{r}.json") for r in ranks}
        return RanksOutcome(
            node=node,
            results={r: _read(run_dir / f"result-{r}.json") for r in ranks},
            errors=errors,
            exitcodes={r: p.exitcode for r, p in by_rank.items()},
            stuck=stuck,
            timed_out=timed_out,
            log_tails={r: _log_tail(run_dir, r) for r, p in by_rank.items()
                       if p.exitcode not in (0, None) and not errors.get(r)},
            progress={r: list(p) for r in ranks if (p := read_progress(run_dir, r)) is not None},
        )
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


def _wait(
    processes: list[Any], *, deadline: float, watch: Callable[[bool], tuple[bool, str | None]] | None = None
) -> bool:
    """Wait until all ranks exit, a failed rank's peers had their grace, or the deadline. True on timeout.
    watch (multi-node): a rank failed on another node starts the grace here too; an abort reason ends the wait
    (a timeout abort counts as a timeout)."""
    failed_at: float | None = None
    while True:
        alive = [p for p in processes if p.exitcode is None]
        if not alive:
            return False
        now = time.time()
        failed_here = any(p.exitcode not in (None, 0) for p in processes)
        if failed_at is None and failed_here:
            failed_at = now
        if watch is not None:
            failed_elsewhere, abort = watch(failed_here)
            if abort is not None:
                return abort == "timeout"
            if failed_at is None and failed_elsewhere:
                failed_at = now
        if failed_at is not None and now - failed_at > FAILURE_GRACE_S:
            return False
        if now >= deadline:
            return True
        limit = deadline if failed_at is None else min(deadline, failed_at + FAILURE_GRACE_S)
        step = 0.2 if watch is not None else 1.0
        multiprocessing.connection.wait([p.sentinel for p in alive], timeout=max(0.0, min(limit - now, step)))


def _any_alive(processes: list[Any]) -> bool:
    return any(p.exitcode is None for p in processes)


def _dump_stacks(processes: list[Any], run_dir: Path, ranks: range) -> dict[int, bool]:
    """Ask live ranks for their stacks; True for a rank stuck outside torch.distributed (by global rank)."""
    live = {rank: p for rank, p in zip(ranks, processes, strict=False) if p.exitcode is None}
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


def measure(
    candidate: Candidate, options: TrialOptions, outcomes: list[RanksOutcome], wall_time_s: float
) -> Measurement:
    """The measurement of a trial from what its ranks left (one outcome per machine), or the error to blame."""
    results: dict[int, dict[str, Any]] = {r: v for o in outcomes for r, v in o.results.items() if v is not None}
    per_rank = [results[r] for r in sorted(results)]
    if len(per_rank) == candidate.world_size:
        per_step = [max(steps) for steps in zip(*(r["step_times_ms"] for r in per_rank))]
        step_ms = statistics.median(per_step)
        losses = [r["loss"] for r in per_rank if r["loss"] is not None]
        # Each replica's last stage trains its own rows: a step's loss is their mean, as `loss` is.
        step_losses = [sum(step) / len(step) for step in zip(*(r["losses"] for r in per_rank if r.get("losses")))]
        wire_errors = [r["wire_grad_rel_error"] for r in per_rank if r.get("wire_grad_rel_error") is not None]
        phases = {k: max(r["phases_s"].get(k, 0.0) for r in per_rank) for k in per_rank[0]["phases_s"]}
        return Measurement(
            status="ok",
            step_time_ms=step_ms,
            step_times_ms=tuple(per_step),
            throughput_samples_per_s=candidate.global_batch_size / (step_ms / 1000),
            peak_memory_bytes=tuple(int(r["peak_memory_bytes"]) for r in per_rank),
            peak_activation_bytes=tuple(int(r["peak_activation_bytes"]) for r in per_rank),
            peak_reserved_bytes=tuple(int(r["peak_reserved_bytes"]) for r in per_rank if "peak_reserved_bytes" in r),
            device_used_bytes=tuple(int(r["device_used_bytes"]) for r in per_rank if "device_used_bytes" in r),
            loss=sum(losses) / len(losses) if losses else None,
            losses=tuple(step_losses),
            phases_s=phases,
            wire_grad_rel_error=max(wire_errors) if wire_errors else None,
            rank_nodes=_rank_nodes(outcomes),
            candidate=candidate,
            wall_time_s=wall_time_s,
            device=options.device,
        )
    error = _blame(outcomes, options.timeout_s, candidate)
    return Measurement(
        status=error.kind, error=error, candidate=candidate, wall_time_s=wall_time_s, device=options.device,
        rank_nodes=_rank_nodes(outcomes),
    )


def _rank_nodes(outcomes: list[RanksOutcome]) -> tuple[int, ...]:
    """The node of each global rank, where the ranks spanned nodes."""
    if all(o.node is None for o in outcomes):
        return ()
    node_of = {r: o.node for o in outcomes for r in o.exitcodes}
    return tuple(int(node_of[r] or 0) for r in sorted(node_of))


def _blame(outcomes: list[RanksOutcome], timeout_s: float, candidate: Candidate | None = None) -> TrialError:
    errors: dict[int, dict[str, Any]] = {r: e for o in outcomes for r, e in o.errors.items() if e}
    node_of = {r: o.node for o in outcomes for r in o.exitcodes}
    name = (lambda r: f"rank {r}") if all(o.node is None for o in outcomes) else (
        lambda r: f"node {node_of.get(r)} rank {r}")
    own = sorted((e for e in errors.values() if e and not e["comms"]), key=lambda e: e["at"])
    if own:
        first = own[0]
        where = f" at {first['where']}" if first.get("where") else ""
        return TrialError(
            rank=first["rank"],
            node=node_of.get(first["rank"]),
            kind=first["kind"],
            message=first["message"] + where,
            bytes_requested=first.get("bytes_requested"),
        )
    if any(o.timed_out for o in outcomes):
        stuck = {r: v for o in outcomes for r, v in o.stuck.items()}
        progress = {r: (p[0], p[1], p[2]) for o in outcomes for r, p in o.progress.items() if r in stuck}
        # By progress first: under NCCL a waiting rank's stack is outside torch.distributed too (it waits in
        # torch.cuda.synchronize); the stacks decide only where progress cannot.
        by_progress = (hang_culprit(candidate, progress, prefer=lambda r: stuck.get(r, False))
                       if candidate is not None and progress else None)
        culprits = [rank for rank, outside in sorted(stuck.items()) if outside]
        rank = by_progress.rank if by_progress is not None else culprits[0] if culprits else None
        label = str if all(o.node is None for o in outcomes) else name
        waiting = ", ".join(label(r) for r in sorted(stuck) if r != rank) or "none"
        if by_progress is not None:
            what = f"{name(rank)} hung: by every rank's progress, it {by_progress.why}"
        elif rank is not None:
            what = f"{name(rank)} hung outside torch.distributed"
        else:
            what = "every live rank waits on a peer"
        return TrialError(
            rank=rank, node=node_of.get(rank) if rank is not None else None, kind="timeout",
            message=f"no result within {timeout_s:g} s: {what}; waiting ranks: {waiting}",
        )
    codes = {r: c for o in outcomes for r, c in o.exitcodes.items()}
    silent = [r for r, c in sorted(codes.items()) if c not in (0, None) and not errors.get(r)]
    if silent:
        rank = silent[0]
        code = codes[rank]
        how = f"killed by signal {-code}" if code is not None and code < 0 else f"exited with code {code}"
        tail = next((o.log_tails.get(rank, "") for o in outcomes if rank in o.log_tails), "")
        return TrialError(
            rank=rank, node=node_of.get(rank), kind="error", message=f"{name(rank)} {how} without an error{tail}"
        )
    comms = sorted((e for e in errors.values() if e), key=lambda e: e["at"])
    if comms:
        first = comms[0]
        return TrialError(rank=first["rank"], node=node_of.get(first["rank"]), kind="error", message=first["message"])
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
