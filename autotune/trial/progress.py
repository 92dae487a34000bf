"""How far each rank of a trial got, and whom a hang is to blame on by it.

Each rank keeps three counters in a small file of the run dir (memory-mapped: one store per completed action, read
by the launcher after a timeout, however the rank is stuck):

    runs    schedule runs started (every step, warm-up included, runs the schedule once)
    inside  1 while a run is under way, 0 between runs (set-up, gradient all-reduce, optimizer, barrier)
    done    compute actions (F, B, I, W) completed in the current run, in the rank's action-list order

A waiting rank's stack says little under NCCL (it sits in torch.cuda.synchronize, outside torch.distributed), but its
progress does: follow each rank inside a run to the action it waits for,

    rank 0  F0 F1 | B0 ...    next B0 needs B0 of rank 1's stage: not done -> wait on rank 1
    rank 1  F0 |  B0 ...      next F0 needs F0 of rank 0's stage: done     -> rank 1 is stuck in its own work

and the chain ends at the culprit: a rank whose next action has its inputs (stuck in its own work: a layer, the
loss), or one that has not started the run the others wait in (stuck before or between runs). Nothing is decided
when no rank has completed an action of the first run (set-up and torch's shape inference exchange messages before
the first action) or when no rank is inside a run; the launcher then falls back to the stacks.
"""

from __future__ import annotations

import functools
import mmap
import struct
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from autotune.candidate import Candidate
from autotune.placement import global_rank
from autotune.schedules import Action, action_lists

_FORMAT = "<qqq"
_SIZE = struct.calcsize(_FORMAT)


def progress_path(run_dir: Path, rank: int) -> Path:
    return run_dir / f"progress-{rank}.bin"


class RankProgress:
    """The rank side: the counters, in the run dir's progress-<rank>.bin."""

    def __init__(self, path: Path) -> None:
        with open(path, "w+b") as f:
            f.write(b"\0" * _SIZE)
            f.flush()
            self._map = mmap.mmap(f.fileno(), _SIZE)
        self.runs = self.inside = self.done = 0

    def _write(self) -> None:
        struct.pack_into(_FORMAT, self._map, 0, self.runs, self.inside, self.done)

    def run_started(self) -> None:
        self.runs, self.inside, self.done = self.runs + 1, 1, 0
        self._write()

    def run_ended(self) -> None:
        self.inside = 0
        self._write()

    def action_done(self) -> None:
        self.done += 1
        self._write()


def read_progress(run_dir: Path, rank: int) -> tuple[int, int, int] | None:
    """(runs, inside, done) of a rank, None when it wrote none."""
    try:
        data = progress_path(run_dir, rank).read_bytes()
    except OSError:
        return None
    return tuple(struct.unpack(_FORMAT, data[:_SIZE])) if len(data) >= _SIZE else None  # type: ignore[return-value]


def track(schedule: Any, stages: list[Any], progress: RankProgress, compute_methods: tuple[str, ...]) -> None:
    """Count this rank's runs of `schedule` and the compute actions its `stages` complete (torch's schedules call
    one of compute_methods per action)."""

    def counted(method: Callable[..., Any], after: Callable[[], None]) -> Callable[..., Any]:
        @functools.wraps(method)
        def call(*args: Any, **kwargs: Any) -> Any:
            result = method(*args, **kwargs)
            after()
            return result

        return call

    for stage in stages:
        for name in compute_methods:
            setattr(stage, name, counted(getattr(stage, name), progress.action_done))
    step = schedule.step

    @functools.wraps(step)
    def run(*args: Any, **kwargs: Any) -> Any:
        progress.run_started()
        result = step(*args, **kwargs)
        progress.run_ended()
        return result

    schedule.step = run


@dataclass(frozen=True)
class HangCulprit:
    rank: int
    """Global rank."""
    why: str
    """What its progress says, after "it": "was stuck in its own work (step 3, ...: 0 of 4 actions done, the next,
    1F0, has its inputs)" or "had not started step 3, which the others wait in (...)"."""


