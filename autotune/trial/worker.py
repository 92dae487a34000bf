"""Rank side of a trial: join the process group, build this rank's stages, run and time the steps, write the result.

Every outcome ends in a file the launcher reads: result-<rank>.json, or error-<rank>.json with the rank's own
exception classified (oom / error, and whether it is only a broken connection to a peer that failed first).
"""

from __future__ import annotations

import ctypes
import datetime
import faulthandler
import gc
import math
import os
import signal
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist
import torch.distributed.pipelining

from autotune.candidate import Candidate
from autotune.compat import COMMS_ERROR_TEXTS, STAGE_COMPUTE_METHODS, TORCH_PATH
from autotune.devices import idle_gloo_device_threads, keep_freed_cpu_memory, rank_threads, usable_cores
from autotune.files import atomic_write_json
from autotune.model_file import load_model_file, make_batch
from autotune.runtime import (
    RankBatch,
    RankLayout,
    RankPipeline,
    build_pipeline,
    fewest_microbatches,
    init_groups,
    rewired_pipeline,
)
from autotune.sharding import local_tensor
from autotune.trial import server
from autotune.trial.job import RankJob
from autotune.trial.memory import LiveTensorBytes, SavedActivationBytes, is_out_of_memory, requested_bytes
from autotune.trial.progress import RankProgress, progress_path, track

T = TypeVar("T")


def run_rank(job: RankJob) -> None:
    """Process entry point (fork server child). Never raises: the outcome is written to a file."""
    run_dir = Path(job.run_dir)
    _die_with_parent(job.parent_pid)
    # As torchrun does, so the user's code can tell which rank it runs on.
    local_rank = job.rank if job.local_rank is None else job.local_rank
    os.environ.update(RANK=str(job.rank), LOCAL_RANK=str(local_rank), WORLD_SIZE=str(job.world_size))
    log = open(run_dir / f"log-{job.rank}.txt", "w", buffering=1)  # noqa: SIM115 - lives as long as the process
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    stacks = open(run_dir / f"stack-{job.rank}.txt", "w")  # noqa: SIM115
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
    phases: dict[str, float] = {"start": time.time() - job.launched_at}
    try:
        result = _probe(job) if job.kind == "probe" else _train(job, phases)
    except BaseException as exc:  # noqa: BLE001 - everything a rank can raise becomes data
        traceback.print_exc()
        atomic_write_json(run_dir / f"error-{job.rank}.json", _classify(job.rank, exc))
        sys.stdout.flush()
        os._exit(1)
    atomic_write_json(run_dir / f"result-{job.rank}.json", result)
    os._exit(0)


def _store(job: RankJob) -> dist.Store:
    """The trial's rendezvous: a file in the run dir, or (multi-node) a prefix of the launcher's TCPStore."""
    if job.store is None:
        return dist.FileStore(str(Path(job.run_dir) / "store"), job.world_size)
    address, _, prefix = job.store.partition("/")
    host, _, port = address.rpartition(":")
    client = dist.TCPStore(host, int(port), is_master=False, timeout=datetime.timedelta(seconds=60))
    return dist.PrefixStore(prefix, client)


def _probe(job: RankJob) -> dict[str, Any]:
    from autotune.trial.probe import probe

    torch.set_num_threads(1)
    local = job.rank if job.local_rank is None else job.local_rank
    device = torch.device("cuda", local) if job.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return probe(job.rank, _store(job), device, job.process_group_timeout_s)


