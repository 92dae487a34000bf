"""The search: an Optuna study that asks for candidates, prunes by simulation, runs real trials and re-measures the
leaders before choosing.

    ask ──▶ candidate ──▶ simulate ──┬─ cannot fit / cannot win ──▶ tell PRUNED (reason kept)
                                     ├─ measured before ──────────▶ tell the same value (no launch)
                                     └─ launch a real trial ──────▶ tell COMPLETE (ok, oom) or FAIL (error, timeout)
    ... budget spent ──▶ re-run the top candidates side by side ──▶ best median wins

Every trial is persisted (default: SQLite under .autotune/) with its candidate and outcome as user attributes, so a
search resumes after Ctrl-C or a crash with nothing lost, and the report rebuilds everything from the storage.
Several searches (workers) can share one study (autotune.shared_study): each decides on the whole study's records,
claims a candidate before launching it (autotune.study_storage.claim) and beats while it runs.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Protocol

import optuna

from autotune.candidate import (
    DATA_PARALLEL_MODES,
    Candidate,
    DataParallelMode,
    Measurement,
    Precision,
    WireDtype,
    uniform_split,
)
from autotune.costs import Profile
from autotune.errors import ClusterError, InvalidCandidateError, UsageError
from autotune.link_fit import LinkFit, fit_link, fitted_predictor, measured_steps, with_fit
from autotune.model_file import ModelSpec
from autotune.placement import RankOrder
from autotune.plan import PlannedCandidate
from autotune.records import (
    Leader,
    Outcome,
    SearchResult,
    TrialRecord,
    leaders_of,
    remeasured_by,
    summarize,
)
from autotune.schedules import SYNCHRONOUS_SCHEDULES, Schedule
from autotune.search_space import SearchSpace
from autotune.shared_study import SharedStudy, load_entries, load_records, load_workers, open_shared_study
from autotune.simulate import Estimate, LinkModel, Predictor
from autotune.study_storage import (
    CANDIDATE,
    CANDIDATE_KEY,
    GRACE_PERIOD_S,
    HEARTBEAT_INTERVAL_S,
    LAUNCHED,
    MEASUREMENT,
    OUTCOME,
    PHASE,
    PREDICTED,
    REASON,
    STUDY_PROFILE,
    STUDY_SETUP,
    Heartbeat,
    StudyStorage,
    claim,
    default_worker,
    open_storage,
    predicted_attrs,
    record_from_attrs,
    storage_error,
    trial_id,
)
from autotune.trial import TrialOptions, TrialRunner, run_trial
from autotune.trial.launch import trial_timeout_s
from autotune.units import format_bytes

__all__ = ["SearchOptions", "SearchReporter", "load_records", "load_search", "rule_of_thumb", "run_search"]

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
    resume: bool = False
    seed: int = 0
    schedules: tuple[Schedule, ...] = SYNCHRONOUS_SCHEDULES
    layouts: tuple[tuple[int, int], ...] | None = None
    """(pp, dp) pairs; None: every pp x dp = gpus that the model and batch allow."""
    checkpointing: tuple[bool, ...] = (False, True)
    """Activation checkpointing choices to search."""
    wire_dtypes: tuple[WireDtype, ...] = ("float32", "bfloat16")
    """dtypes between stages to search."""
    precision: Precision = "fp32"
    """Compute precision of every trial (the profile's)."""
    data_parallel_modes: tuple[DataParallelMode, ...] = DATA_PARALLEL_MODES
    """How replicas may hold their stages, searched where dp > 1: replicate, shard (FSDP2)."""
    max_shift: int = 2
    """How far the search moves each stage boundary from the balanced (or uniform) split, in layers."""
    prune_margin: float = 0.2
    """Prune a candidate predicted this much slower than the prediction for the best measured one."""
    remeasure_top: int = 3
    """Leaders re-run side by side at the end."""
    incumbent: Candidate | None = None
    """An existing config's candidate, re-measured beside the leaders (refresh without churn)."""
    trial: TrialOptions = field(default_factory=TrialOptions)
    trial_timeout_s: float | None = None
    """Every trial's bound; None: each trial's own, from its predicted step time (trial.launch.trial_timeout_s),
    in place of trial.timeout_s."""
    worker: str | None = None
    """This search's name among the searches sharing the study; its budget counts its own launches. None: the host
    name (and CUDA_VISIBLE_DEVICES)."""
    heartbeat_interval_s: int = HEARTBEAT_INTERVAL_S
    """A running trial beats this often."""
    grace_period_s: int = GRACE_PERIOD_S
    """A trial whose beat is this old is failed by whichever search looks first."""
    setup: dict[str, object] = field(default_factory=dict)
    """More of what every search of the study must agree on (multi-node: nodes, gpus_per_node), stored with it."""
    gpus_per_node: int | None = None
    """Ranks per node when trials span nodes: estimates send crossing nodes over the link's inter-node entry."""
    tensor_parallel_degrees: tuple[int, ...] = (1,)
    """tp degrees to search (layouts.tensor_parallel_degrees: the model's plan allows them, they divide the GPUs and
    fit a node); (1,): no tensor parallelism."""


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


def rule_of_thumb(n_layers: int, gpus: int, batch_size: int, precision: Precision = "fp32") -> Candidate | None:
    """What people pick by hand: one pipeline over all GPUs, uniform split, 1F1B, B/M = 4 x stages (or the nearest
    micro-batch count that divides B and is at least the stage count), at the search's precision."""
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
        precision=precision,
    )


