"""The search: an Optuna study that asks for candidates, prunes by simulation, runs real trials and re-measures the
leaders before choosing.

    ask ──▶ candidate ──▶ simulate ──┬─ cannot fit / cannot win ──▶ tell PRUNED (reason kept)
                                     ├─ measured before ──────────▶ tell the same value (no launch)
                                     └─ launch a real trial ──────▶ tell COMPLETE (ok, oom) or FAIL (error, timeout)
    ... budget spent ──▶ re-run the top candidates side by side ──▶ best median wins

Every trial is persisted (default: SQLite under .autotune/) with its candidate and outcome as user attributes, so a
search resumes after Ctrl-C or a crash with nothing lost, and the report rebuilds everything from the storage.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
import time
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Protocol

import optuna

from autotune.candidate import Candidate, Measurement, WireDtype, uniform_split
from autotune.costs import Profile
from autotune.errors import InvalidCandidateError, UsageError
from autotune.model_file import ModelSpec
from autotune.plan import PlannedCandidate
from autotune.records import (
    Leader,
    Outcome,
    SearchResult,
    TrialRecord,
    TrialState,
    leaders_of,
    predicted_attrs,
    record_from_attrs,
    summarize,
)
from autotune.schedules import Schedule
from autotune.search_space import SearchSpace
from autotune.simulate import Estimate, LinkModel, simulate
from autotune.trial import TrialOptions, TrialRunner, run_trial
from autotune.units import format_bytes

log = logging.getLogger(__name__)



@dataclass(frozen=True, kw_only=True)
class SearchOptions:
    gpus: int
    batch_size: int
    n_trials: int = 20
    """Real trial runs to spend, leader re-measurements included."""
    timeout_s: float | None = None
    """Stop launching new trials after this long."""
    memory_limit_bytes: int | None = None
    storage: str | None = None
    """Optuna storage URL; None: sqlite under .autotune/ named after the study."""
    study_name: str | None = None
    resume: bool = False
    seed: int = 0
    schedules: tuple[Schedule, ...] = tuple(Schedule)
    layouts: tuple[tuple[int, int], ...] | None = None
    """(pp, dp) pairs; None: every pp x dp = gpus that the model and batch allow."""
    checkpointing: tuple[bool, ...] = (False, True)
    """Activation checkpointing choices to search."""
    wire_dtypes: tuple[WireDtype, ...] = ("float32", "bfloat16")
    """dtypes between stages to search."""
    max_shift: int = 2
    """How far the search moves each stage boundary from the balanced (or uniform) split, in layers."""
    prune_margin: float = 0.2
    """Prune a candidate predicted this much slower than the prediction for the best measured one."""
    remeasure_top: int = 3
    """Leaders re-run side by side at the end."""
    incumbent: Candidate | None = None
    """An existing config's candidate, re-measured beside the leaders (refresh without churn)."""
    trial: TrialOptions = field(default_factory=TrialOptions)


class SearchReporter(Protocol):
    """Progress callbacks; the CLI draws them on stderr, tests pass nothing."""

    def phase(self, text: str) -> None: ...

    def trial(self, record: TrialRecord, best: TrialRecord | None, launched: int, budget: int) -> None: ...


class _Silent:
    def phase(self, text: str) -> None:
        log.info(text)

    def trial(self, record: TrialRecord, best: TrialRecord | None, launched: int, budget: int) -> None:
        log.info("trial %d: %s %s", record.number, record.outcome, record.reason)


def default_storage(study_name: str, root: Path = Path(".autotune")) -> str:
    root.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{root / (study_name + '.db')}"


def default_study_name(model: Path, gpus: int, batch_size: int, device: str) -> str:
    return f"{model.stem}-{device}-g{gpus}-b{batch_size}"


