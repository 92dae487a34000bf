"""Which device the ranks run on: CUDA when asked or available, the CPU stand-in only when asked."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

from autotune.errors import LaunchError

Device = Literal["cpu", "cuda"]


def resolve_device(choice: str) -> Device:
    """auto -> cuda when present; otherwise a LaunchError that says to pass --device cpu."""
    import torch

    choice = getattr(choice, "value", choice)
    if choice == "cpu":
        return "cpu"
    if torch.cuda.is_available():
        return "cuda"
    if choice == "cuda":
        raise LaunchError(
            "--device cuda asked for, but torch sees no CUDA device; pass --device cpu to use CPU processes"
        )
    raise LaunchError(
        "no CUDA device found; pass --device cpu to run each rank as a CPU process (the stand-in for a GPU)"
    )


def default_precision(device: str, model_default: str | None = None) -> str:
    """The precision of a run when --precision is not given: the model file's PRECISION, else bf16 on CUDA (how
    people train there) and fp32 on the CPU stand-in."""
    if model_default is not None:
        return model_default
    return "bf16" if device == "cuda" else "fp32"


def usable_cores() -> int:
    """The cores this process may run on (its affinity on Linux, else all)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def rank_threads(device: str, cores: int, ranks_here: int) -> int:
    """CPU threads for one rank: 1 for the CPU stand-in (one process, one thread, as one GPU); on CUDA, the rank's
    share of the machine's cores (at least 1), for the CPU-side work of building its stages and its batch."""
    if device != "cuda":
        return 1
    return max(1, cores // max(1, ranks_here))


def cpu_oversubscription(ranks: int, device: str) -> str | None:
    """A warning when CPU ranks outnumber the cores this process may use: ranks sharing a core time each other's
    contention, not the candidate. None when they fit (or on CUDA)."""
    if device != "cpu":
        return None
    cores = usable_cores()
    if ranks <= cores:
        return None
    return (
        f"{ranks} CPU ranks on {cores} core(s): ranks will share cores, so the measurements compare contention, not "
        f"configurations; pass --gpus {cores} or fewer for meaningful timings"
    )


CUDA_RESERVED_BYTES = 2 * 2**30
"""GPU memory a rank uses outside torch's caching allocator, which max_memory_allocated does not see: the CUDA
context and NCCL's buffers (NCCL_BUFFSIZE, 4 MiB, per channel and peer, for each of the pipeline and data-parallel
groups). Measured on an H200 (torch 2.11, CUDA 13; bench/results/cuda_first_run.md): the context 0.51 GiB, with a
one-rank NCCL communicator 1.15 GiB; a rank's peers add buffers, not measured on one GPU. cuBLAS's workspaces are
inside the allocator (Profile.device_workspace_bytes)."""

CUDA_FRAGMENTATION = 0.05
"""The share of what remains that the caching allocator holds reserved but cannot hand out (split blocks). On an
H200 with expandable segments (the trials' setting), a 170 M-parameter GPT's reserved peak was 0.2-4.5 % over its
allocated one (bench/results/cuda_first_run.md)."""


def cuda_memory_budget_bytes(total_bytes: int) -> int:
    """The default per-rank memory limit on a GPU of total_bytes: its total less CUDA_RESERVED_BYTES (at most a
    quarter of a small card) and CUDA_FRAGMENTATION of the rest. 73.3 GiB of an 80 GB H100's 79.2 GiB."""
    reserved = min(CUDA_RESERVED_BYTES, total_bytes // 4)
    return int((total_bytes - reserved) * (1 - CUDA_FRAGMENTATION))


def device_memory_bytes(device: str) -> int | None:
    """The memory one rank may use on this device by default: the first GPU's total less the headroom of
    cuda_memory_budget_bytes for cuda, None (no limit) for cpu."""
    if device != "cuda":
        return None
    import torch

    return cuda_memory_budget_bytes(int(torch.cuda.get_device_properties(0).total_memory))


CPU_MMAP_THRESHOLD_BYTES = 32 * 2**20
"""glibc's largest mmap threshold on 64-bit: blocks up to this size come from the heap and are reused."""


def keep_freed_cpu_memory() -> bool:
    """Make the CPU stand-in reuse freed memory, as CUDA's caching allocator does on a GPU. True if it took effect.

    By default glibc serves large blocks with mmap and hands them back on free, moving its threshold with the
    allocation history, so the same forward either reuses heap pages or page-faults fresh ones: four profiles of
    recipes/cnn.py spread by 45 % at the largest micro-batch, and trials swung with them. Fixing the mmap
    threshold at its maximum and never trimming the heap brought that to 8 % (bench/profile_stability.py).
    Tensors over 32 MiB are still mapped afresh. A no-op off glibc."""
    import ctypes

    m_trim_threshold, m_mmap_threshold = -1, -3
    try:
        # The interpreter's own symbols include libc's; ctypes.util.find_library would run ldconfig in a subprocess
        # in every rank.
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return bool(mallopt(m_mmap_threshold, CPU_MMAP_THRESHOLD_BYTES)) and bool(mallopt(m_trim_threshold, 2**31 - 1))


GLOO_DEVICE_THREAD = "gloo_tcp_loop"
"""The name of gloo's tcp device thread (one per process group's device), as /proc/<pid>/task/<tid>/comm reads."""


def idle_gloo_device_threads() -> int:
    """Where AUTOTUNE_GLOO_LOOP_IDLE=1 (opt-in, the CPU stand-in's trials), put this process's gloo device threads
    under SCHED_IDLE, so that a rank thread that needs the core wins it at once; how many were moved (0 where off,
    or off Linux).

    gloo's tcp device thread only try_locks a pair's mutex and returns when a post holds it, and its level-triggered
    epoll hands it the same readable socket at once: while a message arrives during a post, it spins
    (gloo/transport/tcp/pair.cc Pair::handleEvents; pytorch/gloo#246). Two CPU ranks posting to each other at once
    on a 2-core machine spin both cores, and the posting threads get one back at the scheduler's next tick (4 ms at
    CONFIG_HZ=250): 6-28 % of such posts took 2.3-4.8 ms where a post takes 0.1 (bench/gloo_cross.py), and a
    LoopedBFS m8 trial of the embedding MLP spent 13-15 ms of its 48-61 ms step in them (bench/action_trace.py).
    No GPU pays this (NCCL has no such thread), and the simulator does not model it. Under SCHED_IDLE those posts
    are gone (0 over 1 ms; LoopedBFS m8 32-34 ms), but the thread then reads incoming tensors only when a core is
    free, and whole calibrations side by side did not settle which is nearer a GPU: mlp's 24 configurations took
    ~10 % longer in two A/B rounds, the 2-block GPT's no different beyond the machine's drift (closing note of
    2026-11-28). Traced both ways in alternating rounds (bench/gloo_idle_ab.py), the threads' time is paid either
    way: in the rank's compute by default, in its waits under SCHED_IDLE (DualPipeV m8, mlp recipe: compute 1.46 ->
    1.08 x the profile's, waits +10 ms, step 63.4 -> 60.2 ms). Hence opt-in, for benchmarks. Only where gloo names
    the thread (torch 2.14.1's does, 2.11's not)."""
    if os.environ.get("AUTOTUNE_GLOO_LOOP_IDLE", "0") != "1" or not hasattr(os, "SCHED_IDLE"):
        return 0
    moved = 0
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return 0
    for tid in tasks:
        try:
            if Path(f"/proc/self/task/{tid}/comm").read_text().strip() != GLOO_DEVICE_THREAD:
                continue
            if os.sched_getscheduler(int(tid)) != os.SCHED_IDLE:
                os.sched_setscheduler(int(tid), os.SCHED_IDLE, os.sched_param(0))
            moved += 1
        except OSError:  # the thread ended, or the scheduler refused: it keeps its policy
            continue
    return moved


def return_freed_cpu_memory() -> bool:
    """Hand the heap's free memory back to the system (glibc's malloc_trim), e.g. once profiling is done: the tuner
    goes on to plan and launch ranks and should not sit on what the profiled blocks used. A no-op off glibc."""
    import ctypes

    try:
        malloc_trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return False
    malloc_trim.argtypes = [ctypes.c_size_t]
    malloc_trim.restype = ctypes.c_int
    return bool(malloc_trim(0))
