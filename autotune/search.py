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

import logging
import math
import statistics
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal, Protocol, cast

import optuna

from autotune.candidate import Candidate, Measurement, WireDtype, stage_bounds, uniform_split
from autotune.errors import InfeasibleError, InvalidCandidateError, UsageError
from autotune.model_file import ModelSpec
from autotune.partition import balance_for_schedule
from autotune.plan import PlannedCandidate
from autotune.profile import Profile
from autotune.schedules import Schedule, default_stages_per_rank
from autotune.simulate import Estimate, LinkModel, simulate
from autotune.trial import TrialOptions, TrialRunner, run_trial
from autotune.units import format_bytes

log = logging.getLogger(__name__)

Outcome = Literal["ok", "oom", "error", "timeout", "pruned", "duplicate", "interrupted"]
SPLIT_BASES = ("balanced", "uniform")


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


@dataclass(frozen=True, kw_only=True)
class TrialRecord:
    """One asked trial of the study, as the report and the CLI show it."""

    number: int
    candidate: Candidate | None
    outcome: Outcome
    reason: str
    throughput_samples_per_s: float | None = None
    step_time_ms: float | None = None
    peak_memory_bytes: tuple[int, ...] = ()
    predicted_throughput_samples_per_s: float | None = None
    predicted_peak_memory_bytes: tuple[int, ...] = ()
    phase: str = "explore"
    """seed (from the planner), explore (from the sampler), remeasure, incumbent."""
    launched: bool = False
    wall_time_s: float = 0.0


@dataclass(frozen=True, kw_only=True)
class Leader:
    candidate: Candidate
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
class SearchResult:
    study_name: str
    storage: str
    best: Measurement | None
    """The chosen candidate's measurement, step time = median over all its runs; None when nothing ran ok."""
    best_trial: int | None
    best_estimate: Estimate | None
    leaders: tuple[Leader, ...]
    records: tuple[TrialRecord, ...]
    launched: int
    wall_time_s: float
    interrupted: bool = False
    too_noisy: bool = False
    """The two best leaders' runs overlap: the choice between them is within noise."""
    default: Candidate | None = None
    """The rule-of-thumb candidate the report compares against."""

    @property
    def feasible(self) -> int:
        return sum(1 for r in self.records if r.outcome == "ok")


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


