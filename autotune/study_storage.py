"""A study's storage, shared by any number of searches at once.

    open_storage ──▶ StudyStorage        tables created under a cross-process lock (two first starts race on CREATE
                                         TYPE / CREATE TABLE otherwise), a connect timeout, errors as one line, every
                                         call retried through an outage (autotune.storage_retry.RetryingStorage)
    Heartbeat                            a running trial's beat (Optuna beats only inside Study.optimize; the search
                                         asks and tells, so it beats itself, in Optuna's heartbeat table)
    reap_stale                           fail RUNNING trials whose owner is gone: its heartbeat lapsed, its process
                                         on this host is dead, or (no beat ever) it is older than any trial can be
    claim                                atomically: launch this candidate unless another trial runs or measured it

The lock is a PostgreSQL advisory lock (across hosts; the server drops it when its holder dies) or an flock beside
an SQLite file (one host, as SQLite itself); other URLs (MySQL...) get none. The truth stays in the study's own trials
(user attrs `owner`, `candidate_key`, `launched`, `measurement`): no table of our own.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import socket
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import optuna
import sqlalchemy
from sqlalchemy.engine import make_url

from autotune.candidate import Candidate
from autotune.errors import StorageError
from autotune.masking import mask_url
from autotune.records import Outcome, TrialRecord, TrialState
from autotune.simulate import Estimate
from autotune.storage_retry import Outage, RetryingStorage, is_transient, retry_bound_s
from autotune.storage_retry import chain as _chain
from autotune.storage_retry import first_line as _first_line

log = logging.getLogger(__name__)

HEARTBEAT_INTERVAL_S = 5
"""A running trial beats this often (seconds)."""
GRACE_PERIOD_S = 30
"""A trial whose beat is this old (seconds, by the database's clock) is failed by whichever search looks first."""
CONNECT_TIMEOUT_S = 10
"""Every engine autotune makes gives up connecting after this long (a silent server hung one for 130 s)."""
LOCK_CLASS = 0x4154_554E
"""'ATUN': the first key of PostgreSQL's two-int advisory locks, so autotune's do not collide with others'."""
_THREAD_LOCK = threading.RLock()  # an flock is per open file: the threads of one process need their own mutex


# --- the study's record format: what a search stores on its trials and on the study, and reading it back ---------

PHASE = "phase"
"""Trial: seed | default | explore | remeasure | rank-order ...: why it was asked (set when enqueued)."""
CANDIDATE = "candidate"
"""Trial: Candidate.to_dict() of what it runs."""
CANDIDATE_KEY = "candidate_key"
"""Trial: Candidate.key, set by claim() with LAUNCHED."""
LAUNCHED = "launched"
"""Trial: it ran (or runs) on ranks, as opposed to pruned or a repeat not launched again."""
PREDICTED = "predicted"
"""Trial: predicted_attrs() of the simulation it was asked with."""
OUTCOME = "outcome"
"""Trial: ok | oom | timeout | error | pruned | duplicate ... once it ended."""
REASON = "reason"
"""Trial: why it ended as it did (one line)."""
MEASUREMENT = "measurement"
"""Trial: Measurement.to_dict() of a launched run."""
OWNER = "owner"
"""Trial: Owner.to_dict() of the search that asked it."""
STUDY_PROFILE = "profile"
"""Study: the Profile.to_dict() every search of the study plans with."""
STUDY_SETUP = "setup"
"""Study: what every search of the study must agree on (model, gpus, batch size, link ...)."""
STUDY_SEEDED = "seeded"
"""Study: the first search queued its seeds."""
STUDY_WORKERS = "workers"
"""Study: per worker, its host and what it measured."""


def trial_id(storage: optuna.storages.BaseStorage, study: optuna.Study, trial: optuna.trial.BaseTrial) -> int:
    """The storage's id of a trial, through the storage's public API (Optuna keeps it in a private attribute)."""
    return storage.get_trial_id_from_study_id_trial_number(storage.get_study_id_from_name(study.study_name),
                                                            trial.number)


@dataclass(frozen=True, kw_only=True)
class Owner:
    """Who launched a trial: the search worker, its host and process."""

    worker: str
    """--worker: the name a search's budget is counted under."""
    host: str
    """socket.gethostname() of the search process."""
    pid: int
    """The search process."""

    def to_dict(self) -> dict[str, Any]:
        return {"worker": self.worker, "host": self.host, "pid": self.pid}

    @classmethod
    def from_attrs(cls, attrs: dict[str, Any]) -> Owner | None:
        data = attrs.get(OWNER)
        if not isinstance(data, dict):
            return None
        return cls(worker=str(data.get("worker", "")), host=str(data.get("host", "")), pid=int(data.get("pid", 0)))

    @classmethod
    def this_process(cls, worker: str) -> Owner:
        return cls(worker=worker, host=socket.gethostname(), pid=os.getpid())

    def gone(self) -> bool:
        """The owner's process is known to be dead: it ran on this host and its pid no longer exists."""
        if self.host != socket.gethostname() or self.pid == os.getpid() or self.pid <= 0:
            return False
        return process_gone(self.pid)


def process_gone(pid: int) -> bool:
    """The process on this host is known to be dead: its pid no longer exists, or it is a zombie waiting to be reaped.
    A pid this process may not signal, or one /proc cannot tell about (no /proc: macOS), is not known dead."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    try:
        with open(f"/proc/{pid}/status") as status:
            return any(line.startswith("State:") and "Z" in line.split()[1] for line in status)
    except OSError:
        return False


def default_worker() -> str:
    """The host name, and the GPUs it may use when CUDA_VISIBLE_DEVICES says: two searches on one machine with
    different GPU sets are different workers."""
    gpus = os.environ.get("CUDA_VISIBLE_DEVICES")
    return socket.gethostname() + (f":{gpus}" if gpus else "")


class StudyStorage:
    """An opened storage: the storage object to hand Optuna, and a lock shared by every process that uses the same
    database."""

    def __init__(self, url: str, storage: RetryingStorage, lock_engine: sqlalchemy.Engine | None) -> None:
        self.url = url
        """The URL as given (with its password: never print it; `masked` is for showing)."""
        self.masked = mask_url(url)
        self.optuna = storage
        """What optuna.create_study / load_study get as their storage: Optuna's storage API, retried."""
        self.outage = storage.outage
        """Whether the storage answers; every call through `optuna` and lock() is retried through an outage."""
        self.grace_period_s = float(storage.rdb.grace_period or GRACE_PERIOD_S)
        """A trial whose heartbeat is this old is failed by whichever search looks first."""
        self._lock_engine = lock_engine

    @contextlib.contextmanager
    def lock(self, name: str) -> Iterator[Held]:
        """A mutex across processes (and, on PostgreSQL, hosts) using this storage, scoped to `name`. Not
        re-entrant. Taking it is retried through an outage; a PostgreSQL lock whose connection an outage dropped
        is released by the server, and the Held it yields then says `lost` once the block is done."""
        with storage_lock(self.url, name, engine=self._lock_engine, outage=self.outage) as held:
            yield held

    def dispose(self) -> None:
        """Close the connections (the study stays)."""
        self.optuna.rdb.engine.dispose()
        if self._lock_engine is not None:
            self._lock_engine.dispose()


def open_storage(
    url: str,
    *,
    heartbeat_interval_s: int = HEARTBEAT_INTERVAL_S,
    grace_period_s: int = GRACE_PERIOD_S,
    connect_timeout_s: int = CONNECT_TIMEOUT_S,
    retry_s: float | None = None,
    say: Callable[[str], None] | None = None,
) -> StudyStorage:
    """Open (creating its tables if needed) the storage at `url`, race-free. Raises StorageError, whose message names
    the masked URL and the fix, for anything a user can get wrong: not a database URL, no driver, a server that
    does not answer or refuses, an SQLite file in a folder that does not exist. Once open, a call the storage does
    not answer is retried for up to retry_s (default: $AUTOTUNE_STORAGE_RETRY_S, else 300 s), the outage told
    through say (default: a logged warning)."""
    outage = Outage(mask_url(url), bound_s=retry_bound_s() if retry_s is None else retry_s, say=say)
    # heartbeat_interval and fail_stale_trials are experimental in Optuna
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
    try:
        backend = make_url(url).get_backend_name()
        engine_kwargs: dict[str, Any] = {}
        lock_engine = None
        if backend == "postgresql":
            # libpq's connect_timeout: without it an unroutable host waits for the OS (~2 min). pool_pre_ping: a
            # pooled connection that a server restart dropped is replaced before use instead of failing the call.
            engine_kwargs = {"connect_args": {"connect_timeout": connect_timeout_s}, "pool_pre_ping": True}
            lock_engine = sqlalchemy.create_engine(url, poolclass=sqlalchemy.pool.NullPool,
                                                   connect_args=engine_kwargs["connect_args"])
        elif backend == "sqlite":
            engine_kwargs = {"connect_args": {"timeout": 60}}  # wait this long on a database another search writes
        with storage_lock(url, "schema", engine=lock_engine):
            rdb = optuna.storages.RDBStorage(
                url, engine_kwargs=engine_kwargs, heartbeat_interval=heartbeat_interval_s, grace_period=grace_period_s
            )
    except Exception as exc:  # noqa: BLE001 - mapped to the user's error when it is one, else re-raised
        error = storage_error(exc, url)
        if error is None:
            raise
        raise error from None
    return StudyStorage(url, RetryingStorage(rdb, outage=outage), lock_engine)


def storage_error(exc: BaseException, url: str) -> StorageError | None:
    """The one-line StorageError for an exception from opening or reading a storage, None when it is not the user's
    (a bug: the caller re-raises it)."""
    shown = mask_url(url)
    chain = _chain(exc)
    names = {type(e).__name__ for e in chain}
    if names & {"ArgumentError", "NoSuchModuleError"}:
        return StorageError(
            f"--storage {shown!r} is not a database URL: use sqlite:///path.db or postgresql://user:password@host/db"
        )
    if isinstance(exc, ImportError):
        if url.startswith("postgresql"):
            return StorageError(
                f"--storage {shown} needs the psycopg driver (PostgreSQL): pip install 'autotune[postgres]'"
            )
        return StorageError(f"--storage {shown} needs a database driver that is not installed ({_first_line(exc)})")
    if isinstance(exc, FileNotFoundError):
        folder = Path(exc.filename).parent if exc.filename else "?"
        return StorageError(f"the folder {folder} of --storage {shown} does not exist; create it or fix the path")
    if "OperationalError" in names or "InterfaceError" in names:
        cause = chain[-1]
        return StorageError(f"cannot open --storage {shown}: {_first_line(cause)}")
    return None


def _lock_key(name: str) -> int:
    """A stable signed 32-bit key for a name (Python's hash() is salted per process)."""
    return int.from_bytes(hashlib.blake2b(name.encode(), digest_size=4).digest(), "big", signed=True)


class Held:
    """A lock() being held; `lost` once the block is done: the lock was not held to its end (an outage dropped its
    connection, so another process may have held it meanwhile)."""

    lost: bool = False


@contextlib.contextmanager
def storage_lock(
    url: str, name: str, *, engine: sqlalchemy.Engine | None = None, outage: Outage | None = None
) -> Iterator[Held]:
    """A mutex shared by every process using the database at `url`, scoped to `name` (see the module docstring).
    With outage, taking it is retried through one."""
    parsed = make_url(url)
    backend = parsed.get_backend_name()
    held = Held()
    if backend == "postgresql":
        own = engine is None
        eng = engine or sqlalchemy.create_engine(
            url, poolclass=sqlalchemy.pool.NullPool, connect_args={"connect_timeout": CONNECT_TIMEOUT_S}
        )
        key = {"a": LOCK_CLASS, "b": _lock_key(name)}

        def take() -> sqlalchemy.Connection:
            conn = eng.connect()
            try:
                conn.execute(sqlalchemy.text("SELECT pg_advisory_lock(:a, :b)"), key)
                conn.commit()
            except BaseException:
                _close_quietly(conn)
                raise
            return conn

        try:
            conn = outage.call(take) if outage is not None else take()
            try:
                yield held
            finally:
                try:
                    released = conn.execute(sqlalchemy.text("SELECT pg_advisory_unlock(:a, :b)"), key).scalar()
                    conn.commit()
                    held.lost = released is not True
                except Exception as exc:  # the connection, and the lock with it, went in an outage
                    if not is_transient(exc):
                        raise
                    held.lost = True
                    if outage is not None:
                        outage.failed(exc)
                finally:
                    _close_quietly(conn)
        finally:
            if own:
                eng.dispose()
    elif backend == "sqlite" and parsed.database not in (None, "", ":memory:"):
        import fcntl

        # Plain open(), not the filelock package: that creates missing folders, so a mistyped path would "work".
        with open(f"{parsed.database}.lock", "a") as handle, _THREAD_LOCK:
            fcntl.flock(handle, fcntl.LOCK_EX)
            try:
                yield held
            finally:
                fcntl.flock(handle, fcntl.LOCK_UN)
    else:
        yield held


def _close_quietly(conn: sqlalchemy.Connection) -> None:
    try:
        conn.close()
    except Exception as exc:  # noqa: BLE001 - a connection an outage dropped may fail to close; it is gone anyway
        log.debug("closing a lock connection failed: %s", exc)


class Heartbeat:
    """Beats for one trial from a thread while it runs; the first beat is synchronous, because a RUNNING trial
    without any beat is never found stale. Use as a context manager."""

    def __init__(self, storage: StudyStorage, trial_id: int) -> None:
        self.storage, self.trial_id = storage, trial_id
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> Heartbeat:
        self.storage.optuna.record_heartbeat(self.trial_id)  # retried through an outage
        self._thread = threading.Thread(target=self._run, daemon=True, name=f"autotune-heartbeat-{self.trial_id}")
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _run(self) -> None:
        interval = self.storage.optuna.rdb.get_heartbeat_interval() or HEARTBEAT_INTERVAL_S
        wait = interval
        while not self._stop.wait(wait):
            # A beat an outage lost is tried again within a second: beat as soon as the storage is back, before
            # another search could find this trial's beat lapsed.
            wait = interval if self.storage.optuna.beat_once(self.trial_id) else min(1.0, interval)


def reap_stale(
    storage: StudyStorage, study: optuna.Study, *, stale_after_s: float, heartbeats: bool = True
) -> list[int]:
    """Fail the study's RUNNING trials whose owner is gone; return their numbers. Gone: its heartbeat lapsed (by the
    database's clock, any host; only with heartbeats), or it ran on this host and its process is dead, or it never
    beat (not launched, or written by an autotune without heartbeats) and started more than stale_after_s ago. A
    live search's trial is never touched. A reaped trial keeps its attrs; its record says its worker stopped
    answering."""
    before = {t.number for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,))}
    if heartbeats:
        storage.optuna.fail_stale_trials(study.study_name)
    now = time.time()
    for frozen in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,)):
        owner = Owner.from_attrs(frozen.user_attrs)
        started = frozen.datetime_start.timestamp() if frozen.datetime_start else now
        beats = owner is not None and bool(frozen.user_attrs.get(LAUNCHED))
        if (owner is not None and owner.gone()) or (not beats and now - started > stale_after_s):
            study.tell(frozen.number, state=optuna.trial.TrialState.FAIL, skip_if_finished=True)
    after = {t.number for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,))}
    reaped = sorted(before - after)
    if reaped:
        log.info("failed trials %s: their search stopped answering", reaped)
    return reaped