def rule_of_thumb(n_layers: int, gpus: int, batch_size: int) -> Candidate | None:
    """What people pick by hand: one pipeline over all GPUs, uniform split, 1F1B, B/M = 4 x stages (or the nearest
    micro-batch count that divides B and is at least the stage count)."""
    pp = min(gpus, n_layers)
    if pp != gpus:
        return None
    valid = [m for m in range(pp, batch_size + 1) if batch_size % m == 0]
    if not valid:
        return None
    m = min(valid, key=lambda k: (abs(k - 4 * pp), -k))
    return Candidate(
        schedule=Schedule.ONE_F_ONE_B,
        pipeline_degree=pp,
        global_batch_size=batch_size,
        n_microbatches=m,
        layers_per_stage=uniform_split(n_layers, pp),
    )


def run_search(
    spec: ModelSpec,
    profile: Profile,
    planned: Sequence[PlannedCandidate],
    options: SearchOptions,
    *,
    study_name: str,
    storage: str,
    runner: TrialRunner = run_trial,
    reporter: SearchReporter | None = None,
    link: LinkModel | None = None,
) -> SearchResult:
    """Run (or resume) the study. Ctrl-C stops the running trial and returns what was found, interrupted=True."""
    reporter = reporter or _Silent()
    link = link or LinkModel.for_device(profile.device)
    space = SearchSpace(profile, options)
    study = _open_study(study_name, storage, options)
    setup = {
        "model": str(spec.path),
        "split_at": list(spec.split_at) if spec.split_at else None,
        "gpus": options.gpus,
        "batch_size": options.batch_size,
        "memory_limit_bytes": options.memory_limit_bytes,
        "device": options.trial.device,
        "n_trials": options.n_trials,
        "seed": options.seed,
    }
    study.set_user_attr("profile", profile.to_dict())
    study.set_user_attr("setup", setup)
    engine = _Engine(spec, profile, space, options, study, runner, reporter, link)
    started = time.time()
    interrupted = False
    default = rule_of_thumb(profile.n_layers, options.gpus, options.batch_size)
    try:
        with _remember_ctrl_c(engine.ctrl_c):
            if not engine.records:  # a new study: seed it with the planner's best and the rule-of-thumb default
                engine.seed(planned, default)
            engine.explore(deadline=started + options.timeout_s if options.timeout_s else None)
            engine.remeasure_leaders()
    except KeyboardInterrupt:
        interrupted = True
    summary = summarize(engine.records, engine.runs)
    return SearchResult.of(
        summary,
        study_name=study_name,
        storage=storage,
        records=engine.records,
        best_estimate=engine.estimate(summary.best.candidate) if summary.best else None,
        wall_time_s=time.time() - started,
        interrupted=interrupted,
        default=default,
        setup=setup,
    )


