"""Pure: a search as data (trial records, leaders, the result) and the one rule that summarizes it, for the live
search and for one read back from its storage alike. Torch-free and Optuna-free: the report reads only this.

    records (one per asked trial) ─┐
                                   ├─ summarize ─▶ leaders (median over every run, fastest first; those
    runs (candidate -> measurements)┘                 re-run side by side ahead of the rest)
                                                    best (the fastest leader, all its runs merged)
                                                    best_trial (the first successful run of that very candidate)
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Literal

from autotune.candidate import Candidate, Measurement
from autotune.errors import InfeasibleError
from autotune.simulate import Estimate
from autotune.units import format_bytes

if TYPE_CHECKING:
    from autotune.link_fit import LinkFit

Outcome = Literal["ok", "oom", "error", "timeout", "pruned", "duplicate", "interrupted"]
TrialState = Literal["running", "complete", "pruned", "fail"]
"""A stored trial's state, as far as a record needs it (Optuna's TrialState, named in lower case)."""


@dataclass(frozen=True, kw_only=True)
class TrialRecord:
    """One asked trial of the study, as the report and the CLI show it."""

    number: int
    """Optuna's trial number."""
    candidate: Candidate | None
    """The trial's candidate; None for a combination of parameters that cannot run."""
    outcome: Outcome
    """ok, oom, error, timeout (a real run); pruned (not launched); duplicate (measured before); interrupted."""
    reason: str
    """Why it ended so (the failing rank's message, the pruning rule)."""
    throughput_samples_per_s: float | None = None
    """Measured throughput (ok runs and repeats of them)."""
    step_time_ms: float | None = None
    """Measured median step time."""
    peak_memory_bytes: tuple[int, ...] = ()
    """Measured peak memory per global rank."""
    losses: tuple[float, ...] = ()
    """Measured mean loss of every step the run trained, in order (Measurement.losses); () when not recorded."""
    predicted_throughput_samples_per_s: float | None = None
    """The simulator's throughput."""
    predicted_peak_memory_bytes: tuple[int, ...] = ()
    """The simulator's peak memory per pipeline rank."""
    phase: str = "explore"
    """seed (from the planner), explore (from the sampler), remeasure, incumbent, default, rank-order (a seed in the
    other rank order), parallelism (the planner's best of a kind of parallelism the seeds lack)."""
    launched: bool = False
    """A real run was started for it."""
    wall_time_s: float = 0.0
    """The real run's wall time, launch to teardown (0 when not launched)."""
    oom_bytes: int | None = None
    """An oom run: what the failing rank reported when it ran out (live bytes on CPU, the refused allocation on
    CUDA); None otherwise."""
    worker: str | None = None
    """The search that asked it (--worker; several can share a study); None in studies written before."""


@dataclass(frozen=True, kw_only=True)
class Leader:
    """A candidate that ran ok, with every successful run of it."""

    candidate: Candidate
    """The configuration."""
    step_times_ms: tuple[float, ...]
    """Median step time of every run of this candidate, in order."""

    @property
    def step_time_ms(self) -> float:
        return statistics.median(self.step_times_ms)

    @property
    def spread(self) -> float:
        """Relative spread (max - min) / median of its runs: how noisy its measurement is."""
        return (max(self.step_times_ms) - min(self.step_times_ms)) / self.step_time_ms


@dataclass(frozen=True, kw_only=True)
class Summary:
    """What a search found, from its records and runs (see summarize)."""

    leaders: tuple[Leader, ...]
    """Candidates that ran ok, fastest median first."""
    best: Measurement | None
    """The fastest leader's measurement, step time the median over all its runs; None when nothing ran ok."""
    best_trial: int | None
    """Number of the first successful run of the best candidate; None when nothing ran ok."""
    too_noisy: bool
    """The two best leaders' runs overlap: the choice between them is within noise."""
    launched: int
    """Records of real runs."""


