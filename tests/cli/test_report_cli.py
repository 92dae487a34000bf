"""`autotune report CONFIG | --storage URL --study-name NAME`: the report and exit 0, or one error line and exit 2."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from autotune.cli import app
from autotune.config_file import save_config
from autotune.records import SearchResult
from autotune.tuned_config import SearchSummary, TunedConfig
from tests.unit.test_report import LIMIT, make_study

runner = CliRunner()


@pytest.fixture(scope="module")
def study(tmp_path_factory) -> tuple[SearchResult, Path]:
    folder = tmp_path_factory.mktemp("study")
    return make_study(folder), folder


def config_for(result: SearchResult, path: Path, *, storage: str | None = None, study: str | None = "s") -> Path:
    config = TunedConfig.from_measurement(
        result.best, model="recipes/mlp.py", model_sha256="0123456789abcdef", memory_limit_bytes=LIMIT,
        search=SearchSummary(study=study, storage=storage or result.storage, trials=len(result.records)),
    )
    return save_config(config, path)


def test_report_from_storage_and_study_name(study, tmp_path):
    result, _ = study
    out = tmp_path / "out"
    run = runner.invoke(app, ["report", "--storage", result.storage, "--study-name", "s", "--report-dir", str(out)])
    assert run.exit_code == 0, run.output
    assert (out / "report.md").is_file() and (out / "report.html").is_file()
    assert str(out / "report.md") in " ".join(run.stdout.split())
    assert result.best.candidate.key in (out / "report.md").read_text()


def test_report_from_a_config_includes_its_exports(study, tmp_path):
    result, _ = study
    config = config_for(result, tmp_path / "autotune.yaml")
    out = tmp_path / "out"
    run = runner.invoke(app, ["report", str(config), "--report-dir", str(out)])
    assert run.exit_code == 0, run.output
    assert "--pipeline-model-parallel-size" in (out / "report.md").read_text()


def test_relative_sqlite_path_is_found_beside_the_config(study, tmp_path, monkeypatch):
    result, folder = study
    config = config_for(result, folder / "autotune.yaml", storage="sqlite:///s.db")
    monkeypatch.chdir(tmp_path)  # not the folder the database is in
    run = runner.invoke(app, ["report", str(config), "--report-dir", str(tmp_path / "out")])
    assert run.exit_code == 0, run.output


def test_masked_password_in_the_config_asks_for_storage(study, tmp_path):
    result, _ = study
    config = config_for(result, tmp_path / "autotune.yaml", storage="postgresql://tuner:secret@db.example/autotune")
    assert "***" in config.read_text()
    run = runner.invoke(app, ["report", str(config), "--report-dir", str(tmp_path / "out")])
    assert run.exit_code == 2
    assert "masked" in run.stderr and "pass --storage" in run.stderr
    assert not (tmp_path / "out").exists()


def test_storage_flag_overrides_the_config(study, tmp_path):
    result, _ = study
    config = config_for(result, tmp_path / "autotune.yaml", storage="postgresql://tuner:secret@db.example/autotune")
    run = runner.invoke(app, ["report", str(config), "--storage", result.storage, "--report-dir", str(tmp_path / "o")])
    assert run.exit_code == 0, run.output


def test_config_from_a_single_trial_names_no_study(study, tmp_path):
    result, _ = study
    config = config_for(result, tmp_path / "autotune.yaml", study=None)
    run = runner.invoke(app, ["report", str(config)])
    assert run.exit_code == 2
    assert "names no study" in run.stderr


def test_nothing_to_report_on_exits_2():
    run = runner.invoke(app, ["report"])
    assert run.exit_code == 2
    assert "--storage URL and --study-name NAME" in run.stderr


def test_storage_without_study_name_exits_2(study):
    run = runner.invoke(app, ["report", "--storage", study[0].storage])
    assert run.exit_code == 2


def test_unknown_study_exits_2(study, tmp_path):
    run = runner.invoke(app, ["report", "--storage", study[0].storage, "--study-name", "nope",
                              "--report-dir", str(tmp_path / "out")])
    assert run.exit_code == 2
    assert "no study 'nope'" in run.stderr


def test_missing_database_exits_2_and_creates_nothing(tmp_path):
    missing = tmp_path / "none.db"
    run = runner.invoke(app, ["report", "--storage", f"sqlite:///{missing}", "--study-name", "s"])
    assert run.exit_code == 2
    assert "no study database" in run.stderr
    assert not missing.exists()


def test_missing_config_exits_2(tmp_path):
    run = runner.invoke(app, ["report", str(tmp_path / "none.yaml")])
    assert run.exit_code == 2
    assert "none.yaml: no such file" in run.stderr


def test_unwritable_report_dir_exits_2(study, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    run = runner.invoke(app, ["report", "--storage", study[0].storage, "--study-name", "s",
                              "--report-dir", str(blocker / "report")])
    assert run.exit_code == 2
    assert "--report-dir" in run.stderr


def test_a_shared_studys_report_says_per_worker_what_it_measured_and_which_runs_chose(tmp_path):
    from autotune.model_file import load_model_file
    from autotune.plan import plan
    from autotune.search import SearchOptions, run_search
    from tests.fakes import SimulatedRunner
    from tests.unit.test_report import RECIPES, make_profile

    profile, spec = make_profile(), load_model_file(RECIPES / "mlp.py")
    planned = plan(profile, gpus=2, batch_size=32, memory_limit_bytes=LIMIT)
    url = f"sqlite:///{tmp_path / 's.db'}"
    for worker, resume in (("a", False), ("b", True)):
        options = SearchOptions(gpus=2, batch_size=32, n_trials=8, seed=1, memory_limit_bytes=LIMIT, worker=worker,
                                resume=resume)
        last = run_search(spec, profile, planned, options, study_name="s", storage=url, runner=SimulatedRunner())
    assert last.chosen_by == "b"
    out = tmp_path / "out"
    run = runner.invoke(app, ["report", "--storage", url, "--study-name", "s", "--worker", "b", "--report-dir",
                              str(out)])
    assert run.exit_code == 0, run.output
    report = " ".join((out / "report.md").read_text().split())
    assert "## Workers" in report and "chosen by worker **b**'s side-by-side re-runs of the leaders" in report
    assert "| a |" in report and "| b |" in report
    run = runner.invoke(app, ["report", "--storage", url, "--study-name", "s", "--report-dir", str(out)])
    assert run.exit_code == 0 and "every worker's together" in (out / "report.md").read_text()
    run = runner.invoke(app, ["report", "--storage", url, "--study-name", "s", "--worker", "c"])
    assert run.exit_code == 2 and "no worker 'c' launched runs in study 's'; its workers: a, b" in run.output