@contextlib.contextmanager
def _remember_ctrl_c(pressed: list[bool]) -> Iterator[None]:
    """Note each Ctrl-C in `pressed` as well as raising KeyboardInterrupt: one that lands in a garbage-collector
    callback is swallowed by Python ("Exception ignored in ..."), and the engine re-raises it before its next trial."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGINT)

    def handler(signum: int, frame: object) -> None:
        pressed[0] = True
        raise KeyboardInterrupt

    if previous is not signal.default_int_handler:  # someone else's handler (or ignored): leave it be
        yield
        return
    signal.signal(signal.SIGINT, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _open_study(study_name: str, storage: str, options: SearchOptions) -> optuna.Study:
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
    exists = study_name in optuna.study.get_all_study_names(storage)
    if exists and not options.resume:
        raise UsageError(
            f"study {study_name!r} already exists in {storage}; pass --resume to continue it, or --study-name with "
            f"a new name"
        )
    sampler = optuna.samplers.TPESampler(
        seed=options.seed,
        multivariate=True,
        group=True,
        n_startup_trials=5,
    )
    return optuna.create_study(
        study_name=study_name, storage=storage, sampler=sampler, direction="maximize", load_if_exists=True
    )


class _Engine:
    """The ask / prune / run / tell loop over one study."""

    def __init__(
        self,
        spec: ModelSpec,
        profile: Profile,
        space: SearchSpace,
        options: SearchOptions,
        study: optuna.Study,
        runner: TrialRunner,
        reporter: SearchReporter,
        link: LinkModel,
    ) -> None:
        self.spec, self.profile, self.space, self.options = spec, profile, space, options
        self.study, self.runner, self.reporter, self.link = study, runner, reporter, link
        self._estimates: dict[str, Estimate] = {}
        self.ctrl_c = [False]
        """Set by a Ctrl-C, so that one Python swallowed still stops the search before its next trial."""
        self.records: list[TrialRecord] = []
        self.runs: dict[str, list[Measurement]] = {}
        self._restore()

    # --- bookkeeping ---------------------------------------------------------------------------------------------

    @property
    def launched(self) -> int:
        return sum(1 for r in self.records if r.launched)

    def _restore(self) -> None:
        """Rebuild records and measurements from the storage; trials a crash left RUNNING are failed (their records
        then say the tuner died during them)."""
        for frozen in self.study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,)):
            self.study.tell(frozen.number, state=optuna.trial.TrialState.FAIL)
        self.records, self.runs = load_records(self.study)

    def estimate(self, candidate: Candidate) -> Estimate:
        if candidate.key not in self._estimates:
            self._estimates[candidate.key] = simulate(
                self.profile,
                candidate,
                link=self.link,
                memory_limit_bytes=self.options.memory_limit_bytes,
                with_timeline=False,
            )
        return self._estimates[candidate.key]

    def best_record(self) -> TrialRecord | None:
        ok = [r for r in self.records if r.outcome == "ok" and r.throughput_samples_per_s]
        return max(ok, key=lambda r: r.throughput_samples_per_s or 0.0) if ok else None

    def _budget_left(self) -> int:
        return self.options.n_trials - self.launched

    # --- phases --------------------------------------------------------------------------------------------------

    def seed(self, planned: Sequence[PlannedCandidate], default: Candidate | None) -> None:
        """Enqueue the rule-of-thumb default and the planner's best distinct feasible candidates."""
        seeds: list[tuple[Candidate, str]] = []
        if default is not None:
            seeds.append((default, "default"))
        if self.options.incumbent is not None:
            seeds.append((self.options.incumbent, "incumbent"))
        n_seeds = max(2, self.options.n_trials // 3)
        fixed = len(seeds)
        for p in planned:  # the planner's best that this search can ask (its layouts, schedules, choices)
            if len(seeds) - fixed >= n_seeds:
                break
            if p.estimate.feasible and self.space.params_for(p.candidate) is not None:
                seeds.append((p.candidate, "seed"))
        seen: set[str] = set()
        for candidate, phase in seeds:
            params = self.space.params_for(candidate)
            if params is None or candidate.key in seen:
                log.debug("seed %s lies outside the search space", candidate.key)
                continue
            seen.add(candidate.key)
            self.study.enqueue_trial(params, user_attrs={"phase": phase}, skip_if_exists=True)

    def explore(self, deadline: float | None) -> None:
        """Ask, prune or run until the budget (less the leaders' re-runs) is spent. Asks that run nothing (candidates
        pruned by simulation, repeats of a measured one) are cheap but not free: at most n_trials of them, and the
        sampler is stopped once it proposes max(5, n_trials // 2) repeats with no new run between them: it only
        repeats what it knows."""
        reserve = min(self.options.remeasure_top, max(0, self.options.n_trials // 4))
        idle = repeats = 0
        max_idle = self.options.n_trials
        patience = max(5, self.options.n_trials // 2)
        self.reporter.phase(f"searching: up to {self.options.n_trials - reserve} trial runs")
        while self._budget_left() > reserve:
            if deadline is not None and time.time() >= deadline:
                self.reporter.phase("search timeout reached: no new trials")
                break
            if idle >= max_idle or repeats >= patience:
                why = (
                    f"{repeats} repeats of measured candidates since the last new run"
                    if repeats >= patience
                    else f"{idle} candidates that run nothing new (pruned or repeats)"
                )
                self.reporter.phase(f"the sampler proposed {why}: exploring stops, the rest of the budget re-runs the "
                                    f"leaders")
                break
            record = self._one_trial()
            if record.launched:
                repeats = 0
            else:
                idle += 1
                repeats += record.outcome == "duplicate"

    def _one_trial(self) -> TrialRecord:
        """Ask one trial, prune or run it, tell the study; its record."""
        if self.ctrl_c[0]:
            raise KeyboardInterrupt
        trial = self.study.ask()
        phase = trial.user_attrs.get("phase", "explore")
        try:
            candidate = self.space.suggest(trial)
        except InvalidCandidateError as exc:
            return self._tell(trial, "pruned", f"invalid: {exc}", phase=phase)
        trial.set_user_attr("candidate", candidate.to_dict())
        estimate = self.estimate(candidate)
        trial.set_user_attr("predicted", predicted_attrs(estimate))
        reason = self._prune_reason(candidate, estimate, phase)
        if reason is not None:
            return self._tell(trial, "pruned", reason, phase=phase)
        if candidate.key in self.runs and phase not in ("remeasure",):
            previous = self.runs[candidate.key][-1]
            return self._tell(
                trial, "duplicate", "measured before: not launched again", measurement=previous, phase=phase
            )
        return self._launch(trial, candidate, phase)

    def _prune_reason(self, candidate: Candidate, estimate: Estimate, phase: str) -> str | None:
        limit = self.options.memory_limit_bytes
        if limit is not None and not estimate.feasible:
            peak = max(estimate.peak_memory_bytes)
            return f"predicted peak {format_bytes(peak)} > limit {format_bytes(limit)}"
        if phase in ("default", "incumbent", "remeasure"):
            return None
        best = self.best_record()
        if best is None or best.candidate is None:
            return None
        best_predicted = self.estimate(best.candidate).throughput_samples_per_s
        if estimate.throughput_samples_per_s < best_predicted * (1 - self.options.prune_margin):
            return (
                f"predicted {estimate.throughput_samples_per_s:.0f} samples/s, over "
                f"{self.options.prune_margin:.0%} below the best measured candidate's {best_predicted:.0f}"
            )
        return None

    def _launch(self, trial: optuna.Trial, candidate: Candidate, phase: str) -> TrialRecord:
        trial.set_user_attr("launched", True)
        bf16 = candidate.wire_dtype == "bfloat16"  # measure its gradient error against float32 between stages
        options = replace(self.options.trial, measure_wire_error=True) if bf16 else self.options.trial
        try:
            measurement = self.runner(self.spec, candidate, options)
        except KeyboardInterrupt:
            self._tell(trial, "interrupted", "stopped by Ctrl-C", phase=phase)
            raise
        self.runs.setdefault(candidate.key, []).append(measurement)
        reason = measurement.error.message if measurement.error else ""
        if measurement.error and measurement.error.rank is not None:
            reason = f"rank {measurement.error.rank}: {reason}"
        return self._tell(trial, measurement.status, reason, measurement=measurement, phase=phase)

    def _tell(
        self,
        trial: optuna.Trial,
        outcome: Outcome,
        reason: str,
        *,
        measurement: Measurement | None = None,
        phase: str = "explore",
    ) -> TrialRecord:
        """Record the outcome on the trial (candidate, prediction and launch were recorded as they happened)."""
        trial.set_user_attr("outcome", outcome)
        trial.set_user_attr("reason", reason)
        trial.set_user_attr("phase", phase)
        if measurement is not None:
            trial.set_user_attr("measurement", measurement.to_dict())
        # The live record is the one a resumed search or a report rebuilds from storage, by construction.
        record = record_from_attrs(trial.number, trial.user_attrs)
        limit = self.options.memory_limit_bytes
        State = optuna.trial.TrialState
        if outcome in ("ok", "duplicate") and measurement is not None and measurement.status == "ok":
            excess = max(measurement.peak_memory_bytes) - limit if limit else -1.0
            trial.set_constraint("memory_excess_bytes", float(excess))
            self.study.tell(trial, measurement.throughput_samples_per_s)
        elif outcome == "oom" or (outcome == "duplicate" and measurement is not None and measurement.status == "oom"):
            trial.set_constraint("memory_excess_bytes", 1.0)  # the sampler learns where memory runs out
            self.study.tell(trial, 0.0)
        elif outcome == "pruned":
            self.study.tell(trial, state=State.PRUNED)
        else:
            self.study.tell(trial, state=State.FAIL)
        self.records.append(record)
        self.reporter.trial(record, self.best_record(), self.launched, self.options.n_trials)
        return record

    def remeasure_leaders(self) -> None:
        """Re-run the top candidates one after another (interleaved with each other), so the final choice compares
        runs taken close together in time on the same noisy machine, until the budget is spent (a last round that
        the budget cuts short re-runs the best-ranked)."""
        ranked = self.leaders()
        top = [leader.candidate for leader in ranked[: self.options.remeasure_top]]
        incumbent = self.options.incumbent
        if incumbent is not None and incumbent.key in self.runs and incumbent.key not in {c.key for c in top}:
            top.append(incumbent)
        if len(top) < 2 or self._budget_left() <= 0:
            return
        self.reporter.phase(f"re-measuring the {len(top)} leaders side by side")
        while self._budget_left() > 0:
            launched = self.launched
            for candidate in top:
                if self._budget_left() <= 0:
                    break
                params = self.space.params_for(candidate)
                if params is None:
                    continue
                self.study.enqueue_trial(params, user_attrs={"phase": "remeasure"})
                self._one_trial()
            if self.launched == launched:  # none of them can be re-run here (outside the space, or pruned)
                break

    def leaders(self) -> list[Leader]:
        return leaders_of(self.runs)


_STATES: dict[optuna.trial.TrialState, TrialState] = {
    optuna.trial.TrialState.RUNNING: "running",
    optuna.trial.TrialState.COMPLETE: "complete",
    optuna.trial.TrialState.PRUNED: "pruned",
    optuna.trial.TrialState.FAIL: "fail",
}


def load_records(study: optuna.Study) -> tuple[list[TrialRecord], dict[str, list[Measurement]]]:
    """Every asked trial of a study as a record, and every real run's measurement grouped by candidate. Trials
    enqueued but never asked (WAITING: seeds or re-measurements a budget or Ctrl-C cut short) are not trials yet."""
    records: list[TrialRecord] = []
    runs: dict[str, list[Measurement]] = {}
    for frozen in study.get_trials(deepcopy=False, states=tuple(_STATES)):
        records.append(record_from_attrs(frozen.number, frozen.user_attrs, _STATES[frozen.state]))
        if "measurement" in frozen.user_attrs and frozen.user_attrs.get("launched"):
            m = Measurement.from_dict(frozen.user_attrs["measurement"])
            runs.setdefault(m.candidate.key, []).append(m)
    return records, runs


def load_search(storage: str, study_name: str) -> tuple[SearchResult, Profile]:
    """A finished (or interrupted) search as stored: its result (with the setup it stored: model, gpus, batch_size,
    memory_limit_bytes, device, n_trials, seed) and the profile it planned with. For `autotune report`."""
    try:
        study = optuna.load_study(study_name=study_name, storage=storage)
    except KeyError:
        raise UsageError(f"no study {study_name!r} in {storage}; check --storage and --study-name") from None
    if "profile" not in study.user_attrs:
        raise UsageError(f"study {study_name!r} was not written by autotune search (it has no profile)")
    profile = Profile.from_dict(study.user_attrs["profile"])
    setup = dict(study.user_attrs.get("setup", {}))
    records, runs = load_records(study)
    summary = summarize(records, runs)
    best, limit = summary.best, setup.get("memory_limit_bytes")
    estimate = simulate(profile, best.candidate, memory_limit_bytes=limit, with_timeline=False) if best else None
    result = SearchResult.of(
        summary,
        study_name=study_name,
        storage=storage,
        records=records,
        best_estimate=estimate,
        wall_time_s=sum(r.wall_time_s for r in records),
        default=rule_of_thumb(profile.n_layers, int(setup.get("gpus", 1)), int(setup.get("batch_size", 1))),
        setup=setup,
    )
    return result, profile
