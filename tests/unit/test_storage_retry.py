"""Retrying a storage through an outage: what counts as transient, the bound and its one-line error, a commit whose
answer was lost, a claim whose lock an outage dropped, the bound's environment variable."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import optuna
import pytest
import sqlalchemy.exc

from autotune.errors import EXIT_LAUNCH, StorageUnavailableError, UsageError
from autotune.storage_retry import RETRY_ENV, Outage, is_transient, retry_bound_s
from autotune.study_storage import Held, claim, open_storage


def _dropped() -> Exception:
    """What a call raises when the server went away: Optuna's error around SQLAlchemy's around the driver's."""
    try:
        try:
            raise sqlalchemy.exc.OperationalError("SELECT 1", {}, ConnectionRefusedError("connection refused"))
        except sqlalchemy.exc.OperationalError as inner:
            raise optuna.exceptions.StorageInternalError("An exception is raised during the commit.") from inner
    except optuna.exceptions.StorageInternalError as outer:
        return outer


def test_transient_is_a_lost_connection_not_a_refused_call() -> None:
    assert is_transient(_dropped())
    assert is_transient(sqlalchemy.exc.InterfaceError("x", {}, Exception("closed")))
    assert not is_transient(optuna.exceptions.StorageInternalError("value too long"))
    assert not is_transient(sqlalchemy.exc.IntegrityError("INSERT", {}, Exception("duplicate key")))
    assert not is_transient(ValueError("bug"))


def test_a_call_is_retried_until_the_storage_answers_and_both_are_said() -> None:
    said: list[str] = []
    outage = Outage("postgresql://u:***@db/x", bound_s=60, say=said.append)
    answers: list[object] = [_dropped(), _dropped(), "ok"]

    def call() -> object:
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    assert outage.call(call) == "ok" and not answers
    assert len(said) == 2
    assert said[0].startswith("the storage postgresql://u:***@db/x does not answer (connection refused): retrying")
    assert said[1].startswith("the storage postgresql://u:***@db/x answers again after")
    assert outage.failed_within(60) and not outage.failed_within(0)


def test_past_the_bound_one_line_exit_4_naming_resume() -> None:
    outage = Outage("postgresql://u:***@db/x", bound_s=0, say=lambda text: None)

    def down() -> None:
        raise _dropped()

    with pytest.raises(StorageUnavailableError) as caught:
        outage.call(down)
    message = str(caught.value)
    assert caught.value.exit_code == EXIT_LAUNCH and "\n" not in message
    assert "did not answer for 0 s (connection refused)" in message and "--resume" in message and RETRY_ENV in message


def test_a_refused_call_is_raised_at_once() -> None:
    calls = []

    def refused() -> None:
        calls.append(1)
        raise optuna.exceptions.StorageInternalError("value too long")

    with pytest.raises(optuna.exceptions.StorageInternalError):
        Outage("x", bound_s=60, say=lambda text: None).call(refused)
    assert calls == [1]


def test_a_tell_whose_commit_went_through_but_whose_answer_was_lost_succeeds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    storage = open_storage(f"sqlite:///{tmp_path / 's.db'}", retry_s=60, say=lambda text: None)
    study = optuna.create_study(storage=storage.optuna, direction="maximize")
    trial = study.ask()
    original = optuna.storages.RDBStorage.set_trial_state_values
    lost = [True]

    def commit_then_drop(self: object, trial_id: int, state: object, values: object = None) -> bool:
        done = original(self, trial_id, state, values)  # type: ignore[arg-type]
        if lost and state == optuna.trial.TrialState.COMPLETE:
            lost.clear()
            raise _dropped()
        return done

    monkeypatch.setattr(optuna.storages.RDBStorage, "set_trial_state_values", commit_then_drop)
    study.tell(trial, 1.5)
    assert not lost and study.trials[0].state == optuna.trial.TrialState.COMPLETE and study.trials[0].value == 1.5