def run_search(
    spec: ModelSpec,
    profile: Profile,
    planned: Sequence[PlannedCandidate],
    options: SearchOptions,
    *,
    study_name: str,
    storage: str | StudyStorage,
    runner: TrialRunner = run_trial,
    reporter: SearchReporter | None = None,
    link: LinkModel | None = None,
) -> SearchResult:
    """Run (or resume, or join) the study. Ctrl-C stops the running trial and returns what was found,
    interrupted=True. storage: a URL, or one opened already (open_storage)."""
    reporter = reporter or _Silent()
    predict = Predictor(profile=profile, link=link or LinkModel.for_profile(profile),
                        memory_limit_bytes=options.memory_limit_bytes, gpus_per_node=options.gpus_per_node)
    space = SearchSpace(profile, options)
    opened = storage if isinstance(storage, StudyStorage) else open_search_storage(storage, options)
    setup = {
        "model": str(spec.path),
        "split_at": list(spec.split_at) if spec.split_at else None,
        "gpus": options.gpus,
        "batch_size": options.batch_size,
        "memory_limit_bytes": options.memory_limit_bytes,
        "device": options.trial.device,
        "n_trials": options.n_trials,
        "seed": options.seed,
        # added with sharded data parallelism: written only when not what every earlier study meant
        **({"precision": options.precision} if options.precision != "fp32" else {}),
        **({"data_parallel_modes": list(options.data_parallel_modes)}
           if options.data_parallel_modes != DATA_PARALLEL_MODES else {}),
        # added with tensor parallelism, likewise
        **({"tensor_parallel_degrees": list(options.tensor_parallel_degrees)}
           if options.tensor_parallel_degrees != (1,) else {}),
        **options.setup,
        **predict.setup_entries(),
    }
    shared = open_shared_study(
        opened,
        study_name,
        resume=options.resume,
        seed=options.seed,
        worker=options.worker or default_worker(),
        setup=setup,
        profile=profile.to_dict(),
        stale_after_s=options.trial.timeout_s + options.grace_period_s + 60,
    )
    engine = _Engine(spec, profile, space, options, shared, runner, reporter, predict)
    started = time.time()
    interrupted = False
    default = rule_of_thumb(profile.n_layers, options.gpus, options.batch_size, options.precision)
    try:
        with _remember_ctrl_c(engine.ctrl_c):
            # a new study: seed it with the planner's best and the rule-of-thumb default
            shared.seed_once(lambda: engine.seed(planned, default))
            engine.explore(deadline=started + options.timeout_s if options.timeout_s else None)
            engine.remeasure_leaders()
    except KeyboardInterrupt:
        interrupted = True
    shared.refresh()
    summary = summarize(engine.records, engine.runs)
    side_by_side = shared.remeasured_here()
    chosen_by = None
    if shared.shared_by_others() and len(leaders_of(side_by_side)) >= 2:
        # Several workers' runs: the leaders come from the whole study, the choice from the runs this worker took of
        # them side by side on its own hardware (another worker's machine may be faster or noisier).
        summary = summarize(engine.records, side_by_side)
        chosen_by = shared.owner.worker
        reporter.phase(f"choosing among the {len(summary.leaders)} leaders by this worker's side-by-side re-runs")
    return SearchResult.of(
        summary,
        study_name=study_name,
        storage=opened.masked,
        records=engine.records,
        best_estimate=engine.estimate(summary.best.candidate) if summary.best else None,
        wall_time_s=time.time() - started,
        interrupted=interrupted,
        default=default,
        setup=setup,
        workers=shared.workers(),
        chosen_by=chosen_by,
        link_fit=engine.fit,
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


def open_search_storage(url: str, options: SearchOptions) -> StudyStorage:
    """The search's storage, opened first (before profiling: a bad URL fails in a second, not after minutes)."""
    return open_storage(url, heartbeat_interval_s=options.heartbeat_interval_s, grace_period_s=options.grace_period_s)


ANNOUNCE_STEP = 0.05
"""A fitted compute slowdown this far from the last one announced gets a progress line."""


def remeasure_reserve(n_trials: int, top: int) -> int:
    """Trials kept from exploring for re-running the leaders side by side: a third of the budget, up to two rounds
    of the top; a quarter, up to one round, of a budget under 6. The planner's seeds held the side-by-side best in
    each of 24 searches of three bench models (bench/results/choice_rule.md); where searches missed it was in the
    choice among leaders 4 % apart, a step's noise on a busy machine."""
    if n_trials >= 6:
        return min(2 * top, n_trials // 3)
    return min(top, n_trials // 4)


MIN_IDLE_ASKS = 10
"""Asks that run nothing a search allows itself before it stops exploring, whatever its budget (a 3-trial search
stopped after 3 pruned asks, leaving its budget to re-runs)."""


class _Engine:
    """The ask / prune / run / tell loop over one study."""

    def __init__(
        self,
        spec: ModelSpec,
        profile: Profile,
        space: SearchSpace,
        options: SearchOptions,
        shared: SharedStudy,
        runner: TrialRunner,
        reporter: SearchReporter,
        predict: Predictor,
    ) -> None:
        self.spec, self.profile, self.space, self.options = spec, profile, space, options
        self.shared, self.study = shared, shared.study
        self.runner, self.reporter, self.predict = runner, reporter, predict
        self.given = predict
        """The predictor the search started with; self.predict is it with the compute slowdown fitted to the
        study's runs (autotune.link_fit)."""
        self.fit: LinkFit | None = None
        self._fitted_on: list[tuple[Candidate, float]] = []
        """The measured steps the last fit was made on (the fit is redone only when they change)."""
        self._announced = (predict.link.compute_slowdown, 1.0)
        """The slowdown and the factor on the rank-side costs the last progress line gave (a re-run moves the fit by a
        point or two: not worth a line)."""
        self._estimates: dict[str, Estimate] = {}
        self.ctrl_c = [False]
        """Set by a Ctrl-C, so that one Python swallowed still stops the search before its next trial."""

    # --- bookkeeping ---------------------------------------------------------------------------------------------

    @property
    def records(self) -> list[TrialRecord]:
        """The whole study's records (every worker's), as of the last refresh."""
        return self.shared.records

    @property
    def runs(self) -> dict[str, list[Measurement]]:
        """The whole study's real runs by candidate key, as of the last refresh."""
        return self.shared.runs

    @property
    def launched(self) -> int:
        """Real runs this search launched: what its budget counts."""
        return self.shared.own_launched()

    def estimate(self, candidate: Candidate) -> Estimate:
        if candidate.key not in self._estimates:
            self._estimates[candidate.key] = self.predict(candidate)
        return self._estimates[candidate.key]

    def refit(self) -> None:
        """Fit the compute slowdown to what the study has measured so far (autotune.link_fit) and predict with it
        from now on: pruning and the order of the leaders rest on the predictions, and how much slower the profile's
        blocks run inside a trial differs from model to model and machine to machine. Says so when it changes."""
        steps = measured_steps(self.records)
        if steps == self._fitted_on:
            return
        self._fitted_on = steps
        fit = fit_link(self.given, steps)
        if fit is None:
            return
        predict = with_fit(self.given, fit)
        if predict.link != self.predict.link:
            self.predict = predict
            self._estimates.clear()
        announced = (fit.compute_slowdown, fit.overhead_scale)
        if max(abs(a - b) for a, b in zip(announced, self._announced)) >= ANNOUNCE_STEP or (
                fit.moved != (self._announced != (self.given.link.compute_slowdown, 1.0))):
            self._announced = announced
            self.reporter.phase(
                f"predictions fitted to {fit.trials} measured candidates: {fit.describe()}; mean step-time error "
                f"{fit.error_before:.0%} -> {fit.error_after:.0%}" if fit.moved else
                f"predictions with {fit.trials} measured candidates: compute back to x{1 + fit.given_slowdown:.2f} "
                f"the profile's (no other slowdown, and no factor on the per-action costs, lowers their mean error "
                f"of {fit.error_before:.0%} by 2 points)")
        self.fit = fit

    def best_record(self) -> TrialRecord | None:
        """The leader (the fastest median over its runs: leaders_of) as its last ok record with that median's step
        time and throughput: what the progress bar shows as best and what pruning measures against. One lucky run
        does not lead (a noisy host ran the same config at 104 and 76 samples/s), and the bar agrees with the final
        table."""
        leaders = self.leaders()
        if not leaders:
            return None
        lead = leaders[0]
        last = next((r for r in reversed(self.records) if r.outcome == "ok" and r.candidate is not None
                     and r.candidate.key == lead.candidate.key), None)
        if last is None:
            return None
        return replace(last, step_time_ms=lead.step_time_ms,
                       throughput_samples_per_s=lead.candidate.global_batch_size / (lead.step_time_ms / 1000))

    def _budget_left(self) -> int:
        return self.options.n_trials - self.launched

    # --- phases --------------------------------------------------------------------------------------------------

    def seed(self, planned: Sequence[PlannedCandidate], default: Candidate | None) -> None:
        """Enqueue the rule-of-thumb default and the planner's best distinct feasible candidates. Where a layout
        spans nodes with pipelines and replicas, the planner's best such candidate comes first, in both rank orders
        (phase "rank-order", not pruned by prediction): the planner chose its order by a link model, the search
        measures both. The planner's best of each kind of parallelism (pipeline, pipeline + FSDP, FSDP, data
        parallel) not among the seeds follows (phase "parallelism", not pruned by prediction unless it cannot fit):
        the report answers "pipeline or FSDP?" from runs. Tensor parallel is such a kind too (any pp x dp with
        tp > 1)."""
        seeds: list[tuple[Candidate, str]] = []
        if default is not None:
            seeds.append((default, "default"))
        if self.options.incumbent is not None:
            seeds.append((self.options.incumbent, "incumbent"))
        n_seeds = max(2, self.options.n_trials // 3)
        askable = [p.candidate for p in planned if p.estimate.feasible and self.space.params_for(p.candidate)]
        spanning = next((c for c in askable if self.space.orders_matter(c.pipeline_degree, c.data_parallel_degree,
                                                                         c.tensor_parallel_degree)), None)
        if spanning is not None:
            other: RankOrder = "dp-inner" if spanning.rank_order == "pp-inner" else "pp-inner"
            seeds += [(spanning, "rank-order"), (replace(spanning, rank_order=other), "rank-order")]
        # the planner's best that this search can ask (its layouts, schedules, choices), and right after the very
        # best, the planner's best of each other kind of parallelism (not pruned by prediction): the report answers
        # "pipeline or FSDP?" from runs, whatever the budget
        seeds += [(c, "seed") for c in askable[:1]]
        kinds = {c.parallelism for c, _ in seeds}
        for c in askable:
            if c.parallelism not in kinds:
                kinds.add(c.parallelism)
                seeds.append((c, "parallelism"))
        seeds += [(c, "seed") for c in askable[1:n_seeds]]
        seen: set[str] = set()
        for candidate, phase in seeds:
            params = self.space.params_for(candidate)
            if params is None or candidate.key in seen:
                log.debug("seed %s lies outside the search space", candidate.key)
                continue
            seen.add(candidate.key)
            self.study.enqueue_trial(params, user_attrs={PHASE: phase}, skip_if_exists=True)

    def explore(self, deadline: float | None) -> None:
        """Ask, prune or run until the budget (less the leaders' re-runs) is spent. Asks that run nothing (candidates
        pruned by simulation, repeats of a measured one) are cheap but not free: at most max(n_trials, MIN_IDLE_ASKS)
        of them, and the sampler is stopped once it proposes max(5, n_trials // 2) repeats with no new run between
        them: it only repeats what it knows."""
        reserve = remeasure_reserve(self.options.n_trials, self.options.remeasure_top)
        idle = repeats = 0
        max_idle = max(self.options.n_trials, MIN_IDLE_ASKS)
        patience = max(5, self.options.n_trials // 2)
        then = f", then {reserve} re-run{'s' if reserve != 1 else ''} of the leaders side by side" if reserve else ""
        self.reporter.phase(f"searching: up to {self.options.n_trials - reserve} trial runs{then}")
        self.refit()  # a resumed or joined study has runs already
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

    def _one_trial(self, params: dict[str, object] | None = None, phase: str | None = None) -> TrialRecord:
        """Ask one trial (with params: exactly them), prune or run it, tell the study; its record."""
        if self.ctrl_c[0]:
            raise KeyboardInterrupt
        trial = self.shared.ask(params, phase=phase)
        self.shared.refresh()  # decide on the whole study: other searches may have run or be running candidates
        phase = trial.user_attrs.get(PHASE, "explore")
        try:
            candidate = self.space.suggest(trial)
        except InvalidCandidateError as exc:
            return self._tell(trial, "pruned", f"invalid: {exc}", phase=phase)
        trial.set_user_attr(CANDIDATE, candidate.to_dict())
        estimate = self.estimate(candidate)
        trial.set_user_attr(PREDICTED, predicted_attrs(estimate))
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
        if not self.profile.fits_micro_batch(candidate.micro_batch_size):
            too_small = self.profile.too_small_micro_batch_sizes
            if too_small and candidate.micro_batch_size <= too_small[-1]:
                return (f"micro-batch size {candidate.micro_batch_size}: the model failed to train at "
                        f"{too_small[-1]} while profiling")
            return (
                f"micro-batch size {candidate.micro_batch_size}: a single block ran out of memory at "
                f"{self.profile.infeasible_micro_batch_sizes[0]} while profiling"
            )
        if limit is not None and not estimate.feasible:
            peak = max(estimate.peak_memory_bytes)
            return f"predicted peak {format_bytes(peak)} > limit {format_bytes(limit)}"
        if phase in ("default", "incumbent", "remeasure", "rank-order", "parallelism"):
            return None
        best = self.best_record()
        if best is None or best.candidate is None:
            return None
        best_predicted = self.estimate(best.candidate).throughput_samples_per_s
        if estimate.throughput_samples_per_s < best_predicted * (1 - self.options.prune_margin):
            return (
                f"predicted {estimate.throughput_samples_per_s:.0f} samples/s, over "
                f"{self.options.prune_margin:.0%} below the {best_predicted:.0f} predicted for the best measured "
                f"candidate"
            )
        return None

    def _launch(self, trial: optuna.Trial, candidate: Candidate, phase: str) -> TrialRecord:
        # Atomically across searches: not while another runs it, nor (outside re-measurement) once one measured it.
        refused = claim(self.shared.storage, self.study, trial, candidate.key, remeasure=phase == "remeasure")
        if refused is not None:
            self.shared.refresh()
            previous = self.runs.get(candidate.key)
            if previous and phase != "remeasure":
                return self._tell(trial, "duplicate", f"{refused}: not launched again", measurement=previous[-1],
                                  phase=phase)
            record = self._tell(trial, "pruned", f"{refused} now: not launched twice at once", phase=phase)
            if phase == "remeasure":
                time.sleep(0.5)  # a leader another search runs now: give it time before asking again
            return record
        bf16 = candidate.wire_dtype == "bfloat16"  # measure its gradient error against float32 between stages
        options = replace(self.options.trial, measure_wire_error=True) if bf16 else self.options.trial
        bound = self.options.trial_timeout_s or trial_timeout_s(options, self.estimate(candidate).step_time_ms / 1000)
        options = replace(options, timeout_s=bound)
        try:
            with Heartbeat(self.shared.storage, trial_id(self.shared.storage.optuna, self.study, trial)):
                measurement = self.runner(self.spec, candidate, options)
        except KeyboardInterrupt:
            self._tell(trial, "interrupted", "stopped by Ctrl-C", phase=phase)
            raise
        except ClusterError as exc:  # a node of a multi-node trial is gone: the trial failed, the search stops
            self._tell(trial, "error", str(exc), phase=phase)
            raise
        reason = measurement.error.message if measurement.error else ""
        if measurement.error and measurement.error.rank is not None:
            node = "" if measurement.error.node is None else f"node {measurement.error.node} "
            reason = f"{node}rank {measurement.error.rank}: {reason}"
        record = self._tell(trial, measurement.status, reason, measurement=measurement, phase=phase)
        if measurement.status == "ok":
            self.refit()
        return record

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
        try:
            self._store_outcome(trial, outcome, reason, measurement, phase)
        except optuna.exceptions.UpdateFinishedTrialError:
            # This search stalled past the grace period and another one failed the trial (its heartbeat lapsed).
            self.reporter.phase(f"trial {trial.number} was failed by another search while this one stalled: its "
                                f"result ({outcome}) is lost")
            self.shared.refresh()
            return record_from_attrs(trial.number, trial.user_attrs)
        # The live record is the one a resumed search or a report rebuilds from storage, by construction.
        record = record_from_attrs(trial.number, trial.user_attrs)
        self.shared.refresh()
        self.reporter.trial(record, self.best_record(), self.launched, self.options.n_trials)
        return record

    def _store_outcome(
        self, trial: optuna.Trial, outcome: Outcome, reason: str, measurement: Measurement | None, phase: str
    ) -> None:
        trial.set_user_attr(OUTCOME, outcome)
        trial.set_user_attr(REASON, reason)
        trial.set_user_attr(PHASE, phase)
        if measurement is not None:
            trial.set_user_attr(MEASUREMENT, measurement.to_dict())
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

    def remeasure_leaders(self) -> None:
        """Re-run the top candidates one after another (interleaved with each other), so the final choice compares
        runs taken close together in time on the same noisy machine, until the budget is spent (a last round that
        the budget cuts short re-runs the best-ranked)."""
        ranked = self.leaders()
        top = [leader.candidate for leader in ranked[: self.options.remeasure_top]]
        favourite = self._favourite(ranked, top)
        if favourite is not None:  # second in line: a budget that cuts the last round short keeps it
            top.insert(1, favourite)
        incumbent = self.options.incumbent
        if incumbent is not None and incumbent.key in self.runs and incumbent.key not in {c.key for c in top}:
            top.append(incumbent)
        if len(top) < 2 or self._budget_left() <= 0:
            return
        also = f", with {favourite.key}: predicted faster than the measured leaders" if favourite is not None else ""
        left = self._budget_left()
        which = (f"the {len(top)} leaders" if left >= len(top) else  # the round the budget cuts short: best first
                 f"the first {left} of the {len(top)} leaders (the runs left)")
        self.reporter.phase(f"re-measuring {which} side by side{also}")
        asks, max_asks = 0, 4 * left + 10  # a leader another search runs is refused, not waited on
        while self._budget_left() > 0 and asks < max_asks:
            launched = self.launched
            for candidate in top:
                if self._budget_left() <= 0:
                    break
                params = self.space.params_for(candidate)
                if params is None:
                    continue
                asks += 1
                self._one_trial(params, phase="remeasure")
            if self.launched == launched and not self._running_elsewhere(top):
                break  # none of them can be re-run here (outside the space, or pruned), and no other search runs one

    def _favourite(self, ranked: list[Leader], top: list[Candidate]) -> Candidate | None:
        """The measured candidate outside the top that the simulator (fitted to the study's runs) predicts faster
        than every one in it, if any: one run is noisy (a trial's steps on a busy machine spread 10-30 %), and a
        candidate whose single run came out slow is otherwise never run again (bench/results/tuning_tail_heavy7.md:
        GPipe m1, 9.6 ms side by side, left out after one run of 11.5 ms)."""
        if len(top) < 2:
            return None
        keys = {c.key for c in top}
        rest = [leader.candidate for leader in ranked if leader.candidate.key not in keys]
        if not rest:
            return None
        best = min(rest, key=lambda c: self.estimate(c).step_time_ms)
        if self.estimate(best).step_time_ms < min(self.estimate(c).step_time_ms for c in top):
            return best
        return None

    def _running_elsewhere(self, top: list[Candidate]) -> bool:
        """Another search of the study is running one of these candidates now."""
        keys = {c.key for c in top}
        running = self.study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,))
        return any(t.user_attrs.get(CANDIDATE_KEY) in keys and t.user_attrs.get(LAUNCHED) for t in running)

    def leaders(self) -> list[Leader]:
        return leaders_of(self.runs)


def load_search(
    storage: str, study_name: str, *, worker: str | None = None, config: Candidate | None = None
) -> tuple[SearchResult, Profile]:
    """A finished (or interrupted) search as stored: its result (with the setup it stored: model, gpus, batch_size,
    memory_limit_bytes, device, n_trials, seed) and the profile it planned with. For `autotune report`. A storage
    that cannot be opened or read is a StorageError (exit 2); anything else from it is a bug.

    A study several workers launched runs in: the choice is the one `worker`'s search made (its side-by-side
    re-runs of the leaders, when it took them of two or more), else that of the worker whose side-by-side choice is
    `config` (the config being reported on), else the median over every run of the study."""
    opened = open_storage(storage)
    try:
        study = optuna.load_study(study_name=study_name, storage=opened.optuna)
    except KeyError:
        raise UsageError(f"no study {study_name!r} in {opened.masked}; check --storage and --study-name") from None
    except Exception as exc:  # noqa: BLE001 - the database went away between opening and reading: the user's
        error = storage_error(exc, storage)
        if error is None:
            raise
        raise error from None
    if STUDY_PROFILE not in study.user_attrs:
        raise UsageError(f"study {study_name!r} was not written by autotune search (it has no profile)")
    profile = Profile.from_dict(study.user_attrs[STUDY_PROFILE])
    setup = dict(study.user_attrs.get(STUDY_SETUP, {}))
    entries = load_entries(study)
    records = [record for record, _ in entries]
    runs: dict[str, list[Measurement]] = {}
    for _, run in entries:
        if run is not None:
            runs.setdefault(run.candidate.key, []).append(run)
    workers = load_workers(study, entries)
    summary, chosen_by = summarize(records, runs), None
    names = [w.worker for w in workers]
    if worker is not None and workers and worker not in names:
        raise UsageError(f"no worker {worker!r} launched runs in study {study_name!r}; its workers: "
                         f"{', '.join(names)}")
    by = worker if worker is not None else next((w.worker for w in workers if config and w.choice == config), None)
    if by is not None and workers:
        side_by_side = remeasured_by(entries, by)
        if len(leaders_of(side_by_side)) >= 2:
            summary, chosen_by = summarize(records, side_by_side), by
    best = summary.best
    predict, fit = fitted_predictor(Predictor.of_setup(profile, setup), records)
    estimate = predict(best.candidate) if best else None
    result = SearchResult.of(
        summary,
        study_name=study_name,
        storage=opened.masked,
        records=records,
        best_estimate=estimate,
        wall_time_s=sum(r.wall_time_s for r in records),
        default=rule_of_thumb(profile.n_layers, int(setup.get("gpus", 1)), int(setup.get("batch_size", 1)),
                              profile.precision),
        setup=setup,
        workers=workers,
        chosen_by=chosen_by,
        link_fit=fit,
    )
    return result, profile
