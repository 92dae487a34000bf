"""Which device the ranks run on: CUDA when asked or available, the CPU stand-in only when asked."""

from __future__ import annotations

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


def device_memory_bytes(device: str) -> int | None:
    """The memory one rank has on this device: the first GPU's total for cuda, None (no limit) for cpu."""
    if device != "cuda":
        return None
    import torch

    return int(torch.cuda.get_device_properties(0).total_memory)
