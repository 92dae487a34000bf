"""--storage from the user's side: a bad or unreachable storage fails first, in one line (one JSON object with --json)
and exit 2, without its password; `report --storage` tells the user's errors (exit 2) from bugs (exit 1)."""

from __future__ import annotations

import json
import socket

import pytest
from typer.testing import CliRunner

import autotune.search
import autotune.tune
from autotune.cli import app
from tests.conftest import RECIPES

runner = CliRunner()
PW = "Hunter2-secret-pw"


def _never(*args, **kwargs):
    raise AssertionError("profiled before the storage was opened")


def _refused_postgres() -> str:
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        return f"postgresql://bob:{PW}@127.0.0.1:{s.getsockname()[1]}/optuna"


@pytest.mark.parametrize(
    ("storage", "fragment"),
    [
        ("not-a-url", "is not a database URL"),
        ("sqlite:////no/such/folder/x.db", "the folder /no/such/folder of --storage"),
        ("POSTGRES", "postgresql://bob:***@127.0.0.1:"),  # refused, or no driver: either way one line, masked
    ],
)
def test_a_bad_storage_fails_before_profiling_in_one_line(monkeypatch, tmp_path, storage, fragment):
    monkeypatch.setattr(autotune.tune, "load_and_profile", _never)
    storage = _refused_postgres() if storage == "POSTGRES" else storage
    args = ["search", str(RECIPES / "mlp.py"), "--gpus", "2", "--batch-size", "8", "--device", "cpu", "--storage",
            storage, "--output", str(tmp_path / "t.yaml")]
    plain = runner.invoke(app, args)
    assert plain.exit_code == 2, plain.output
    assert fragment in plain.stderr and len(plain.stderr.strip().splitlines()) == 1
    as_json = runner.invoke(app, [*args, "--json"])
    data = json.loads(as_json.stdout)
    assert as_json.exit_code == data["exit_code"] == 2 and fragment in data["error"]
    for output in (plain.stdout, plain.stderr, as_json.stdout, as_json.stderr):
        assert PW not in output


def test_a_study_name_in_use_is_refused_before_profiling(monkeypatch, tmp_path):
    import optuna

    url = f"sqlite:///{tmp_path / 's.db'}"
    optuna.create_study(study_name="taken", storage=url)
    monkeypatch.setattr(autotune.tune, "load_and_profile", _never)
    result = runner.invoke(app, ["search", str(RECIPES / "mlp.py"), "--gpus", "2", "--batch-size", "8", "--device",
                                 "cpu", "--storage", url, "--study-name", "taken"])
    assert result.exit_code == 2 and "pass --resume" in result.stderr


def test_report_storage_user_errors_exit_2_and_bugs_exit_1(monkeypatch, tmp_path):
    bad = runner.invoke(app, ["report", "--storage", f"foo://u:{PW}@h/db", "--study-name", "s"])
    assert bad.exit_code == 2 and "is not a database URL" in bad.stderr and PW not in bad.output
    unreachable = runner.invoke(app, ["report", "--storage", _refused_postgres(), "--study-name", "s"])
    assert unreachable.exit_code == 2 and "bob:***@" in unreachable.stderr and PW not in unreachable.output
    url = f"sqlite:///{tmp_path / 's.db'}"
    missing = runner.invoke(app, ["report", "--storage", url, "--study-name", "nope"])  # an empty database: no study
    assert missing.exit_code == 2, missing.output

    def bug(*args, **kwargs):
        raise TypeError(f"a bug in autotune, near {url}")

    import optuna

    optuna.create_study(study_name="s", storage=url)
    monkeypatch.setattr(autotune.search.optuna, "load_study", bug)
    crashed = runner.invoke(app, ["report", "--storage", url, "--study-name", "s"])
    assert crashed.exit_code == 1 and "internal error: TypeError" in crashed.stderr
