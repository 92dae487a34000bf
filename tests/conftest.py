"""Shared fixtures: small model files written on the fly, including broken and faulty ones."""

from __future__ import annotations

import os
import signal
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

# A suite started in the background (`pytest &` in a script, nohup) inherits SIGINT ignored, and so does every
# autotune it starts: the Ctrl-C tests would send signals nobody hears. Start from Python's own handler, as a suite
# started from a terminal does.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

ROOT = Path(__file__).resolve().parents[1]
RECIPES = ROOT / "recipes"

# A 4-layer MLP following the contract. {last_layer} is the class of the last layer, {extra} lines at module level.
MODEL_TEMPLATE = '''
import os, time
import torch
from torch import nn

{extra}

class Last(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(16, 4)

    def forward(self, x):
{last_forward}
        return self.linear(x)


def build_model():
    with open({pid_file!r}, "a") as f:
        f.write(f"{{os.getpid()}}\\n")
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), Last())


def make_batch(batch_size):
    g = torch.Generator().manual_seed(0)
    return torch.randn(batch_size, 8, generator=g), torch.randn(batch_size, 4, generator=g)


def loss_fn(output, target):
    return nn.functional.mse_loss(output, target)
'''


@pytest.fixture(scope="session", autouse=True)
def graph_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The suite's own cache of compiled schedule graphs (graph_cache.CACHE_ENV), for this process and the CLI and
    rank processes it starts: the user's ~/.cache stays untouched, and every session starts cold."""
    from autotune.graph_cache import CACHE_ENV
    from autotune.graph_cache import graph_folder as _graph_folder

    folder = tmp_path_factory.mktemp("graph-cache")
    saved = os.environ.get(CACHE_ENV)
    os.environ[CACHE_ENV] = str(folder)
    _graph_folder.cache_clear()
    yield folder
    if saved is None:
        os.environ.pop(CACHE_ENV, None)
    else:
        os.environ[CACHE_ENV] = saved
    _graph_folder.cache_clear()


@pytest.fixture
def model_file(tmp_path: Path) -> Callable[..., Path]:
    """model_file(last_forward="raise ValueError('boom')") -> path of a 4-layer model file with that fault."""

    def write(last_forward: str = "pass", extra: str = "", name: str = "model.py") -> Path:
        path = tmp_path / name
        body = MODEL_TEMPLATE.format(
            last_forward=textwrap.indent(textwrap.dedent(last_forward), " " * 8),
            extra=textwrap.dedent(extra),
            pid_file=str(tmp_path / "pids.txt"),
        )
        path.write_text(body)
        return path

    return write


def rank_pids(model_path: Path) -> list[int]:
    """Pids of every process that built the model from this file (the parent's meta build included)."""
    pid_file = model_path.parent / "pids.txt"
    return [int(line) for line in pid_file.read_text().split()] if pid_file.exists() else []


@pytest.fixture(scope="session")
def postgres_server():
    """A throwaway PostgreSQL server for the session (tests.pg); skipped, with the reason, where none can start."""
    from tests import pg

    why = pg.why_not()
    if why:
        pytest.skip(f"no PostgreSQL: {why}")
    with pg.throwaway_server() as server:
        yield server


@pytest.fixture(params=["sqlite", "postgresql"])
def shared_storage_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A fresh, empty storage: an SQLite file, or a database of its own on the throwaway PostgreSQL server."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'shared.db'}"
    return request.getfixturevalue("postgres_server").create_database()
