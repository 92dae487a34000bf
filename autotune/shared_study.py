"""A study as one search, or several at once, use it: opened or created under the storage's lock, each search
registered as a worker, the records re-read from the storage before each decision (so every search decides on the
whole study), and asks that hand each search the trials it queued itself.

    open_shared_study ──▶ SharedStudy ── refresh() ──▶ records, runs (every worker's), own_launched (this one's)
                               ├── ask(params?) ──▶ a trial owned by this worker (queued params: its own)
                               └── seed_once(...) ──▶ the planner's seeds, queued by the first search only
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

import optuna

from autotune.candidate import Measurement
from autotune.errors import UsageError
from autotune.records import Entry, TrialRecord, TrialState, WorkerRuns, remeasured_by, workers_of
from autotune.study_storage import (
    LAUNCHED,
    MEASUREMENT,
    OWNER,
    PHASE,
    STUDY_PROFILE,
    STUDY_SEEDED,
    STUDY_SETUP,
    STUDY_WORKERS,
    Owner,
    StudyStorage,
    reap_stale,
    record_from_attrs,
)

log = logging.getLogger(__name__)

_STATES: dict[optuna.trial.TrialState, TrialState] = {
    optuna.trial.TrialState.RUNNING: "running",
    optuna.trial.TrialState.COMPLETE: "complete",
    optuna.trial.TrialState.PRUNED: "pruned",
    optuna.trial.TrialState.FAIL: "fail",
}
SETUP_KEYS = ("gpus", "batch_size", "device", "nodes")
"""What every search of one study must agree on (the model's layer count too)."""
REAP_EVERY_S = 2.0
"""How often a search looks for trials whose search died (they stay claimed until then)."""


class SharedStudy:
    """The study, this worker, and the study's records as of the last refresh()."""

    def __init__(self, storage: StudyStorage, study: optuna.Study, owner: Owner, *, stale_after_s: float) -> None:
        self.storage, self.study, self.owner = storage, study, owner
        self.stale_after_s = stale_after_s
        self.records: list[TrialRecord] = []
        """Every asked trial of the study, any worker's, in number order."""
        self.runs: dict[str, list[Measurement]] = {}
        """Every real run's measurement of the study, grouped by candidate key, in trial order."""
        self._final: dict[int, tuple[TrialRecord, Measurement | None]] = {}
        self._entries: list[tuple[TrialRecord, Measurement | None]] = []
        self._reaped_at = 0.0
        self.refresh()

    @property
    def name(self) -> str:
        return self.study.study_name

    def own_launched(self) -> int:
        """Real runs this worker launched (trials from before workers were recorded count for every worker)."""
        return sum(1 for r in self.records if r.launched and r.worker in (None, self.owner.worker))

    def refresh(self) -> None:
        """Fail trials whose search is gone (at most every REAP_EVERY_S), then re-read the records: finished trials
        once, running ones every time. Within a grace period of a storage outage, no trial is failed for its lapsed
        heartbeat."""
        if time.monotonic() - self._reaped_at >= REAP_EVERY_S:
            # After a storage outage every search's beats lapsed alike: trust none for a grace period, until the
            # live ones have beaten again.
            reap_stale(self.storage, self.study, stale_after_s=self.stale_after_s,
                       heartbeats=not self.storage.outage.failed_within(self.storage.grace_period_s))
            self._reaped_at = time.monotonic()
        live: dict[int, tuple[TrialRecord, Measurement | None]] = {}
        for frozen in self.study.get_trials(deepcopy=False, states=tuple(_STATES)):
            if frozen.number in self._final:
                continue
            entry = record_and_run(frozen)
            (self._final if frozen.state.is_finished() else live)[frozen.number] = entry
        entries = sorted({**self._final, **live}.items())
        self._entries = [entry for _, entry in entries]
        self.records = [record for _, (record, _) in entries]
        self.runs = {}
        for _, (_, run) in entries:
            if run is not None:
                self.runs.setdefault(run.candidate.key, []).append(run)

    def shared_by_others(self) -> bool:
        """Another worker launched runs in this study (their hardware may differ from this worker's)."""
        return any(r.launched and r.worker not in (None, self.owner.worker) for r in self.records)

    def remeasured_here(self) -> dict[str, list[Measurement]]:
        """The real runs this worker took when it re-measured the leaders side by side, by candidate key."""
        return remeasured_by(self._entries, self.owner.worker)

    def workers(self) -> tuple[WorkerRuns, ...]:
        """What each worker that launched runs measured (empty while only one did)."""
        return workers_of(self._entries, _hosts(self.study))

    def ask(self, params: dict[str, Any] | None = None, *, phase: str | None = None) -> optuna.Trial:
        """A new trial owned by this worker; with params, the trial that tries exactly them (queued and asked under
        the lock, so no other search's ask takes it)."""
        with self.storage.lock(f"ask:{self.name}"):
            trial = self.study.ask() if params is None else self._ask_exactly(params, phase)
        trial.set_user_attr(OWNER, self.owner.to_dict())
        return trial

    def _ask_exactly(self, params: dict[str, Any], phase: str | None) -> optuna.Trial:
        """Queue params and take that very trial. Study.ask takes the oldest queued trial instead, which may be a
        seed no search has run yet: re-running the leaders of a 6-trial search of a Qwen2 model launched a planner
        seed in the place of the first leader's re-run, and left that re-run queued in the study."""
        user_attrs = {PHASE: phase} if phase else {}
        self.study.enqueue_trial(params, user_attrs=user_attrs or None)
        storage = self.storage.optuna
        study_id = storage.get_study_id_from_name(self.name)
        queued = self.study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.WAITING,))
        for frozen in reversed(queued):  # the newest first: this one, unless another search queued the same
            if frozen.system_attrs.get("fixed_params") != params or frozen.user_attrs != user_attrs:
                continue
            trial_id = storage.get_trial_id_from_study_id_trial_number(study_id, frozen.number)
            try:  # as Study.ask takes a queued trial: whoever moves it to RUNNING first has it
                if storage.set_trial_state_values(trial_id, state=optuna.trial.TrialState.RUNNING):
                    return optuna.Trial(self.study, trial_id)
            except optuna.exceptions.UpdateFinishedTrialError:
                continue
        return self.study.ask()

    def seed_once(self, enqueue: Callable[[], None]) -> None:
        """Run enqueue (queue the seeds) if no search of this study has: once per study, whoever starts first."""
        with self.storage.lock(f"seed:{self.name}"):
            self.refresh()
            if not self.study.user_attrs.get(STUDY_SEEDED) and not self.records:
                enqueue()
            self.study.set_user_attr(STUDY_SEEDED, True)