def _train(job: RankJob, phases: dict[str, float]) -> dict[str, Any]:
    t0 = time.perf_counter()
    if job.device == "cpu":
        torch.set_num_threads(1)  # the stand-in for one GPU is one process with one thread
        keep_freed_cpu_memory()  # as the profile does: reuse memory like a GPU's caching allocator
        device = torch.device("cpu")
        backend = "gloo"
    else:
        # torchtitan's launcher's allocator setting (fewer, growable segments: less fragmentation than the default's
        # fixed blocks), read when CUDA starts below; a user's own setting wins.
        os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
        device = torch.device("cuda", job.rank if job.local_rank is None else job.local_rank)
        torch.cuda.set_device(device)
        backend = "nccl"
        # The fork server runs with OMP_NUM_THREADS=1 (for the CPU stand-in); a GPU rank builds its stages and its
        # batch on the CPU, with its share of the machine's cores.
        threads = rank_threads("cuda", usable_cores(), job.local_world_size or job.world_size)
        os.environ["OMP_NUM_THREADS"] = str(threads)
        torch.set_num_threads(threads)
        if job.memory_limit_bytes is not None:
            total = torch.cuda.get_device_properties(device).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, job.memory_limit_bytes / total), device)
    store = _store(job)
    dist.init_process_group(
        backend,
        store=store,
        rank=job.rank,
        world_size=job.world_size,
        timeout=datetime.timedelta(seconds=max(job.process_group_timeout_s, 1.0)),
        device_id=device if device.type == "cuda" else None,
    )
    candidate = Candidate.from_dict(job.candidate)
    spec = load_model_file(job.model_path, split_at=job.split_at)
    pp_group, dp_group = init_groups(RankLayout.of(candidate, job.rank))
    pipe = build_pipeline(spec, candidate, rank=job.rank, device=device, pp_group=pp_group, dp_group=dp_group)
    track(pipe.schedule, pipe.stages, RankProgress(progress_path(Path(job.run_dir), job.rank)), STAGE_COMPUTE_METHODS)
    if job.device == "cpu":
        idle_gloo_device_threads()  # opt-in (AUTOTUNE_GLOO_LOOP_IDLE=1): gloo's spinning threads yield to the rank's
    # As a data loader per replica would: this replica's rows only, and of them only what this rank consumes, on
    # its device before any step (a step copies nothing).
    batch = pipe.prepare_batch(*make_batch(spec, candidate.replica_batch_size), replica_rows=True)
    gc.collect()  # the rows this rank does not consume go now, not at some later collection
    phases["setup"] = time.perf_counter() - t0

    # Warm-up: the first step infers shapes and creates optimizer state; the last warm-up step is the tracked one,
    # followed by one untracked step. With measure_wire_error, a bfloat16 wire's gradients are first compared with a
    # float32 wire's on the fewest micro-batches the schedule runs, over the same parameters (_wire_grad_error); the
    # memory it takes counts in the rank's peak.
    t0 = time.perf_counter()
    peak_bytes = activation_bytes = 0
    n_warmup = max(job.warmup, 1)
    wire_error = None
    if job.measure_wire_error and measures_wire_error(candidate):
        wire_error, peak_bytes = _measured(lambda: _wire_grad_error(pipe, batch), job, device)
    # Every trained step's micro-batch losses, in order (empty lists off the last stage): kept as tensors and read
    # only after the timed steps, so that reading them adds no device sync to what is timed.
    step_losses: list[list[torch.Tensor]] = []
    for i in range(n_warmup):
        if i == n_warmup - 1:
            step_peak, activation_bytes, losses = _tracked_step(pipe, batch, job, device)
            peak_bytes = max(peak_bytes, step_peak)
            step_losses.append(losses)
        else:
            step_losses.append(pipe.step(batch))
    # The tracked step runs every operator through Python and disturbs caches and the allocator: the first step
    # after it ran ~1.5x slower here. One more untracked step before timing; for 2BW a window as long as the timed
    # one, whose first run builds torch's schedule of that many steps (shape inference, link warm-up).
    window = job.steps if pipe.weight_versions is not None else 1
    step_losses += pipe.train_steps([batch] * window)
    phases["warmup"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    step_times_ms: list[float] = []
    # 2BW runs the timed steps as one window (no flush between them): one time, the window's over its steps, which
    # pays the pipeline's fill and drain once; a synchronous schedule pays them in every step. The window's own
    # schedule is not tracked (its actions are not one step's list): a hang in it is attributed by the stacks.
    for _ in range(job.steps // window):
        dist.barrier()  # all ranks start the step together, so each rank's time covers the same step
        start = time.perf_counter()
        step_losses += pipe.train_steps([batch] * window)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        step_times_ms.append((time.perf_counter() - start) * 1000 / window)
    phases["steps"] = time.perf_counter() - t0
    per_step = [float(torch.stack(losses).float().mean()) for losses in step_losses if losses]

    cuda_memory = _cuda_memory(device)
    t0 = time.perf_counter()
    dist.barrier()
    dist.destroy_process_group()
    phases["teardown"] = time.perf_counter() - t0
    return {
        **cuda_memory,
        "rank": job.rank,
        "step_times_ms": step_times_ms,
        "median_step_time_ms": statistics.median(step_times_ms) if step_times_ms else None,
        "peak_memory_bytes": peak_bytes,
        "peak_activation_bytes": activation_bytes,
        "loss": per_step[-1] if per_step else None,
        "losses": per_step or None,
        "phases_s": phases,
        "wire_grad_rel_error": wire_error,
    }


def _cuda_memory(device: torch.device) -> dict[str, int]:
    """On CUDA, what the card saw beyond the allocator's peak: the caching allocator's reserved peak (its
    fragmentation and cached blocks) and the device memory in use after the steps (the CUDA context, NCCL's buffers
    and anything else outside the allocator, plus other processes on a shared card). Empty on CPU."""
    if device.type != "cuda":
        return {}
    free, total = torch.cuda.mem_get_info(device)
    return {"peak_reserved_bytes": int(torch.cuda.max_memory_reserved(device)), "device_used_bytes": int(total - free)}


WIRE_SAMPLE_ELEMENTS = 2**18
"""At most this many gradient elements (1 MiB) of the float32-wire pass are kept to compare, and at most one in
WIRE_SAMPLE_STRIDE: an evenly strided sample over all the rank's parameters, not a copy of them."""
WIRE_SAMPLE_STRIDE = 16


def measures_wire_error(candidate: Candidate) -> bool:
    """Whether a trial compares a bfloat16 wire's gradients with a float32 wire's: for float32 compute over a
    bfloat16 wire, not sharded. bf16 compute sends bfloat16 whatever the wire (runtime.stage_boundary): nothing to
    compare; FSDP2's stage modules cannot be rewired (runtime.rewired_pipeline): compare on a replicate layout."""
    return candidate.wire_dtype == "bfloat16" and candidate.precision == "fp32" and not candidate.sharded


def _wire_grad_error(pipe: RankPipeline, batch: RankBatch) -> float | None:
    """||g_bf16 - g_fp32|| / ||g_fp32|| on this rank: one forward/backward of the first micro-batches (the fewest the
    schedule runs) with a float32 wire, then with the bfloat16 wire, through the same modules (runtime.
    rewired_pipeline: no second copy of the stages, no new process groups), on an evenly strided sample of the
    gradient elements. None when the sampled float32 gradients are all zero. Leaves no gradients."""
    m = fewest_microbatches(pipe.candidate)
    rows = m * pipe.candidate.micro_batch_size
    parameters = pipe.parameters()
    stride = max(WIRE_SAMPLE_STRIDE,
                 math.ceil(sum(local_tensor(p).numel() for p in parameters) / WIRE_SAMPLE_ELEMENTS))
    reference: list[torch.Tensor] = []
    diff = norm = 0.0
    for wire in ("float32", "bfloat16"):
        sampled = rewired_pipeline(pipe, wire_dtype=wire, n_microbatches=m)
        sampled.forward_backward(batch.head(rows))
        for i, part in enumerate(_strided_sample(parameters, stride)):
            if wire == "float32":
                reference.append(part.clone())
                norm += float(torch.linalg.vector_norm(part)) ** 2
            else:
                diff += float(torch.linalg.vector_norm(part - reference[i])) ** 2
        pipe.optimizer.zero_grad(set_to_none=True)
        del sampled
        gc.collect()  # torch's stage objects and their receive buffers: before the next pass builds its own
    return math.sqrt(diff / norm) if norm > 0 else None


def _strided_sample(parameters: list[torch.nn.Parameter], stride: int) -> Iterator[torch.Tensor]:
    """Every stride-th element of the parameters' gradients laid end to end, one view per parameter (zeros for a
    parameter without a gradient)."""
    offset = 0
    for p in parameters:
        start = (-offset) % stride
        grad = local_tensor(p.grad) if p.grad is not None else torch.zeros_like(local_tensor(p))
        yield grad.detach().reshape(-1)[start::stride].float()
        offset += grad.numel()


def _measured(run: Callable[[], T], job: RankJob, device: torch.device) -> tuple[T, int]:
    """run()'s result and this rank's peak memory bytes while it ran (CUDA allocator, or tracked live tensors)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        result = run()
        torch.cuda.synchronize(device)
        return result, int(torch.cuda.max_memory_allocated(device))
    with LiveTensorBytes(limit_bytes=job.memory_limit_bytes) as tracker:
        result = run()
    return result, tracker.peak_bytes


def _tracked_step(
    pipe: RankPipeline, batch: RankBatch, job: RankJob, device: torch.device
) -> tuple[int, int, list[torch.Tensor]]:
    """One step, measured: (peak memory bytes, peak saved-activation bytes, the step's micro-batch losses) of this
    rank. The rank's micro-batches are on the device already (counted in the peak, as a loader's prefetched batch
    is); the micro-batches the first stage saves are views of them, excluded from the activations: they are there
    whatever the schedule."""
    activations = SavedActivationBytes(exclude=[*pipe.parameters(), *batch.tensors()])
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        with activations:
            losses = pipe.step(batch)
        torch.cuda.synchronize(device)
        return int(torch.cuda.max_memory_allocated(device)), activations.peak_bytes, losses
    with LiveTensorBytes(limit_bytes=job.memory_limit_bytes) as tracker, activations:
        losses = pipe.step(batch)
    return tracker.peak_bytes, activations.peak_bytes, losses


def _classify(rank: int, exc: BaseException) -> dict[str, Any]:
    # torch's stages re-raise as "Failed to run stage backward ..." from the real error: look down the chain.
    chain = _chain(exc)
    oom_cause = next((e for e in chain if is_out_of_memory(e)), None)
    if oom_cause is not None:
        exc = oom_cause
    text = " <- ".join(f"{type(e).__name__}: {e}" for e in chain)
    root = exc if oom_cause is not None else chain[-1]
    oom = oom_cause is not None
    comms = not oom and (
        isinstance(exc, (dist.DistBackendError, dist.DistNetworkError))
        or any(marker in text for marker in COMMS_ERROR_TEXTS)
    )
    first_line = " ".join(f"{type(root).__name__}: {root}".split())[:500]
    return {
        "rank": rank,
        "kind": "oom" if oom else "error",
        "message": first_line,
        "comms": comms,
        "bytes_requested": requested_bytes(exc) if oom else None,
        "at": time.time(),
        "where": _user_frame(exc),
    }


def _chain(exc: BaseException) -> list[BaseException]:
    chain = [exc]
    while (nxt := chain[-1].__cause__ or chain[-1].__context__) is not None and len(chain) < 8:
        chain.append(nxt)
    return chain


def _user_frame(exc: BaseException) -> str | None:
    """The innermost frame outside torch and autotune: where the user's code raised."""
    where = None
    for link in reversed(_chain(exc)):
        for frame in traceback.extract_tb(link.__traceback__):
            if TORCH_PATH not in frame.filename and "/autotune/" not in frame.filename:
                where = f"{frame.filename}:{frame.lineno}"
        if where:
            return where
    return where


def _die_with_parent(parent_pid: int | None) -> None:
    """Linux: SIGKILL this rank when the fork server (and so the tuner) dies, so no rank outlives a killed tuner."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent_pid if parent_pid is not None else os.getppid() == 1:
        os._exit(1)  # the parent died before prctl took effect
    # multiprocessing hands every fork-server child the write end of the server's "tuner alive" pipe; while a
    # rank held it, the server would never see the tuner die, never exit, and so never trigger PDEATHSIG.
    server.close_alive_pipe()