def claim(
    storage: StudyStorage, study: optuna.Study, trial: optuna.Trial, key: str, *, remeasure: bool = False
) -> str | None:
    """Atomically: unless another trial of the study runs candidate `key` (or, unless remeasure, has measured it),
    mark this trial as its launch. None when claimed, else why not (which trial holds it). Holding the storage lock,
    read the study's running and finished trials, then set `candidate_key` and `launched` on this one. A lock that
    an outage dropped meanwhile (another search may have claimed the same candidate) is taken again and the claim
    decided again, this trial's own earlier mark withdrawn when it is refused now."""
    while True:
        with storage.lock(f"claim:{study.study_name}") as held:
            refused = _claim_once(study, trial, key, remeasure=remeasure)
        if not held.lost:
            return refused
        log.info("trial %d: the claim lock was lost in a storage outage; claiming again", trial.number)


def _claim_once(study: optuna.Study, trial: optuna.Trial, key: str, *, remeasure: bool) -> str | None:
    State = optuna.trial.TrialState
    for t in study.get_trials(deepcopy=False, states=(State.RUNNING, State.COMPLETE, State.PRUNED, State.FAIL)):
        if t.number == trial.number or t.user_attrs.get(CANDIDATE_KEY) != key or not t.user_attrs.get(LAUNCHED):
            continue
        refused = None
        if t.state == State.RUNNING:
            owner = Owner.from_attrs(t.user_attrs)
            refused = f"trial {t.number} runs it" + (f" (worker {owner.worker})" if owner else "")
        elif not remeasure and MEASUREMENT in t.user_attrs:
            refused = f"trial {t.number} measured it"
        if refused is not None:
            if trial.user_attrs.get(LAUNCHED):  # marked by a try whose lock an outage dropped
                trial.set_user_attr(LAUNCHED, False)
            return refused
    trial.set_user_attr(CANDIDATE_KEY, key)
    trial.set_user_attr(LAUNCHED, True)
    return None


