"""Two real `autotune search` workers at once on one study (SQLite file, PostgreSQL database): both finish, the
launches add up to the two budgets, no candidate is launched twice, the last to finish chooses from the whole study,
and no output or file holds the storage's password."""

from __future__ import annotations

import collections
import json
import subprocess
import sys
from pathlib import Path

import optuna
import pytest

from autotune.candidate import Measurement
from autotune.records import leaders_of, summarize
from autotune.shared_study import load_records
from tests import pg
from tests.conftest import RECIPES

BUDGET = 3  # under 4 the search keeps no re-measurement reserve: every launch is a new candidate


def worker(name: str, url: str, folder: Path) -> subprocess.Popen[str]:
    args = ["search", str(RECIPES / "mlp.py"), "--gpus", "2", "--device", "cpu", "--batch-size", "64", "--trials",
            str(BUDGET), "--steps", "2", "--warmup", "1", "--storage", url, "--study-name", "shared", "--resume",
            "--worker", name, "--output", str(folder / f"{name}.yaml"), "--report-dir", str(folder / f"report-{name}"),
            "--json"]
    return subprocess.Popen([sys.executable, "-m", "autotune", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


@pytest.mark.dist
def test_two_workers_share_one_study(shared_storage_url: str, tmp_path: Path) -> None:
    workers = {name: worker(name, shared_storage_url, tmp_path) for name in ("a", "b")}
    outputs = {name: p.communicate(timeout=300) for name, p in workers.items()}
    for name, p in workers.items():
        assert p.returncode == 0, outputs[name][1][-3000:]
    summaries = {name: json.loads(out) for name, (out, _) in outputs.items()}
    assert {s["worker"]: s["launched_by_worker"] for s in summaries.values()} == {"a": BUDGET, "b": BUDGET}

    study = optuna.load_study(study_name="shared", storage=shared_storage_url)
    launches = [t for t in study.trials if t.user_attrs.get("launched")]
    assert len(launches) == 2 * BUDGET
    # No candidate launched twice, but by a worker re-running the study's leaders side by side (when its sampler
    # runs out of new candidates, the rest of its budget goes there).
    explored = [t for t in launches if t.user_attrs.get("phase") != "remeasure"]
    by_key = collections.Counter(t.user_attrs["candidate_key"] for t in explored)
    assert max(by_key.values()) == 1, by_key
    first = {t.user_attrs["candidate_key"]: t.number for t in reversed(explored)}
    for rerun in (t for t in launches if t.user_attrs.get("phase") == "remeasure"):
        assert first[rerun.user_attrs["candidate_key"]] < rerun.number  # a re-run of a measured leader
    assert {t.user_attrs["owner"]["worker"] for t in launches} == {"a", "b"}

    records, runs = load_records(study)
    # Both may count every launch while the other's last trial still runs: the one that saw the most outcomes too
    # (the worker that ran the study's last trial saw them all) chose from the whole study.
    last = max(summaries.values(), key=lambda s: (s["launched"], s["feasible"]))
    assert last["launched"] == 2 * BUDGET  # the last to finish saw every launch ...
    # ... and chose from all of them: by its own side-by-side re-runs of the leaders where it took some of two or more
    rerun: dict[str, list[Measurement]] = {}
    for t in launches:
        if t.user_attrs.get("phase") == "remeasure" and t.user_attrs["owner"]["worker"] == last["worker"]:
            m = Measurement.from_dict(t.user_attrs["measurement"])
            rerun.setdefault(m.candidate.key, []).append(m)
    best = summarize(records, rerun if len(leaders_of(rerun)) >= 2 else runs).best
    assert (last["best"]["schedule"], last["best"]["layers_per_stage"]) == (
        best.candidate.schedule.value, list(best.candidate.layers_per_stage))

    if shared_storage_url.startswith("postgresql"):  # no password in any output or file
        assert pg.PASSWORD in shared_storage_url
        texts = [text for pair in outputs.values() for text in pair]
        texts += [path.read_text(errors="replace") for path in tmp_path.rglob("*") if path.is_file()]
        assert all(pg.PASSWORD not in text for text in texts)
        assert "autotune:***@" in (tmp_path / "a.yaml").read_text()  # the header's command and search.storage