def test_a_write_is_retried_through_optunas_public_storage_api(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    said: list[str] = []
    storage = open_storage(f"sqlite:///{tmp_path / 's.db'}", retry_s=60, say=said.append)
    study = optuna.create_study(storage=storage.optuna, direction="maximize")
    trial = study.ask()
    original = optuna.storages.RDBStorage.set_trial_user_attr
    failures = [_dropped(), _dropped()]

    def blinking(self: object, trial_id: int, key: str, value: object) -> None:
        if failures:
            raise failures.pop()
        original(self, trial_id, key, value)  # type: ignore[arg-type]

    monkeypatch.setattr(optuna.storages.RDBStorage, "set_trial_user_attr", blinking)
    trial.set_user_attr("owner", {"worker": "w"})
    assert not failures and study.trials[0].user_attrs == {"owner": {"worker": "w"}}
    assert len(said) == 2 and "does not answer" in said[0] and "answers again" in said[1]


def test_optuna_keeps_its_cache_of_finished_trials(tmp_path: Path) -> None:
    # The search re-reads the study before each decision: without Optuna's cache each read fetches every trial
    # again (bench/storage_speed.py: 17x the storage CPU time of a 300-trial search).
    storage = open_storage(f"sqlite:///{tmp_path / 's.db'}", retry_s=60, say=lambda text: None)
    study = optuna.create_study(storage=storage.optuna, direction="maximize")
    study.tell(study.ask(), 1.0)
    running = study.ask()
    first, second = study.get_trials(deepcopy=False), study.get_trials(deepcopy=False)
    assert first[0] is second[0]  # a finished trial: read once
    running.set_user_attr("k", 1)
    assert study.get_trials(deepcopy=False)[1].user_attrs == {"k": 1}  # a running one: read each time


def test_a_claim_whose_lock_an_outage_dropped_is_decided_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    storage = open_storage(f"sqlite:///{tmp_path / 's.db'}", retry_s=60, say=lambda text: None)
    study = optuna.create_study(storage=storage.optuna, direction="maximize")
    mine, theirs = study.ask(), study.ask()
    tries = []

    @contextlib.contextmanager
    def lock(name: str) -> Iterator[Held]:
        held = Held()
        tries.append(name)
        yield held
        if len(tries) == 1:  # the first try's lock was dropped, and another search claimed meanwhile
            held.lost = True
            theirs.set_user_attr("candidate_key", "k")
            theirs.set_user_attr("launched", True)

    monkeypatch.setattr(storage, "lock", lock)
    assert claim(storage, study, mine, "k") == f"trial {theirs.number} runs it"
    assert len(tries) == 2 and mine.user_attrs["launched"] is False  # its first try's mark withdrawn


def test_the_bound_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(RETRY_ENV, raising=False)
    assert retry_bound_s() == 300
    monkeypatch.setenv(RETRY_ENV, "2.5")
    assert retry_bound_s() == 2.5
    monkeypatch.setenv(RETRY_ENV, "soon")
    with pytest.raises(UsageError, match=f"{RETRY_ENV}='soon' is not a number of seconds"):
        retry_bound_s()


def test_the_message_is_the_drivers_not_sqlalchemys_pool_bookkeeping() -> None:
    driver = ConnectionRefusedError("connection refused")
    driver.__context__ = sqlalchemy.exc.InvalidatePoolError()  # what pool_pre_ping leaves under a refused connect
    wrapped = sqlalchemy.exc.OperationalError("SELECT 1", {}, driver)
    wrapped.__cause__ = driver
    outer = optuna.exceptions.StorageInternalError("An exception is raised during the commit.")
    outer.__cause__ = wrapped
    said: list[str] = []

    def down() -> None:
        raise outer

    with pytest.raises(StorageUnavailableError, match=r"did not answer for 0 s \(connection refused\);"):
        Outage("x", bound_s=0, say=said.append).call(down)
    assert said == ["the storage x does not answer (connection refused): retrying for up to 0 s"]