@dataclass(frozen=True, kw_only=True)
class SearchResult:
    """A search, live or read back from its storage: what the CLI renders and the report is written from."""

    study_name: str
    """The Optuna study."""
    storage: str
    """Its storage URL."""
    best: Measurement | None
    """The chosen candidate's measurement, step time = median over all its runs; None when nothing ran ok."""
    best_trial: int | None
    """A trial of the chosen candidate: its first successful run."""
    best_estimate: Estimate | None
    """The chosen candidate simulated (no timeline)."""
    leaders: tuple[Leader, ...]
    """Candidates that ran ok, fastest median first."""
    records: tuple[TrialRecord, ...]
    """Every asked trial, in order."""
    launched: int
    """Real runs."""
    wall_time_s: float
    """The search's wall time (live), or its runs' summed wall time (stored)."""
    interrupted: bool = False
    """Ctrl-C stopped it before its budget was spent."""
    too_noisy: bool = False
    """The two best leaders' runs overlap: the choice between them is within noise."""
    default: Candidate | None = None
    """The rule-of-thumb candidate the report compares against."""
    setup: Mapping[str, Any] = field(default_factory=dict)
    """What the search was asked (model, gpus, batch_size, memory_limit_bytes, device, n_trials, seed), as stored."""
    workers: tuple[WorkerRuns, ...] = ()
    """A study several searches launched runs in: what each measured on its own hardware; empty for one search."""
    chosen_by: str | None = None
    """The worker whose side-by-side re-runs of the leaders chose `best`; None: the median over every run of the
    study (every worker's together when several launched runs)."""
    link_fit: LinkFit | None = None
    """The compute slowdown fitted to the study's runs (autotune.link_fit), as the search predicted with it at the
    end; None before five candidates ran."""

    @property
    def feasible(self) -> int:
        return sum(1 for r in self.records if r.outcome == "ok")

    @classmethod
    def of(
        cls,
        summary: Summary,
        *,
        study_name: str,
        storage: str,
        records: Sequence[TrialRecord],
        best_estimate: Estimate | None,
        wall_time_s: float,
        interrupted: bool = False,
        default: Candidate | None = None,
        setup: Mapping[str, Any] | None = None,
        workers: Sequence[WorkerRuns] = (),
        chosen_by: str | None = None,
        link_fit: LinkFit | None = None,
    ) -> SearchResult:
        """The result with what summarize found."""
        return cls(
            study_name=study_name,
            storage=storage,
            best=summary.best,
            best_trial=summary.best_trial,
            best_estimate=best_estimate,
            leaders=summary.leaders,
            records=tuple(records),
            launched=summary.launched,
            wall_time_s=wall_time_s,
            interrupted=interrupted,
            too_noisy=summary.too_noisy,
            default=default,
            setup=dict(setup or {}),
            workers=tuple(workers),
            chosen_by=chosen_by,
            link_fit=link_fit,
        )


@dataclass(frozen=True, kw_only=True)
class WorkerRuns:
    """What one search of a shared study measured, on its own hardware (its runs only)."""

    worker: str
    """--worker of the search."""
    host: str | None
    """The host it ran on, as it registered in the study; None when not recorded."""
    launched: int
    """Real runs it launched."""
    ok: int
    """Of those, runs that finished ok."""
    remeasured: int
    """Of those, side-by-side re-runs of the study's leaders (phase remeasure)."""
    leaders: tuple[Leader, ...]
    """Candidates it ran ok, fastest median of its own runs first."""
    choice: Candidate | None
    """The fastest median of its side-by-side re-runs, when it re-ran two or more leaders ok (what its search
    chooses once other workers ran in the study); None otherwise."""


Entry = tuple[TrialRecord, Measurement | None]
"""A stored trial's record and, for a real run, its measurement."""


def remeasured_by(entries: Sequence[Entry], worker: str) -> dict[str, list[Measurement]]:
    """The runs `worker` took when it re-measured the leaders side by side, by candidate key."""
    runs: dict[str, list[Measurement]] = {}
    for record, run in entries:
        if run is not None and record.phase == "remeasure" and record.worker == worker:
            runs.setdefault(run.candidate.key, []).append(run)
    return runs


def workers_of(entries: Sequence[Entry], hosts: Mapping[str, str] | None = None) -> tuple[WorkerRuns, ...]:
    """Per worker that launched runs, in order of its first launch, what it measured; empty when fewer than two
    workers launched runs (a study of one search)."""
    names = list(dict.fromkeys(r.worker for r, _ in entries if r.launched and r.worker is not None))
    if len(names) < 2:
        return ()
    found = []
    for name in names:
        own = [(r, run) for r, run in entries if r.launched and r.worker == name]
        runs: dict[str, list[Measurement]] = {}
        for _, run in own:
            if run is not None:
                runs.setdefault(run.candidate.key, []).append(run)
        side_by_side = leaders_of(remeasured_by(entries, name))
        found.append(WorkerRuns(
            worker=name,
            host=(hosts or {}).get(name),
            launched=len(own),
            ok=sum(1 for r, _ in own if r.outcome == "ok"),
            remeasured=sum(1 for r, _ in own if r.phase == "remeasure"),
            leaders=tuple(leaders_of(runs)),
            choice=side_by_side[0].candidate if len(side_by_side) >= 2 else None,
        ))
    return tuple(found)


