"""Real multi-process tests. spawn_ranks: one forkserver process per rank, each killed past the timeout."""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable
from typing import Any


def spawn_ranks(target: Callable[..., None], args_of_rank: Callable[[int], tuple[Any, ...]], world: int, *,
                timeout: float) -> list[int | None]:
    """Start target(*args_of_rank(rank)) for every rank, wait up to timeout each, kill what is left; exit codes."""
    context = multiprocessing.get_context("forkserver")
    processes = [context.Process(target=target, args=args_of_rank(rank)) for rank in range(world)]
    for p in processes:
        p.start()
    for p in processes:
        p.join(timeout=timeout)
        if p.exitcode is None:
            p.kill()
    return [p.exitcode for p in processes]
