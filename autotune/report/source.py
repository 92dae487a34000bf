"""Find the study a report is built from: a tuned config's search section, or an explicit storage URL and name."""

from __future__ import annotations

import urllib.parse
from dataclasses import dataclass
from pathlib import Path

from autotune.costs import Profile
from autotune.errors import UsageError
from autotune.records import SearchResult


@dataclass(frozen=True, kw_only=True)
class StudySource:
    """Where the study lives, and the config that named it (if any)."""

    storage: str
    study_name: str
    config_path: Path | None = None


def locate_study(config_path: Path | None, storage: str | None, study_name: str | None) -> StudySource:
    """The study to report on. An explicit --storage / --study-name wins over the config's search section (a
    config keeps its storage URL with the password masked, so such a study needs --storage)."""
    if config_path is None:
        if not storage or not study_name:
            raise UsageError("say which search to report on: pass a CONFIG, or --storage URL and --study-name NAME")
        return StudySource(storage=_local_sqlite(storage, None), study_name=study_name)
    from autotune.config_file import load_config

    search = load_config(config_path).search
    name = study_name or search.study
    url = storage or search.storage
    if not name or not url:
        raise UsageError(
            f"{config_path}: the config names no study (it came from a single trial, not a search); pass --storage "
            f"URL and --study-name NAME of a search"
        )
    if storage is None and "***" in url:
        raise UsageError(
            f"{config_path}: its search.storage {url} has the password masked; pass --storage with the full URL"
        )
    return StudySource(storage=_local_sqlite(url, config_path), study_name=name, config_path=config_path)


def load_study(source: StudySource, worker: str | None = None) -> tuple[SearchResult, Profile]:
    """load_search: a storage that cannot be opened (bad URL, no driver, unreachable database) or a study that is
    not there is the user's error (StorageError / UsageError, exit 2, masked URL); anything else is a bug (exit 1).
    A shared study's choice is worker's, else that of the worker whose choice the config holds."""
    from autotune.search import load_search  # Optuna: only this reads a storage

    config = None
    if source.config_path is not None:
        from autotune.config_file import load_config

        config = load_config(source.config_path).candidate
    return load_search(source.storage, source.study_name, worker=worker, config=config)


def _local_sqlite(url: str, config_path: Path | None) -> str:
    """A sqlite URL must name an existing file (optuna would create an empty one). A relative path is relative to
    where the search ran; when it is not found from here, try beside the config."""
    if not url.startswith("sqlite:///"):
        return url
    path = Path(urllib.parse.unquote(url[len("sqlite:///"):]))
    if path.exists():
        return url
    if config_path is not None and not path.is_absolute():
        beside = config_path.parent / path
        if beside.exists():
            return f"sqlite:///{beside}"
    raise UsageError(
        f"no study database at {path} (from {url}); run autotune report from the folder the search ran in, or pass "
        f"--storage with the database's path"
    )