class SearchSpace:
    """Maps Optuna parameters to candidates and back.

    Parameters: layout ("pp2xdp1"), schedule, n_microbatches (per dp), split base (balanced | uniform), one shift per
    stage boundary in [-max_shift, max_shift] layers, activation checkpointing, wire dtype."""

    def __init__(self, profile: Profile, options: SearchOptions) -> None:
        self.profile = profile
        self.options = options
        self.n_layers = profile.n_layers
        self.layouts = list(options.layouts or self._all_layouts())
        if not self.layouts:
            raise InvalidCandidateError(
                f"no pipeline x data-parallel layout of {options.gpus} GPUs fits a {self.n_layers}-layer model with "
                f"batch size {options.batch_size}; use --gpus {min(options.gpus, self.n_layers)}"
            )
        self._balanced: dict[tuple[Schedule, int, int, int], tuple[int, ...]] = {}

    def _all_layouts(self) -> list[tuple[int, int]]:
        gpus, b = self.options.gpus, self.options.batch_size
        return [
            (gpus // dp, dp)
            for dp in range(1, gpus + 1)
            if gpus % dp == 0 and b % dp == 0 and gpus // dp <= self.n_layers
        ]

    @staticmethod
    def _layout_name(pp: int, dp: int) -> str:
        return f"pp{pp}xdp{dp}"

    def _microbatch_choices(self, dp: int) -> list[int]:
        per_replica = self.options.batch_size // dp
        return [m for m in range(1, per_replica + 1) if per_replica % m == 0]

    def balanced(self, schedule: Schedule, pp: int, dp: int, m: int) -> tuple[int, ...]:
        key = (schedule, pp, dp, m)
        if key not in self._balanced:
            micro = self.options.batch_size // (m * dp)
            costs = [c.forward_ms + c.backward_ms for c in self.profile.layer_costs(micro)]
            n_stages = pp * default_stages_per_rank(schedule)
            self._balanced[key] = balance_for_schedule(costs, schedule, pp, n_stages)
        return self._balanced[key]

    def suggest(self, trial: optuna.Trial) -> Candidate:
        """The trial's candidate; raises InvalidCandidateError for a combination that cannot run."""
        names = [self._layout_name(pp, dp) for pp, dp in self.layouts]
        pp, dp = self.layouts[names.index(trial.suggest_categorical("layout", names))]
        schedule = Schedule(trial.suggest_categorical("schedule", [s.value for s in self.options.schedules]))
        m = trial.suggest_categorical(f"n_microbatches_dp{dp}", self._microbatch_choices(dp))
        n_stages = pp * default_stages_per_rank(schedule)
        if n_stages > self.n_layers:
            raise InvalidCandidateError(
                f"{schedule.value} needs {n_stages} stages, the model has {self.n_layers} layers"
            )
        if pp == 1 and n_stages > 1:
            raise InvalidCandidateError(f"{schedule.value} splits one rank into {n_stages} stages: pointless at pp = 1")
        base_name = trial.suggest_categorical("split", list(SPLIT_BASES))
        shifts = [
            trial.suggest_int(f"shift{j}_of_{n_stages}", -self.options.max_shift, self.options.max_shift)
            for j in range(1, n_stages)
        ]
        checkpointing = trial.suggest_categorical("activation_checkpointing", list(self.options.checkpointing))
        wire = cast(WireDtype, trial.suggest_categorical("wire_dtype", list(self.options.wire_dtypes)))
        if pp == 1 and wire != "float32":
            raise InvalidCandidateError("at pp = 1 no activation crosses a rank boundary: the wire dtype is moot")
        candidate = Candidate(
            schedule=schedule,
            pipeline_degree=pp,
            data_parallel_degree=dp,
            global_batch_size=self.options.batch_size,
            n_microbatches=m,
            layers_per_stage=self._base(base_name, schedule, pp, dp, m, n_stages),
            activation_checkpointing=checkpointing,
            wire_dtype=wire,
        )
        candidate = replace(candidate, layers_per_stage=_shifted(candidate.layers_per_stage, shifts))
        candidate.validate(self.n_layers)
        return candidate

    def _base(self, name: str, schedule: Schedule, pp: int, dp: int, m: int, n_stages: int) -> tuple[int, ...]:
        if name == "uniform":
            return uniform_split(self.n_layers, n_stages)
        return self.balanced(schedule, pp, dp, m)

    def params_for(self, candidate: Candidate) -> dict[str, Any] | None:
        """Parameters that make suggest() return this candidate, or None when it lies outside the space."""
        pp, dp = candidate.pipeline_degree, candidate.data_parallel_degree
        if (
            (pp, dp) not in self.layouts
            or candidate.schedule not in self.options.schedules
            or candidate.activation_checkpointing not in self.options.checkpointing
            or candidate.wire_dtype not in self.options.wire_dtypes
        ):
            return None
        n_stages = candidate.n_stages
        for base_name in SPLIT_BASES:
            base = self._base(base_name, candidate.schedule, pp, dp, candidate.n_microbatches, n_stages)
            shifts = [b - a for a, b in zip(stage_bounds(base)[1:-1], stage_bounds(candidate.layers_per_stage)[1:-1])]
            if all(abs(s) <= self.options.max_shift for s in shifts):
                params: dict[str, Any] = {
                    "layout": self._layout_name(pp, dp),
                    "schedule": candidate.schedule.value,
                    f"n_microbatches_dp{dp}": candidate.n_microbatches,
                    "split": base_name,
                    "activation_checkpointing": candidate.activation_checkpointing,
                    "wire_dtype": candidate.wire_dtype,
                }
                params.update({f"shift{j}_of_{n_stages}": s for j, s in enumerate(shifts, start=1)})
                return params
        return None


def _shifted(split: tuple[int, ...], shifts: Sequence[int]) -> tuple[int, ...]:
    """Move each inner boundary by its shift, keeping boundaries strictly increasing (every stage >= 1 layer)."""
    bounds = stage_bounds(split)
    total, n = bounds[-1], len(split)
    moved = [0]
    for j in range(1, n):
        lo, hi = moved[-1] + 1, total - (n - j)
        moved.append(min(max(bounds[j] + shifts[j - 1], lo), hi))
    moved.append(total)
    return tuple(b - a for a, b in zip(moved, moved[1:]))


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
    study.set_user_attr("profile", profile.to_dict())
    study.set_user_attr(
        "setup",
        {
            "model": str(spec.path),
            "gpus": options.gpus,
            "batch_size": options.batch_size,
            "memory_limit_bytes": options.memory_limit_bytes,
            "device": options.trial.device,
            "n_trials": options.n_trials,
            "seed": options.seed,
        },
    )
    engine = _Engine(spec, profile, space, options, study, runner, reporter, link)
    started = time.time()
    interrupted = False
    default = rule_of_thumb(profile.n_layers, options.gpus, options.batch_size)
    try:
        if not engine.records:  # a new study: seed it with the planner's best and the rule-of-thumb default
            engine.seed(planned, default)
        engine.explore(deadline=started + options.timeout_s if options.timeout_s else None)
        engine.remeasure_leaders()
    except KeyboardInterrupt:
        interrupted = True
    leaders = engine.leaders()
    best = engine.best_measurement(leaders)
    best_record = engine.best_record()
    return SearchResult(
        study_name=study_name,
        storage=storage,
        best=best,
        best_trial=best_record.number if best_record else None,
        best_estimate=engine.estimate(best.candidate) if best else None,
        leaders=tuple(leaders),
        records=tuple(engine.records),
        launched=engine.launched,
        wall_time_s=time.time() - started,
        interrupted=interrupted,
        too_noisy=_too_noisy(leaders),
        default=default,
    )


def _too_noisy(leaders: Sequence[Leader]) -> bool:
    if len(leaders) < 2:
        return False
    a, b = leaders[0], leaders[1]
    return max(a.step_times_ms) >= min(b.step_times_ms) and a.step_time_ms * 1.02 > b.step_time_ms


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
        self.records: list[TrialRecord] = []
        self.runs: dict[str, list[Measurement]] = {}
        self._restore()

    # --- bookkeeping ---------------------------------------------------------------------------------------------

    @property
    def launched(self) -> int:
        return sum(1 for r in self.records if r.launched)

    def _restore(self) -> None:
        """Rebuild records and measurements from the storage; trials a crash left RUNNING are failed."""
        for frozen in self.study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,)):
            self.study._storage.set_trial_user_attr(frozen._trial_id, "outcome", "interrupted")
            self.study._storage.set_trial_user_attr(frozen._trial_id, "reason", "the tuner died during this trial")
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
        for p in planned:
            if p.estimate.feasible and len(seeds) < n_seeds + 1:
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
        reserve = min(self.options.remeasure_top, max(0, self.options.n_trials // 4))
        asks = 0
        max_asks = 30 * self.options.n_trials + 100
        self.reporter.phase(f"searching: up to {self.options.n_trials - reserve} trial runs")
        while self._budget_left() > reserve and asks < max_asks:
            if deadline is not None and time.time() >= deadline:
                self.reporter.phase("search timeout reached: no new trials")
                break
            asks += 1
            self._one_trial()

    def _one_trial(self) -> None:
        trial = self.study.ask()
        phase = trial.user_attrs.get("phase", "explore")
        try:
            candidate = self.space.suggest(trial)
        except InvalidCandidateError as exc:
            self._tell(trial, "pruned", f"invalid: {exc}", phase=phase)
            return
        trial.set_user_attr("candidate", candidate.to_dict())
        estimate = self.estimate(candidate)
        trial.set_user_attr("predicted", _predicted_attrs(estimate))
        reason = self._prune_reason(candidate, estimate, phase)
        if reason is not None:
            self._tell(trial, "pruned", reason, phase=phase)
            return
        if candidate.key in self.runs and phase not in ("remeasure",):
            previous = self.runs[candidate.key][-1]
            self._tell(trial, "duplicate", "measured before: not launched again", measurement=previous, phase=phase)
            return
        self._launch(trial, candidate, phase)

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

    def _launch(self, trial: optuna.Trial, candidate: Candidate, phase: str) -> None:
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
        self._tell(trial, measurement.status, reason, measurement=measurement, phase=phase)

    def _tell(
        self,
        trial: optuna.Trial,
        outcome: Outcome,
        reason: str,
        *,
        measurement: Measurement | None = None,
        phase: str = "explore",
    ) -> None:
        """Record the outcome on the trial (candidate, prediction and launch were recorded as they happened)."""
        trial.set_user_attr("outcome", outcome)
        trial.set_user_attr("reason", reason)
        trial.set_user_attr("phase", phase)
        if measurement is not None:
            trial.set_user_attr("measurement", measurement.to_dict())
        # The live record is the one a resumed search or a report rebuilds from storage, by construction.
        record = _record_from_attrs(trial.number, trial.user_attrs)
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

    def remeasure_leaders(self) -> None:
        """Re-run the top candidates one after another (interleaved with each other), so the final choice compares
        runs taken close together in time on the same noisy machine."""
        ranked = self.leaders()
        top = [leader.candidate for leader in ranked[: self.options.remeasure_top]]
        incumbent = self.options.incumbent
        if incumbent is not None and incumbent.key in self.runs and incumbent.key not in {c.key for c in top}:
            top.append(incumbent)
        if len(top) < 2 or self._budget_left() <= 0:
            return
        self.reporter.phase(f"re-measuring the {len(top)} leaders side by side")
        while self._budget_left() > 0:
            for candidate in top:
                if self._budget_left() <= 0:
                    break
                params = self.space.params_for(candidate)
                if params is None:
                    continue
                self.study.enqueue_trial(params, user_attrs={"phase": "remeasure"})
                self._one_trial()
            if self._budget_left() < len(top):
                break

    def leaders(self) -> list[Leader]:
        return leaders_of(self.runs)

    def best_measurement(self, leaders: Sequence[Leader]) -> Measurement | None:
        return best_measurement(self.runs, leaders)


def load_records(study: optuna.Study) -> tuple[list[TrialRecord], dict[str, list[Measurement]]]:
    """Every trial of a study as a record, and every real run's measurement grouped by candidate."""
    records: list[TrialRecord] = []
    runs: dict[str, list[Measurement]] = {}
    for frozen in study.get_trials(deepcopy=False):
        running = frozen.state == optuna.trial.TrialState.RUNNING
        records.append(_record_from_attrs(frozen.number, frozen.user_attrs, "interrupted" if running else None))
        if "measurement" in frozen.user_attrs and frozen.user_attrs.get("launched"):
            m = Measurement.from_dict(frozen.user_attrs["measurement"])
            runs.setdefault(m.candidate.key, []).append(m)
    return records, runs


def leaders_of(runs: dict[str, list[Measurement]]) -> list[Leader]:
    """Candidates that ran ok, fastest median first."""
    leaders = []
    for measurements in runs.values():
        ok = [m for m in measurements if m.status == "ok" and m.step_time_ms]
        if ok:
            leaders.append(Leader(candidate=ok[0].candidate, step_times_ms=tuple(m.step_time_ms for m in ok)))  # type: ignore[misc]
    return sorted(leaders, key=lambda leader: leader.step_time_ms)


def best_measurement(runs: dict[str, list[Measurement]], leaders: Sequence[Leader]) -> Measurement | None:
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


def load_search(storage: str, study_name: str) -> tuple[SearchResult, Profile, dict[str, Any]]:
    """A finished (or interrupted) search as stored: its result, the profile it planned with, and its setup
    (model, gpus, batch_size, memory_limit_bytes, device). For `autotune report` from a storage."""
    try:
        study = optuna.load_study(study_name=study_name, storage=storage)
    except KeyError:
        raise UsageError(f"no study {study_name!r} in {storage}; check --storage and --study-name") from None
    if "profile" not in study.user_attrs:
        raise UsageError(f"study {study_name!r} was not written by autotune search (it has no profile)")
    profile = Profile.from_dict(study.user_attrs["profile"])
    setup = dict(study.user_attrs.get("setup", {}))
    records, runs = load_records(study)
    leaders = leaders_of(runs)
    best = best_measurement(runs, leaders)
    ok = [r for r in records if r.outcome == "ok" and r.throughput_samples_per_s and r.candidate is not None]
    best_record = next((r for r in ok if best is not None and r.candidate == best.candidate), None)
    result = SearchResult(
        study_name=study_name,
        storage=storage,
        best=best,
        best_trial=best_record.number if best_record else None,
        best_estimate=simulate(
            profile, best.candidate, memory_limit_bytes=setup.get("memory_limit_bytes"), with_timeline=False
        )
        if best
        else None,
        leaders=tuple(leaders),
        records=tuple(records),
        launched=sum(1 for r in records if r.launched),
        wall_time_s=sum(r.wall_time_s for r in records),
        too_noisy=_too_noisy(leaders),
        default=rule_of_thumb(profile.n_layers, int(setup.get("gpus", 1)), int(setup.get("batch_size", 1))),
    )
    return result, profile, setup


def _predicted_attrs(estimate: Estimate) -> dict[str, Any]:
    return {
        "step_time_ms": estimate.step_time_ms,
        "throughput_samples_per_s": estimate.throughput_samples_per_s,
        "bubble_fraction": estimate.bubble_fraction,
        "peak_memory_bytes": list(estimate.peak_memory_bytes),
        "feasible": estimate.feasible,
    }


def _record_from_attrs(number: int, attrs: dict[str, Any], outcome: Outcome | None = None) -> TrialRecord:
    candidate = Candidate.from_dict(attrs["candidate"]) if "candidate" in attrs else None
    measurement = attrs.get("measurement") or {}
    predicted = attrs.get("predicted") or {}
    return TrialRecord(
        number=number,
        candidate=candidate,
        outcome=outcome or attrs.get("outcome", "interrupted"),
        reason=attrs.get("reason", "stopped before it finished"),
        throughput_samples_per_s=measurement.get("throughput_samples_per_s"),
        step_time_ms=measurement.get("step_time_ms"),
        peak_memory_bytes=tuple(measurement.get("peak_memory_bytes", ())),
        predicted_throughput_samples_per_s=predicted.get("throughput_samples_per_s"),
        predicted_peak_memory_bytes=tuple(predicted.get("peak_memory_bytes", ())),
        phase=attrs.get("phase", "explore"),
        launched=bool(attrs.get("launched", False)),
        wall_time_s=float(measurement.get("wall_time_s", 0.0)) if attrs.get("launched") else 0.0,
    )


def explain_infeasible(result: SearchResult, limit: int | None) -> InfeasibleError:
    """Nothing ran within the memory limit: say what would fit."""
    peaks = [
        max(r.peak_memory_bytes or r.predicted_peak_memory_bytes or (math.inf,))
        for r in result.records
        if r.candidate is not None
    ]
    if not peaks or limit is None:
        return InfeasibleError("no trial ran successfully; see the trial table (autotune report) for each reason")
    leanest = min(peaks)
    return InfeasibleError(
        f"no configuration fits the memory limit of {format_bytes(limit)} per rank; the leanest tried needs "
        f"{format_bytes(leanest)}: raise --memory-limit to at least that, or use more GPUs"
    )
