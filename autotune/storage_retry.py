"""Riding out a storage that blinks: a server restart, a failover or a dropped connection under a running search.

    RetryingStorage ── each call ──▶ Outage.call ──┬─ answers ──────────────────────────▶ result
                                                    └─ transient error: back off, try again ─┐
                                                       (said once on stderr)  ◀──────────────┘
                                                       past AUTOTUNE_STORAGE_RETRY_S ──▶ StorageUnavailableError
                                                                                           (exit 4, resumable)

RetryingStorage is the storage object autotune hands Optuna: its public storage API (optuna.storages.BaseStorage),
each call retried as a whole over what Optuna itself makes of the RDBStorage (with its cache of finished trials), so
autotune names no private Optuna method. A transient error is a lost or refused connection (SQLAlchemy's
OperationalError / InterfaceError, an invalidated connection, Optuna's StorageInternalError around one); anything
else (bad data, a bug) is raised at once. Retrying a call whose commit the server made but whose answer the outage
lost is harmless for every call the search makes: user attributes are set again, a parameter twice is an
IntegrityError Optuna ignores, and a trial already told its state is recognised (set_trial_state_values). The pooled
connections are checked before use (SQLAlchemy's pool_pre_ping, set by open_storage), so a restarted server costs no
failed call at all when the search was not mid-query.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections.abc import Callable, Container, Sequence
from typing import Any, TypeVar

import optuna
from optuna.distributions import BaseDistribution
from optuna.study import StudyDirection
from optuna.trial import FrozenTrial, TrialState

from autotune.errors import StorageUnavailableError, UsageError

log = logging.getLogger(__name__)

RETRY_ENV = "AUTOTUNE_STORAGE_RETRY_S"
"""Seconds a search retries a storage that stopped answering before it stops (exit 4, the study resumable)."""
DEFAULT_RETRY_S = 300.0
"""The bound without RETRY_ENV: long enough for a restart or a managed database's failover."""
MAX_BACKOFF_S = 4.0
"""The longest wait between two tries: a server back is found within this long."""

T = TypeVar("T")


def retry_bound_s() -> float:
    """RETRY_ENV, else DEFAULT_RETRY_S; a value that is not a number of seconds >= 0 is a UsageError."""
    text = os.environ.get(RETRY_ENV, "").strip()
    if not text:
        return DEFAULT_RETRY_S
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not math.isfinite(value) or value < 0:
        raise UsageError(f"{RETRY_ENV}={text!r} is not a number of seconds; set it to e.g. 300, or unset it")
    return value


def is_transient(exc: BaseException) -> bool:
    """The storage's connection failed (lost, refused, reset, the server shutting down or starting up), as opposed
    to a call the storage refused for what it asked."""
    import sqlalchemy.exc

    seen = 0
    current: BaseException | None = exc
    while current is not None and seen < 8:
        if isinstance(current, sqlalchemy.exc.DBAPIError) and current.connection_invalidated:
            return True
        if isinstance(current, (sqlalchemy.exc.OperationalError, sqlalchemy.exc.InterfaceError)):
            return True
        if type(current).__name__ in ("OperationalError", "InterfaceError"):  # the driver's own (psycopg, sqlite3)
            return True
        current, seen = current.__cause__ or current.__context__, seen + 1
    return False


class Outage:
    """This process's view of its storage: answering, or failing since a moment. Shared by every thread (the search
    and its heartbeats); `call` retries a call through an outage, up to bound_s after it began."""

    def __init__(self, shown: str, *, bound_s: float, say: Callable[[str], None] | None = None) -> None:
        self.shown = shown
        """The storage's masked URL, for messages."""
        self.bound_s = bound_s
        self.say = say or log.warning
        """Where the outage and the recovery are told (the CLI: a warning on stderr)."""
        self._lock = threading.Lock()
        self._since: float | None = None
        self._last_failure = -math.inf

    def call(self, fn: Callable[[], T]) -> T:
        """fn(), again after each transient failure with a growing pause, until it answers or the outage has lasted
        bound_s (StorageUnavailableError)."""
        pause = 0.25
        while True:
            try:
                result = fn()
            except Exception as exc:
                if not is_transient(exc):
                    raise
                left = self.failed(exc)
                if left <= 0:
                    raise StorageUnavailableError(
                        f"the storage {self.shown} did not answer for {self.bound_s:.0f} s ({_first_line(exc)}); the "
                        f"study is kept: once it answers, rerun the same command with --resume to finish it (or set "
                        f"{RETRY_ENV} to wait longer)"
                    ) from None
                time.sleep(min(pause, left))
                pause = min(pause * 2, MAX_BACKOFF_S)
                continue
            self.answered()
            return result

    def failed(self, exc: BaseException) -> float:
        """Note a transient failure (the first of an outage is told); the seconds left before giving up."""
        now = time.monotonic()
        with self._lock:
            self._last_failure = now
            first = self._since is None
            if first:
                self._since = now
            since = self._since if self._since is not None else now
        if first:
            self.say(f"the storage {self.shown} does not answer ({_first_line(exc)}): retrying for up to "
                     f"{self.bound_s:.0f} s")
        log.debug("storage call failed: %s", exc)
        return since + self.bound_s - now

    def answered(self) -> None:
        """A call went through: an outage, if one was under way, is over (and told)."""
        if self._since is None:
            return
        with self._lock:
            since, self._since = self._since, None
        if since is not None:
            self.say(f"the storage {self.shown} answers again after {time.monotonic() - since:.1f} s")

    def failed_within(self, seconds: float) -> bool:
        """A call failed in the last `seconds`, or the storage is failing now."""
        return self._since is not None or time.monotonic() - self._last_failure < seconds