def summarize(records: Sequence[TrialRecord], runs: Mapping[str, Sequence[Measurement]]) -> Summary:
    """The leaders, the best candidate and a trial of that very candidate.

    records: every asked trial; runs: every real run's measurement, grouped by candidate key, in run order.

    The best is the fastest median over all its runs among the leaders re-run side by side, when two or more were
    (phase remeasure); else among all. A candidate outside them ran once, when the re-run leaders' first runs beat
    it; its one run must not outrank them because their re-runs landed in a busier minute of the machine (a search
    on bench/models/skewed6.py chose Interleaved1F1B at 12.6 ms, run once, over GPipe re-run at 11.5 and 13.9 ms:
    8 % slower side by side)."""
    leaders = leaders_of(runs, first=side_by_side_keys(records))
    best = best_measurement(runs, leaders)
    best_trial = None
    if best is not None:
        best_trial = next(
            (r.number for r in records if r.outcome == "ok" and r.launched and r.candidate == best.candidate), None
        )
    return Summary(
        leaders=tuple(leaders),
        best=best,
        best_trial=best_trial,
        too_noisy=too_noisy(leaders),
        launched=sum(1 for r in records if r.launched),
    )


def leaders_of(runs: Mapping[str, Sequence[Measurement]], first: Collection[str] = ()) -> list[Leader]:
    """Candidates that ran ok, fastest median first; those keyed in `first` ahead of the rest when two or more of
    them ran ok (the leaders re-run side by side: see summarize)."""
    leaders = []
    for measurements in runs.values():
        ok = [m for m in measurements if m.status == "ok" and m.step_time_ms]
        if ok:
            leaders.append(Leader(candidate=ok[0].candidate, step_times_ms=tuple(m.step_time_ms for m in ok)))  # type: ignore[misc]
    ahead = {leader.candidate.key for leader in leaders} & set(first)
    if len(ahead) < 2:
        ahead = set()
    return sorted(leaders, key=lambda leader: (leader.candidate.key not in ahead, leader.step_time_ms))


def side_by_side_keys(records: Sequence[TrialRecord]) -> set[str]:
    """Candidates with a successful run taken when the leaders were re-run side by side (phase remeasure)."""
    return {r.candidate.key for r in records
            if r.candidate is not None and r.launched and r.outcome == "ok" and r.phase == "remeasure"}


def best_measurement(runs: Mapping[str, Sequence[Measurement]], leaders: Sequence[Leader]) -> Measurement | None:
    """The fastest leader's measurement with its step time the median over all its runs."""
    if not leaders:
        return None
    winner = leaders[0]
    ok = [m for m in runs[winner.candidate.key] if m.status == "ok"]
    step_ms = winner.step_time_ms
    return replace(
        ok[-1],
        step_time_ms=step_ms,
        step_times_ms=tuple(t for m in ok for t in m.step_times_ms),
        throughput_samples_per_s=winner.candidate.global_batch_size / (step_ms / 1000),
        peak_memory_bytes=tuple(max(values) for values in zip(*(m.peak_memory_bytes for m in ok))),
    )


def too_noisy(leaders: Sequence[Leader]) -> bool:
    """The fastest leader's slowest run reaches the runner-up's fastest, and their medians are within 2 %."""
    if len(leaders) < 2:
        return False
    a, b = leaders[0], leaders[1]
    return max(a.step_times_ms) >= min(b.step_times_ms) and a.step_time_ms * 1.02 > b.step_time_ms


def explain_infeasible(result: SearchResult, limit: int | None) -> InfeasibleError:
    """Nothing ran within the memory limit: say what would fit, from what the runs measured when there are any (a
    prediction can be far off the real peak), else from the simulator."""
    if limit is None:
        return InfeasibleError("no trial ran successfully; see the trial table (autotune report) for each reason")
    # An oom run ran out at its reported bytes: live bytes past the limit (CPU), or one allocation more (CUDA).
    measured = [b if b > limit else limit + b for r in result.records if r.oom_bytes for b in [r.oom_bytes]]
    measured += [max(r.peak_memory_bytes) for r in result.records if r.peak_memory_bytes]
    if measured:
        return InfeasibleError(
            f"no configuration fits the memory limit of {format_bytes(limit)} per rank; the leanest run tried needed "
            f"more than {format_bytes(min(measured))} (measured when it ran out): raise --memory-limit above that, "
            f"or use more GPUs"
        )
    peaks = [
        max(r.predicted_peak_memory_bytes or (math.inf,))
        for r in result.records
        if r.candidate is not None
    ]
    if not peaks or math.isinf(min(peaks)):
        return InfeasibleError("no trial ran successfully; see the trial table (autotune report) for each reason")
    leanest = min(peaks)
    return InfeasibleError(
        f"no configuration fits the memory limit of {format_bytes(limit)} per rank; the leanest tried needs "
        f"{format_bytes(leanest)} (predicted): raise --memory-limit to at least that, or use more GPUs"
    )