def record_from_attrs(number: int, attrs: Mapping[str, Any], state: TrialState | None = None) -> TrialRecord:
    """A trial's record from the user attributes the search stores on it (state: the stored trial's, None for a live
    one). A trial still running, or without an outcome, never finished: "interrupted"; one a later search failed for
    that (state "fail", no outcome) died with its tuner, or its search stopped answering (its heartbeat lapsed)."""
    candidate = Candidate.from_dict(attrs[CANDIDATE]) if CANDIDATE in attrs else None
    measurement = attrs.get(MEASUREMENT) or {}
    predicted = attrs.get(PREDICTED) or {}
    outcome: Outcome = "interrupted"
    reason = attrs.get(REASON, "stopped before it finished")
    if state != "running" and OUTCOME in attrs:
        outcome = attrs[OUTCOME]
    elif state == "fail":
        worker = _worker_of(attrs)
        reason = f"its search (worker {worker}) died or stopped answering during this trial" if worker else (
            "the tuner died during this trial")
    return TrialRecord(
        number=number,
        candidate=candidate,
        outcome=outcome,
        reason=reason,
        throughput_samples_per_s=measurement.get("throughput_samples_per_s"),
        step_time_ms=measurement.get("step_time_ms"),
        peak_memory_bytes=tuple(measurement.get("peak_memory_bytes", ())),
        losses=tuple(measurement.get("losses") or ()),
        predicted_throughput_samples_per_s=predicted.get("throughput_samples_per_s"),
        predicted_peak_memory_bytes=tuple(predicted.get("peak_memory_bytes", ())),
        phase=attrs.get(PHASE, "explore"),
        launched=bool(attrs.get(LAUNCHED, False)),
        wall_time_s=float(measurement.get("wall_time_s", 0.0)) if attrs.get(LAUNCHED) else 0.0,
        oom_bytes=(measurement.get("error") or {}).get("bytes_requested")
        if measurement.get("status") == "oom"
        else None,
        worker=_worker_of(attrs),
    )


def _worker_of(attrs: Mapping[str, Any]) -> str | None:
    owner = attrs.get(OWNER)
    return str(owner["worker"]) if isinstance(owner, Mapping) and owner.get("worker") else None


def predicted_attrs(estimate: Estimate) -> dict[str, Any]:
    """What a trial stores of its candidate's simulation."""
    return {
        "step_time_ms": estimate.step_time_ms,
        "throughput_samples_per_s": estimate.throughput_samples_per_s,
        "bubble_fraction": estimate.bubble_fraction,
        "peak_memory_bytes": list(estimate.peak_memory_bytes),
        "feasible": estimate.feasible,
    }
