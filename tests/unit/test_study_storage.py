"""Opening a shared study's storage: one-line errors, race-free creation, heartbeats, reaping and claims, on SQLite and
(where a throwaway server can start) PostgreSQL."""

from __future__ import annotations

import multiprocessing
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import optuna
import pytest

from autotune.errors import StorageError
from autotune.study_storage import Heartbeat, Owner, claim, open_storage, reap_stale, record_from_attrs, trial_id

PW = "hunter2-Secret"


def _has_psycopg() -> bool:
    try:
        import psycopg  # noqa: F401
    except ImportError:
        return False
    return True


needs_psycopg = pytest.mark.skipif(not _has_psycopg(), reason="psycopg is not installed (the postgres extra)")


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("not a url", "is not a database URL: use sqlite:///path.db or postgresql://"),
        ("", "is not a database URL"),
        (f"foo://u:{PW}@host/db", "is not a database URL"),
    ],
)
def test_a_bad_url_is_one_line_naming_the_fix(url: str, message: str) -> None:
    with pytest.raises(StorageError, match=message) as caught:
        open_storage(url)
    assert PW not in str(caught.value) and "\n" not in str(caught.value)


def test_an_sqlite_file_in_a_missing_folder_is_refused_and_the_folder_not_created(tmp_path: Path) -> None:
    missing = tmp_path / "no" / "such"
    with pytest.raises(StorageError, match=f"the folder {missing} of --storage .* does not exist"):
        open_storage(f"sqlite:///{missing / 'x.db'}")
    assert not (tmp_path / "no").exists()


def test_postgresql_without_its_driver_says_which_extra_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "psycopg", None)  # as if not installed
    with pytest.raises(StorageError, match=r"needs the psycopg driver .*pip install 'autotune\[postgres\]'") as caught:
        open_storage(f"postgresql://u:{PW}@127.0.0.1:1/db")
    assert PW not in str(caught.value) and "u:***@127.0.0.1:1/db" in str(caught.value)


@needs_psycopg
def test_a_refused_connection_is_one_line_without_the_password() -> None:
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(StorageError, match=rf"cannot open --storage postgresql://u:\*\*\*@127.0.0.1:{port}/db: ") as e:
        open_storage(f"postgresql://u:{PW}@127.0.0.1:{port}/db")
    assert PW not in str(e.value)


@needs_psycopg
def test_a_server_that_never_answers_fails_within_the_connect_timeout() -> None:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    accepted: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:  # accept and say nothing
        listener.settimeout(0.2)
        while not stop.is_set():
            try:
                accepted.append(listener.accept()[0])
            except OSError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    started = time.monotonic()
    try:
        with pytest.raises(StorageError, match="timeout"):
            open_storage(f"postgresql://u:{PW}@127.0.0.1:{listener.getsockname()[1]}/db", connect_timeout_s=1)
    finally:
        stop.set()
        thread.join()
        for conn in accepted:
            conn.close()
        listener.close()
    assert time.monotonic() - started < 10  # bounded by connect_timeout, not the OS's two minutes


def _create(url: str, barrier: multiprocessing.synchronize.Barrier, out: multiprocessing.Queue) -> None:
    try:
        barrier.wait()
        storage = open_storage(url)
        optuna.create_study(study_name="S", storage=storage.optuna, load_if_exists=True).ask()
        out.put("ok")
    except Exception as exc:  # noqa: BLE001 - the test reports it
        out.put(f"{type(exc).__name__}: {exc}"[:200])