def hang_culprit(
    candidate: Candidate, progress: Mapping[int, tuple[int, int, int]], prefer: Callable[[int], bool] = lambda r: False
) -> HangCulprit | None:
    """The rank the others wait on, by progress (module docstring); None when progress cannot tell. Where chains
    end at several ranks (one may wait on a send to another that is stuck), the lowest one `prefer`s (the launcher:
    stuck outside torch.distributed by its stack), else the lowest."""
    pp, dp, order = candidate.pipeline_degree, candidate.data_parallel_degree, candidate.rank_order
    lists = action_lists(candidate.schedule, pp, candidate.n_microbatches, candidate.n_stages)
    where = _positions(tuple(tuple(a) for a in lists))
    stage_owner = {a.stage: p for p, actions in enumerate(lists) for a in actions}
    found: dict[int, str] = {}
    tp = candidate.tensor_parallel_degree
    for d, t in ((d, t) for d in range(dp) for t in range(tp)):  # each tp rank of a stage runs its own schedule
        ranks = [global_rank(p, d, pp, dp, order) * tp + t for p in range(pp)]
        if any(r not in progress for r in ranks):
            continue
        state = {p: progress[r] for p, r in enumerate(ranks)}
        first_run_unstarted = all(runs <= 1 and done == 0 for runs, _, done in state.values())
        for p, (_, inside, done) in state.items():
            if not inside or done >= len(lists[p]):
                continue
            culprit = _follow(p, lists, where, stage_owner, state, first_run_unstarted)
            if culprit is not None:
                q, why = culprit
                found.setdefault(ranks[q], why)
    if not found:
        return None
    rank = min(found, key=lambda r: (not prefer(r), r))
    return HangCulprit(rank=rank, why=found[rank])


def _follow(
    p: int,
    lists: list[list[Action]],
    where: dict[tuple[int, str, int], tuple[int, int]],
    stage_owner: dict[int, int],
    state: dict[int, tuple[int, int, int]],
    first_run_unstarted: bool,
) -> tuple[int, str] | None:
    """From pipeline rank p (inside a run), the chain of waits to its end: (pipeline rank, why) or None."""
    seen = set()
    while p not in seen:
        seen.add(p)
        runs, inside, done = state[p]
        run = runs - 1
        action = lists[p][done]
        need = _needs(action, stage_owner, p, where)
        if need is None:
            if first_run_unstarted:
                return None
            return p, _own_work(run, done, len(lists[p]), action)
        q, index = where[need]
        q_runs, q_inside, q_done = state[q]
        q_run = q_runs - 1
        completed = q_run > run or (q_run == run and (not q_inside or q_done > index))
        if completed:
            if first_run_unstarted:
                return None
            return p, _own_work(run, done, len(lists[p]), action)
        if q_run < run or (q_run == run and not q_inside):
            # q has not started this run (q_run == run with q outside cannot be: it would have completed it)
            return q, f"had not started step {run + 1}, which the others wait in (schedule runs started: {q_runs})"
        if not q_inside:
            return None
        p = q
    return None  # a cycle: not a valid schedule's state


def _own_work(run: int, done: int, total: int, action: Action) -> str:
    return (f"was stuck in its own work (step {run + 1}, warm-up included: {done} of {total} actions done, the next, "
            f"{action}, has its inputs)")


def _needs(action: Action, stage_owner: dict[int, int], p: int,
           where: Mapping[tuple[int, str, int], tuple[int, int]]) -> tuple[int, str, int] | None:
    """The action on another pipeline rank whose tensor `action` receives: F: F of stage s-1; B/I: B or I of
    stage s+1 (W, and neighbours on the same rank: none)."""
    if action.kind == "F":
        s = action.stage - 1
    elif action.kind in ("B", "I"):
        s = action.stage + 1
    else:
        return None
    if s not in stage_owner or stage_owner[s] == p:
        return None
    kinds = ("F",) if action.kind == "F" else ("B", "I")
    return next(((s, k, action.microbatch) for k in kinds if (s, k, action.microbatch) in where), None)


@functools.lru_cache(maxsize=64)
def _positions(lists: tuple[tuple[Action, ...], ...]) -> dict[tuple[int, str, int], tuple[int, int]]:
    """(stage, kind, micro-batch) -> (pipeline rank, index in its list)."""
    return {(a.stage, a.kind, a.microbatch): (p, i) for p, actions in enumerate(lists) for i, a in enumerate(actions)}