def check_study_name(storage: StudyStorage, name: str, *, resume: bool) -> None:
    """Refuse, before any work, a new search on a study name in use (without resume: a name reused by mistake)."""
    if not resume and name in optuna.study.get_all_study_names(storage.optuna):
        raise UsageError(_EXISTS.format(name=name, storage=storage.masked))


_EXISTS = (
    "study {name!r} already exists in {storage}; pass --resume to continue it (or to join the searches running on "
    "it), or --study-name with a new name"
)


def open_shared_study(
    storage: StudyStorage,
    name: str,
    *,
    resume: bool,
    seed: int,
    worker: str,
    setup: Mapping[str, Any],
    profile: Mapping[str, Any],
    stale_after_s: float,
) -> SharedStudy:
    """Create the study, or join it with resume (refused without: a name reused by mistake), under the storage's
    lock. This search is registered as `worker` (refused while another live search on this host has the name) and
    samples with seed + its registration index, so two workers do not ask the same sequence. A study made for
    another GPU count, batch size, device or model is refused."""
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    owner = Owner.this_process(worker)
    with storage.lock(f"study:{name}"):
        exists = name in optuna.study.get_all_study_names(storage.optuna)
        if exists and not resume:
            raise UsageError(_EXISTS.format(name=name, storage=storage.masked))
        study = optuna.create_study(study_name=name, storage=storage.optuna, direction="maximize", load_if_exists=True)
        if exists:
            _check_setup(study, setup, profile, name)
        index = _register(study, owner)
        study.sampler = optuna.samplers.TPESampler(
            seed=seed + index,
            multivariate=True,
            group=True,
            n_startup_trials=5,
            constant_liar=True,  # another search's running trials count as bad guesses: no two ask the same
        )
        study.set_user_attr(STUDY_PROFILE, dict(profile))
        study.set_user_attr(STUDY_SETUP, dict(setup))
    return SharedStudy(storage, study, owner, stale_after_s=stale_after_s)


