"""Real `autotune search` workers on a PostgreSQL server that goes away under them: a restart is ridden out (both exit
0, every trial kept, none launched twice), an outage longer than AUTOTUNE_STORAGE_RETRY_S stops a search with one
line and exit 4, and `--resume` finishes its study. Each test has a throwaway server of its own to stop."""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import optuna
import pytest
import sqlalchemy

from autotune.storage_retry import RETRY_ENV
from autotune.study_storage import storage_lock
from tests import pg
from tests.conftest import RECIPES

BUDGET = 2  # the fewest --trials allows: each worker is still under way when the server goes
STUDY = "blink"


class Worker:
    """`autotune search` in a subprocess, its stderr read as it comes (to wait for what it says)."""

    def __init__(self, name: str, url: str, folder: Path, env: dict[str, str] | None = None) -> None:
        args = ["search", str(RECIPES / "mlp.py"), "--gpus", "2", "--device", "cpu", "--batch-size", "64",
                "--trials", str(BUDGET), "--steps", "2", "--warmup", "1", "--storage", url, "--study-name", STUDY,
                "--resume", "--worker", name, "--output", str(folder / f"{name}.yaml"), "--report-dir",
                str(folder / f"report-{name}"), "--json"]
        self.name = name
        self.process = subprocess.Popen([sys.executable, "-m", "autotune", *args], stdout=subprocess.PIPE,
                                        stderr=subprocess.PIPE, text=True, env={**os.environ, **(env or {})})
        self._err: list[str] = []
        self._out: list[str] = []
        self._readers = [threading.Thread(target=self._read, args=(stream, into), daemon=True)
                         for stream, into in ((self.process.stderr, self._err), (self.process.stdout, self._out))]
        for reader in self._readers:
            reader.start()

    @staticmethod
    def _read(stream: object, into: list[str]) -> None:
        for line in stream:  # type: ignore[attr-defined]
            into.append(line)

    def said(self, text: str) -> bool:
        return text in " ".join("".join(self._err).split())  # rich may wrap a long line

    def finish(self, timeout: float = 300) -> tuple[int, str, str]:
        code = self.process.wait(timeout=timeout)
        for reader in self._readers:
            reader.join(timeout=10)
        return code, "".join(self._out), "".join(self._err)


@pytest.fixture
def server() -> Iterator[pg.Server]:
    why = pg.why_not()
    if why:
        pytest.skip(f"no PostgreSQL: {why}")
    with pg.throwaway_server() as started:
        yield started


def wait_for(condition: Callable[[], bool], what: str, workers: list[Worker], timeout_s: float = 180) -> None:
    """Poll condition until it holds; fail (naming what) at the deadline or when a worker exits first."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        for w in workers:
            if w.process.poll() is not None:
                code, out, err = w.finish()
                pytest.fail(f"worker {w.name} exited ({code}) before {what}: {err[-2000:]}")
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.1)


def joined(url: str, names: set[str], *, launched: bool = False) -> Callable[[], bool]:
    """Every named worker joined the study (and, with launched, a trial was launched: the searches are under way)."""

    def check() -> bool:
        storage = optuna.storages.RDBStorage(url, engine_kwargs={"poolclass": sqlalchemy.pool.NullPool})
        try:
            if STUDY not in optuna.study.get_all_study_names(storage):
                return False
            study = optuna.load_study(study_name=STUDY, storage=storage)
            workers = set(study.user_attrs.get("workers") or {})
            trials = study.get_trials(deepcopy=False)
            return names <= workers and (not launched or any(t.user_attrs.get("launched") for t in trials))
        finally:
            storage.engine.dispose()

    return check


def searching(url: str, names: set[str]) -> Callable[[], bool]:
    return joined(url, names, launched=True)


def launches(url: str) -> list[optuna.trial.FrozenTrial]:
    study = optuna.load_study(study_name=STUDY, storage=url)
    assert not [t.number for t in study.trials if t.state == optuna.trial.TrialState.RUNNING]
    return [t for t in study.trials if t.user_attrs.get("launched")]


def assert_none_measured_twice(launched: list[optuna.trial.FrozenTrial]) -> None:
    explored = [t for t in launched if t.user_attrs.get("phase") != "remeasure" and "measurement" in t.user_attrs]
    by_key = collections.Counter(t.user_attrs["candidate_key"] for t in explored)
    assert max(by_key.values()) == 1, by_key


@pytest.mark.dist
def test_two_workers_ride_out_a_server_restart(server: pg.Server, tmp_path: Path) -> None:
    url = server.create_database()
    # Both workers held at the study's seeding (its storage lock, held here) until both joined: neither can finish
    # before the other starts, whichever starts faster.
    with storage_lock(url, f"seed:{STUDY}"):
        workers = [Worker(name, url, tmp_path, env={RETRY_ENV: "120"}) for name in ("a", "b")]
        wait_for(joined(url, {"a", "b"}), "both workers joining the study", workers)
    wait_for(searching(url, {"a", "b"}), "both workers searching", workers)
    server.stop()
    # Down until each search has found it so (each calls the storage every few seconds while it searches).
    wait_for(lambda: all(w.said("does not answer") for w in workers), "both workers meeting the outage", workers)
    server.start()
    results = {w.name: w.finish() for w in workers}
    for code, _, err in results.values():
        assert code == 0, err[-3000:]
        assert "retrying for up to 120 s" in " ".join(err.split()) and "answers again after" in " ".join(err.split())
    summaries = {name: json.loads(out) for name, (_, out, _) in results.items()}
    assert {s["worker"]: s["launched_by_worker"] for s in summaries.values()} == {"a": BUDGET, "b": BUDGET}
    launched = launches(url)
    assert len(launched) == 2 * BUDGET
    # Not one lost: every launch finished with its measurement stored (none failed for a lapsed heartbeat).
    assert all(t.state == optuna.trial.TrialState.COMPLETE and "measurement" in t.user_attrs for t in launched)
    assert_none_measured_twice(launched)


@pytest.mark.dist
def test_an_outage_past_the_bound_stops_with_exit_4_and_resume_finishes(server: pg.Server, tmp_path: Path) -> None:
    url = server.create_database()
    worker = Worker("a", url, tmp_path, env={RETRY_ENV: "2"})
    wait_for(searching(url, {"a"}), "the worker searching", [worker])
    server.stop()
    code, out, err = worker.finish()
    assert code == 4, err[-3000:]
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in err
    assert "did not answer for 2 s" in errors[0] and "--resume" in errors[0] and pg.PASSWORD not in err
    assert json.loads(out)["exit_code"] == 4

    server.start()
    code, out, err = Worker("a", url, tmp_path).finish()
    assert code == 0, err[-3000:]
    assert json.loads(out)["launched_by_worker"] == BUDGET
    launched = launches(url)  # none left running
    assert len(launched) == BUDGET
    # The launch the outage cut off is failed (its result could not be stored), every other one is measured.
    cut = [t for t in launched if "measurement" not in t.user_attrs]
    assert len(cut) <= 1 and all(t.state == optuna.trial.TrialState.FAIL for t in cut)
    assert_none_measured_twice(launched)
