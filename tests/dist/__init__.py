"""Real multi-process tests. spawn_ranks: one forkserver process per rank, each killed past the timeout; Runs: many
pipelined jobs per launch (grad_worker.run_jobs), their results gathered by parameter name."""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import torch

if TYPE_CHECKING:
    from autotune.candidate import Candidate
    from autotune.model_file import ModelSpec


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


def load_source(folder: Path, name: str, source: str) -> ModelSpec:
    """The model file whose source a test holds in a string, written to folder/name and loaded."""
    from autotune.model_file import load_model_file

    path = folder / name
    path.write_text(source)
    return load_model_file(path)


class Runs:
    """The pipelined runs the tests compare, launched on first use: the jobs of one world size in one launch (one
    after the other, in one process group: the imports and the process start are paid once; tests/dist/
    grad_worker.py's run_jobs). A job gives each rank's first-step gradients and, with steps, its losses, parameters
    (whole), optimizer entries and lowered actions after them."""

    def __init__(self, jobs: dict[str, tuple[ModelSpec, Candidate, int]], root: Path) -> None:
        self.jobs = jobs
        self.root = root
        self.results: dict[str, list[dict[str, Any]]] = {}
        self.failed: dict[int, str] = {}

    def __getitem__(self, name: str) -> list[dict[str, Any]]:
        world = self.jobs[name][1].world_size
        if name not in self.results and world not in self.failed:
            self._launch(world)
        if name not in self.results:
            pytest.fail(f"{name}: {self.failed[world]}")
        return self.results[name]

    def _launch(self, world: int) -> None:
        from tests.dist import grad_worker

        names = [name for name, (_, c, _) in self.jobs.items() if c.world_size == world]
        store = self.root / f"world{world}"
        store.mkdir()
        jobs = []
        for name in names:
            spec, c, steps = self.jobs[name]
            (store / name).mkdir()
            jobs.append({"model": str(spec.path), "candidate": c.to_dict(), "out": str(store / name), "steps": steps})
        codes = spawn_ranks(grad_worker.run_jobs, lambda rank: (rank, world, jobs, str(store)), world, timeout=240)
        for name in names:
            spec, c, steps = self.jobs[name]
            files = [store / name / f"{'steps' if steps else 'grads'}-{rank}.pt" for rank in range(world)]
            if not all(f.exists() for f in files):
                break
            self.results[name] = [
                {"grads": torch.load(store / name / f"grads-{rank}.pt"),
                 **(torch.load(store / name / f"steps-{rank}.pt") if steps else {})}
                for rank in range(world)
            ]
        if codes != [0] * world:
            self.failed[world] = f"rank exit codes {codes} (tracebacks on stderr); jobs run in order {names}"


def gathered(ranks: list[dict[str, Any]], what: str) -> dict[str, torch.Tensor]:
    """One tensor per parameter name over all ranks; a parameter on several ranks (a replica, a tied copy) must be
    the same everywhere."""
    merged: dict[str, torch.Tensor] = {}
    for rank, result in enumerate(ranks):
        for name, tensor in result[what].items():
            if name in merged:
                torch.testing.assert_close(tensor, merged[name], rtol=1e-5, atol=1e-7,
                                           msg=f"{what} of {name} differ between ranks (rank {rank})")
            else:
                merged[name] = tensor
    return merged