def test_two_processes_create_one_study_at_once_on_a_fresh_database(shared_storage_url: str) -> None:
    # Without the lock, PostgreSQL races on CREATE TYPE and SQLite on CREATE TABLE (issue 16: 2 of 2, 10 of 10).
    ctx = multiprocessing.get_context("fork")
    barrier, out = ctx.Barrier(2), ctx.Queue()
    procs = [ctx.Process(target=_create, args=(shared_storage_url, barrier, out)) for _ in range(2)]
    for p in procs:
        p.start()
    results = [out.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(30)
    assert results == ["ok", "ok"]
    assert len(optuna.load_study(study_name="S", storage=shared_storage_url).trials) == 2


def _study(url: str, **kwargs: int) -> tuple[object, optuna.Study]:
    storage = open_storage(url, **kwargs)
    study = optuna.create_study(study_name="S", storage=storage.optuna, direction="maximize", load_if_exists=True)
    return storage, study


def test_claim_refuses_a_candidate_another_trial_runs_or_measured(shared_storage_url: str) -> None:
    storage, study = _study(shared_storage_url)
    a, b = study.ask(), study.ask()
    a.set_user_attr("owner", {"worker": "a", "host": "h", "pid": 1})
    assert claim(storage, study, a, "k1") is None
    assert claim(storage, study, b, "k1") == f"trial {a.number} runs it (worker a)"
    assert claim(storage, study, b, "k1", remeasure=True) is not None  # never twice at once
    a.set_user_attr("measurement", {"status": "ok"})
    study.tell(a, 1.0)
    assert claim(storage, study, b, "k1") == f"trial {a.number} measured it"
    assert claim(storage, study, b, "k1", remeasure=True) is None  # re-measuring a leader is what it is for
    c = study.ask()
    assert claim(storage, study, c, "k2") is None
    study.tell(c, state=optuna.trial.TrialState.FAIL)  # its search died: the claim frees itself (no measurement)
    assert claim(storage, study, study.ask(), "k2") is None


def _dead_pid() -> int:
    done = subprocess.Popen(["true"])
    done.wait()
    return done.pid


def test_a_trial_is_reaped_only_when_its_search_is_gone(tmp_path: Path) -> None:
    storage, study = _study(f"sqlite:///{tmp_path / 's.db'}", heartbeat_interval_s=1, grace_period_s=1)
    here = socket.gethostname()

    def running(owner: dict[str, object], launched: bool) -> optuna.Trial:
        trial = study.ask()
        trial.set_user_attr("owner", owner)
        trial.set_user_attr("launched", launched)
        return trial

    live = running({"worker": "live", "host": here, "pid": os.getppid()}, launched=False)
    dead = running({"worker": "dead", "host": here, "pid": _dead_pid()}, launched=True)
    elsewhere = running({"worker": "far", "host": "another-host", "pid": 1}, launched=True)
    beating = running({"worker": "beat", "host": "another-host", "pid": 1}, launched=True)
    storage.optuna.record_heartbeat(trial_id(storage.optuna, study, elsewhere))  # then it stops beating: its host died
    assert reap_stale(storage, study, stale_after_s=600) == [dead.number]  # its process is gone: no need to wait
    with Heartbeat(storage, trial_id(storage.optuna, study, beating)):
        reaped: list[int] = []
        deadline = time.monotonic() + 30  # past the grace period (SQLite's clock has 1 s steps)
        while time.monotonic() < deadline:  # polled: reaped as soon as the grace period is over
            reaped = reap_stale(storage, study, stale_after_s=600)
            if reaped:
                break
            time.sleep(0.1)
        assert reaped == [elsewhere.number]
    state = {t.number: t.state for t in study.get_trials()}
    assert state[live.number] == state[beating.number] == optuna.trial.TrialState.RUNNING
    frozen = study.get_trials()[elsewhere.number]
    record = record_from_attrs(frozen.number, frozen.user_attrs, "fail")
    assert record.outcome == "interrupted" and "worker far" in record.reason and record.worker == "far"
    # a trial that never beat (not launched, or written before heartbeats) is failed once older than any trial
    assert reap_stale(storage, study, stale_after_s=0) == [live.number]


def test_owner_gone_only_for_a_dead_process_on_this_host() -> None:
    here = socket.gethostname()
    assert Owner(worker="w", host=here, pid=_dead_pid()).gone()
    assert not Owner(worker="w", host=here, pid=os.getppid()).gone()
    assert not Owner(worker="w", host="elsewhere", pid=_dead_pid()).gone()


def test_asking_for_exact_params_takes_that_trial_not_an_older_queued_seed(tmp_path) -> None:
    from autotune.shared_study import open_shared_study
    from autotune.study_storage import PHASE

    storage = open_storage(f"sqlite:///{tmp_path / 'study.db'}")
    shared = open_shared_study(storage, "s", resume=False, seed=0, worker="w", setup={}, profile={},
                               stale_after_s=60.0)
    shared.study.enqueue_trial({"x": 1}, user_attrs={PHASE: "seed"})  # a seed the exploring phase left queued

    trial = shared.ask({"x": 2}, phase="remeasure")

    assert trial.user_attrs[PHASE] == "remeasure"
    assert shared.study._storage.get_trial(trial._trial_id).system_attrs["fixed_params"] == {"x": 2}
    queued = shared.study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.WAITING,))
    assert [t.system_attrs["fixed_params"] for t in queued] == [{"x": 1}]  # the seed waits for an exploring ask
    assert shared.ask().user_attrs[PHASE] == "seed"