class RetryingStorage(optuna.storages.BaseStorage):
    """The storage object autotune hands Optuna (create_study, load_study): Optuna's public storage API, each call
    forwarded to Optuna's own storage for the database and retried through an outage (Outage.call).

        RetryingStorage ──▶ Outage.call ──▶ backend = optuna.storages.get_storage(rdb) ──▶ rdb: RDBStorage
        (public BaseStorage methods,        (what Optuna makes of an RDBStorage: its cache
         the heartbeats autotune beats)      of finished trials, Optuna's heartbeat protocol)

    Being a BaseStorage, it is used by Optuna as it is (not wrapped again); the backend keeps Optuna's cache, so
    finished trials are read once (without it a 300-trial search spent 17x the CPU time in its storage, each re-read
    of the study fetching every trial again; bench/storage_speed.py). get_storage is public (its docstring calls it
    internal to Optuna); the tests would see it go. Optuna sees no heartbeat protocol on this object (that base class
    lives in a private module): autotune beats (record_heartbeat) and fails stale trials (fail_stale_trials) itself,
    through Optuna's public calls on the backend, by the database's clock as before."""

    def __init__(self, rdb: optuna.storages.RDBStorage, *, outage: Outage) -> None:
        self.rdb = rdb
        """Optuna's RDBStorage of the database (its engine, heartbeat interval and grace period)."""
        self.backend = optuna.storages.get_storage(rdb)
        """What Optuna makes of rdb when handed it: every call goes there."""
        self.outage = outage
        self._heartbeat_studies: dict[str, optuna.Study] = {}

    def _call(self, fn: Callable[[], T]) -> T:
        return self.outage.call(fn)

    # --- optuna.storages.BaseStorage --------------------------------------------------------------------------------

    def create_new_study(self, directions: Sequence[StudyDirection], study_name: str | None = None) -> int:
        return self._call(lambda: self.backend.create_new_study(directions, study_name))

    def delete_study(self, study_id: int) -> None:
        self._call(lambda: self.backend.delete_study(study_id))

    def set_study_user_attr(self, study_id: int, key: str, value: Any) -> None:
        self._call(lambda: self.backend.set_study_user_attr(study_id, key, value))

    def set_study_system_attr(self, study_id: int, key: str, value: Any) -> None:
        self._call(lambda: self.backend.set_study_system_attr(study_id, key, value))

    def get_study_id_from_name(self, study_name: str) -> int:
        return self._call(lambda: self.backend.get_study_id_from_name(study_name))

    def get_study_name_from_id(self, study_id: int) -> str:
        return self._call(lambda: self.backend.get_study_name_from_id(study_id))

    def get_study_directions(self, study_id: int) -> list[StudyDirection]:
        return self._call(lambda: self.backend.get_study_directions(study_id))

    def get_study_user_attrs(self, study_id: int) -> dict[str, Any]:
        return self._call(lambda: self.backend.get_study_user_attrs(study_id))

    def get_study_system_attrs(self, study_id: int) -> dict[str, Any]:
        return self._call(lambda: self.backend.get_study_system_attrs(study_id))

    def get_all_studies(self) -> list[Any]:  # Optuna's FrozenStudy, which it does not export
        return self._call(self.backend.get_all_studies)

    def create_new_trial(self, study_id: int, template_trial: FrozenTrial | None = None) -> int:
        return self._call(lambda: self.backend.create_new_trial(study_id, template_trial))

    def set_trial_param(
        self, trial_id: int, param_name: str, param_value_internal: float, distribution: BaseDistribution
    ) -> None:
        self._call(lambda: self.backend.set_trial_param(trial_id, param_name, param_value_internal, distribution))

    def get_trial_id_from_study_id_trial_number(self, study_id: int, trial_number: int) -> int:
        return self._call(lambda: self.backend.get_trial_id_from_study_id_trial_number(study_id, trial_number))

    def get_trial_number_from_id(self, trial_id: int) -> int:
        return self._call(lambda: self.backend.get_trial_number_from_id(trial_id))

    def get_trial_param(self, trial_id: int, param_name: str) -> float:
        return self._call(lambda: self.backend.get_trial_param(trial_id, param_name))

    def set_trial_state_values(self, trial_id: int, state: TrialState, values: Sequence[float] | None = None) -> bool:
        tries = 0

        def once() -> bool:
            nonlocal tries
            tries += 1
            try:
                return self.backend.set_trial_state_values(trial_id, state, values)
            except optuna.exceptions.UpdateFinishedTrialError:
                # A try that the outage cut off may have committed: then the trial holds exactly what was asked.
                if tries > 1 and state.is_finished():
                    stored = self.backend.get_trial(trial_id)
                    if stored.state == state and (values is None or list(stored.values or ()) == list(values)):
                        return True
                raise

        return self._call(once)

    def set_trial_intermediate_value(self, trial_id: int, step: int, intermediate_value: float) -> None:
        self._call(lambda: self.backend.set_trial_intermediate_value(trial_id, step, intermediate_value))

    def set_trial_user_attr(self, trial_id: int, key: str, value: Any) -> None:
        self._call(lambda: self.backend.set_trial_user_attr(trial_id, key, value))

    def set_trial_system_attr(self, trial_id: int, key: str, value: Any) -> None:
        self._call(lambda: self.backend.set_trial_system_attr(trial_id, key, value))

    def get_trial(self, trial_id: int) -> FrozenTrial:
        return self._call(lambda: self.backend.get_trial(trial_id))

    def get_all_trials(
        self, study_id: int, deepcopy: bool = True, states: Container[TrialState] | None = None
    ) -> list[FrozenTrial]:
        return self._call(lambda: self.backend.get_all_trials(study_id, deepcopy=deepcopy, states=states))

    def get_n_trials(self, study_id: int, state: tuple[TrialState, ...] | TrialState | None = None) -> int:
        return self._call(lambda: self.backend.get_n_trials(study_id, state))

    def get_best_trial(self, study_id: int) -> FrozenTrial:
        return self._call(lambda: self.backend.get_best_trial(study_id))

    def get_trial_params(self, trial_id: int) -> dict[str, Any]:
        return self._call(lambda: self.backend.get_trial_params(trial_id))

    def get_trial_user_attrs(self, trial_id: int) -> dict[str, Any]:
        return self._call(lambda: self.backend.get_trial_user_attrs(trial_id))

    def get_trial_system_attrs(self, trial_id: int) -> dict[str, Any]:
        return self._call(lambda: self.backend.get_trial_system_attrs(trial_id))

    def remove_session(self) -> None:
        self.backend.remove_session()

    def check_trial_is_updatable(self, trial_id: int, trial_state: TrialState) -> None:
        self._call(lambda: self.backend.check_trial_is_updatable(trial_id, trial_state))

    # --- heartbeats: beaten and checked by autotune (the search asks and tells; Optuna beats only in optimize) --------

    def record_heartbeat(self, trial_id: int) -> None:
        """One heartbeat of a running trial, by the database's clock; retried through an outage."""
        self._call(lambda: self.rdb.record_heartbeat(trial_id))

    def beat_once(self, trial_id: int) -> bool:
        """One heartbeat, not retried (the heartbeat thread tries again soon by itself): whether it went through."""
        try:
            self.rdb.record_heartbeat(trial_id)
        except Exception as exc:  # noqa: BLE001 - a lost beat is what the grace period is for
            if is_transient(exc):
                self.outage.failed(exc)
            else:
                log.debug("heartbeat of trial id %d failed: %s", trial_id, exc)
            return False
        self.outage.answered()
        return True

    def fail_stale_trials(self, study_name: str) -> None:
        """Fail the study's RUNNING trials whose heartbeat is older than the grace period (by the database's clock):
        Optuna's own check (optuna.storages.fail_stale_trials), on a view of the study over the backend, which
        has Optuna's heartbeat protocol. Retried through an outage as a whole (a trial failed twice is skipped)."""

        def once() -> None:
            study = self._heartbeat_studies.get(study_name)
            if study is None:
                study = self._heartbeat_studies[study_name] = optuna.load_study(study_name=study_name,
                                                                                storage=self.backend)
            optuna.storages.fail_stale_trials(study)

        self._call(once)


def first_line(exc: BaseException) -> str:
    """An exception's message on one line, without SQLAlchemy's "(Background on this error...)" and its
    "(psycopg.OperationalError) " prefix."""
    text = " ".join(str(exc).split())
    text = text.split(" (Background on this error", 1)[0]
    if text.startswith("(") and ") " in text:  # sqlalchemy's "(psycopg.OperationalError) ..." prefix
        text = text.split(") ", 1)[1]
    return text[:300]


def chain(exc: BaseException) -> list[BaseException]:
    """The exception and its causes (at most 8)."""
    found = [exc]
    while (nxt := found[-1].__cause__ or found[-1].__context__) is not None and len(found) < 8:
        found.append(nxt)
    return found


def _first_line(exc: BaseException) -> str:
    """The driver's own message under exc (what the server or the socket said): SQLAlchemy's first wrapped driver
    error, else the deepest exception with a message (past SQLAlchemy's own pool bookkeeping)."""
    found = chain(exc)
    root = next((e.orig for e in found if isinstance(getattr(e, "orig", None), BaseException)), None)
    if root is None:
        root = next((e for e in reversed(found) if first_line(e).strip("() ")), found[0])
    return first_line(root).split(" [SQL: ", 1)[0]
