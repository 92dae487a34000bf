"""Which device the ranks run on: CUDA when asked or available, the CPU stand-in only when asked."""

from __future__ import annotations

import os
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


def usable_cores() -> int:
    """The cores this process may run on (its affinity on Linux, else all)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


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


def device_memory_bytes(device: str) -> int | None:
    """The memory one rank has on this device: the first GPU's total for cuda, None (no limit) for cpu."""
    if device != "cuda":
        return None
    import torch

    return int(torch.cuda.get_device_properties(0).total_memory)


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