def _check_setup(study: optuna.Study, setup: Mapping[str, Any], profile: Mapping[str, Any], name: str) -> None:
    before = study.user_attrs.get(STUDY_SETUP) or {}
    differ = [k for k in SETUP_KEYS if k in before and before.get(k) != setup.get(k)]
    layers_before = len((study.user_attrs.get(STUDY_PROFILE) or {}).get("layers", ()))
    layers_now = len(profile.get("layers", ()))
    if differ:
        was = ", ".join(f"{k} {before.get(k)}" for k in differ)
        now = ", ".join(f"{k} {setup.get(k)}" for k in differ)
        raise UsageError(
            f"study {name!r} was made for {was}, this search asks for {now}; pass the same values, or --study-name "
            f"with a new name"
        )
    if layers_before and layers_now and layers_before != layers_now:
        raise UsageError(
            f"study {name!r} was made for a model of {layers_before} layers, this one has {layers_now}; use "
            f"--study-name with a new name"
        )


def _register(study: optuna.Study, owner: Owner) -> int:
    """Record this search among the study's workers; its index (registration order) offsets the sampler's seed."""
    workers: dict[str, Any] = dict(study.user_attrs.get(STUDY_WORKERS) or {})
    previous = workers.get(owner.worker)
    if previous:
        other = Owner(worker=owner.worker, host=str(previous.get("host")), pid=int(previous.get("pid", 0)))
        if other.host == owner.host and other.pid != owner.pid and not other.gone():
            raise UsageError(
                f"another search (pid {other.pid}) works on study {study.study_name!r} as worker {owner.worker!r} on "
                f"this host; give each search its own --worker NAME"
            )
    workers[owner.worker] = {"host": owner.host, "pid": owner.pid}
    study.set_user_attr(STUDY_WORKERS, workers)
    return list(workers).index(owner.worker)


def record_and_run(frozen: optuna.trial.FrozenTrial) -> tuple[TrialRecord, Measurement | None]:
    """A stored trial's record, and its measurement when it was a real run."""
    record = record_from_attrs(frozen.number, frozen.user_attrs, _STATES[frozen.state])
    run = None
    if MEASUREMENT in frozen.user_attrs and frozen.user_attrs.get(LAUNCHED):
        run = Measurement.from_dict(frozen.user_attrs[MEASUREMENT])
    return record, run


def load_entries(study: optuna.Study) -> list[Entry]:
    """Every asked trial of a study as a record, with its measurement when it was a real run. Trials enqueued but
    never asked (WAITING: seeds or re-measurements a budget or Ctrl-C cut short) are not trials yet."""
    return [record_and_run(frozen) for frozen in study.get_trials(deepcopy=False, states=tuple(_STATES))]


def load_records(study: optuna.Study) -> tuple[list[TrialRecord], dict[str, list[Measurement]]]:
    """Every asked trial of a study as a record (load_entries), and every real run's measurement grouped by
    candidate."""
    entries = load_entries(study)
    runs: dict[str, list[Measurement]] = {}
    for _, run in entries:
        if run is not None:
            runs.setdefault(run.candidate.key, []).append(run)
    return [record for record, _ in entries], runs


def load_workers(study: optuna.Study, entries: list[Entry]) -> tuple[WorkerRuns, ...]:
    """What each worker of a stored study measured (empty for a study of one search)."""
    return workers_of(entries, _hosts(study))


def _hosts(study: optuna.Study) -> dict[str, str]:
    workers = study.user_attrs.get(STUDY_WORKERS) or {}
    return {str(name): str(info.get("host")) for name, info in workers.items() if isinstance(info, dict)}
