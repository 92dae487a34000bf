"""The planner's edge: compiled schedule graphs kept on disk between runs (AUTOTUNE_CACHE_DIR), torch's orders built
in worker processes while the planner simulates, and the cycle collector paused while it plans. `planning()` hands
all of it to the pure planner (autotune.plan, autotune.action_graph), which itself starts no process and writes no
file."""

from __future__ import annotations

import contextlib
import functools
import gc
import hashlib
import importlib.util
import json
import logging
import os
import pickle
import subprocess
import sys
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

from autotune.action_graph import ActionGraph, GraphKey, compiled_graph, graphs_from
from autotune.files import atomic_write_bytes, ensure_writable
from autotune.schedules import Schedule, order_from_torch

logger = logging.getLogger(__name__)

CACHE_ENV = "AUTOTUNE_CACHE_DIR"
"""Where compiled graphs are kept between runs (default $XDG_CACHE_HOME/autotune, else ~/.cache/autotune); set to
an empty string to keep none."""

BUILT_AHEAD_FROM = 8
"""built_ahead starts workers from this many uncached graphs of torch's orders on."""


@contextlib.contextmanager
def planning() -> Iterator[None]:
    """Plan inside this block (the CLI and the search do): graphs from and into the disk cache (when there is
    one), built ahead by workers, and Python's cycle collector paused. The planner allocates millions of small
    acyclic objects (action graphs, candidates, estimates) beside torch's modules, and each full collection walks
    them all; paused, a 128-node plan took ~30 % less time. Its garbage is freed by reference counting; what cycles
    there are wait for the next collection after."""
    folder = graph_folder()
    enabled = gc.isenabled()
    gc.disable()
    try:
        with graphs_from(DiskGraphCache(folder) if folder is not None else None):
            yield
    finally:
        if enabled:
            gc.enable()


class DiskGraphCache:
    """A folder of pickled ActionGraphs, one file per key (action_graph.GraphSource)."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self._ahead: dict[str, subprocess.Popen[bytes]] = {}
        """Graph file names being built ahead, with the worker building each."""

    def load(self, key: GraphKey) -> ActionGraph | None:
        """The stored graph; one a worker of built_ahead is building is waited for."""
        name = graph_name(*key)
        graph = load_graph(self.folder / name)
        if graph is None and name in self._ahead:
            graph = _await_ahead(self.folder / name, self._ahead[name])
        return graph

    def save(self, key: GraphKey, graph: ActionGraph) -> None:
        try:
            atomic_write_bytes(self.folder / graph_name(*key), pickle.dumps(graph, protocol=pickle.HIGHEST_PROTOCOL),
                               durable=False)
        except OSError as e:  # a read-only or full disk costs speed, nothing else
            logger.debug("not caching %s: %s", graph_name(*key), e)

    def ready(self, key: GraphKey) -> bool:
        """False while a worker of built_ahead still builds this graph (load would wait)."""
        name = graph_name(*key)
        if name not in self._ahead or self._ahead[name].poll() is not None:
            return True
        return (self.folder / name).exists()

    @contextlib.contextmanager
    def built_ahead(self, keys: Iterable[GraphKey]) -> Iterator[None]:
        """While the caller works, worker processes build the uncached graphs of `keys` whose orders come from
        torch's schedule classes, in that order, into this folder: this process then never imports
        torch.distributed.pipelining (with torch 3-5 s, and ~1 s more to tear down at exit), and the builds run
        beside its simulations. load waits for a key's file while its worker lives, and compiled_graph builds the
        graph itself otherwise. Only from BUILT_AHEAD_FROM such graphs on, with two or more usable cores and torch
        not imported here (with torch loaded, importing its pipelining here is faster than a worker's start);
        otherwise nothing happens. The workers (one per usable core but one, up to 4; each imports torch) are
        stopped on exit: graphs of keys the caller never asked for (pruned candidates) are not waited for."""
        from autotune.devices import usable_cores

        folder = self.folder
        wanted = [
            key for key in dict.fromkeys((Schedule(s), pp, m, n) for s, pp, m, n in keys)
            if order_from_torch(key[0]) and not (folder / graph_name(*key)).exists()
        ]
        workers = min(4, usable_cores() - 1, len(wanted))
        if workers < 1 or len(wanted) < BUILT_AHEAD_FROM or "torch" in sys.modules:
            yield
            return
        try:  # the workers hand their graphs over through the folder
            ensure_writable(folder, folder=True)
        except OSError as e:
            logger.debug("building torch's orders here: %s", e)
            yield
            return
        started: list[subprocess.Popen[bytes]] = []
        try:
            for w in range(workers):
                share = wanted[w::workers]
                worker = subprocess.Popen(
                    [sys.executable, "-c", "from autotune.graph_cache import _build_ahead; _build_ahead()",
                     str(folder), json.dumps([[s.value, pp, m, n] for s, pp, m, n in share])],
                    stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                )
                started.append(worker)
                self._ahead.update((graph_name(*key), worker) for key in share)
            yield
        finally:
            self._ahead.clear()
            for worker in started:
                worker.kill()
            for worker in started:
                worker.wait()
            for key in wanted:  # a worker stopped mid-write leaves atomic_write_bytes' temp file
                for torn in folder.glob(f".{graph_name(*key)}.*.tmp"):
                    torn.unlink(missing_ok=True)


def _build_ahead() -> None:
    """A worker of DiskGraphCache.built_ahead: build the graphs named in argv[2] (JSON) into the folder argv[1]."""
    with graphs_from(DiskGraphCache(Path(sys.argv[1]))):
        for schedule, pp, m, n in json.loads(sys.argv[2]):
            compiled_graph(Schedule(schedule), pp, m, n)


def _await_ahead(path: Path, worker: subprocess.Popen[bytes]) -> ActionGraph | None:
    """The graph at path once its worker has written it; None when the worker ends without it."""
    pause = 0.001
    while True:
        graph = load_graph(path) if path.exists() else None
        if graph is not None or worker.poll() is not None:
            return graph
        time.sleep(pause)
        pause = min(pause * 2, 0.02)


def graph_name(schedule: Schedule | str, pipeline_degree: int, n_microbatches: int, n_stages: int) -> str:
    return f"{Schedule(schedule).value}-pp{pipeline_degree}-m{n_microbatches}-s{n_stages}.pickle"


def load_graph(path: Path) -> ActionGraph | None:
    try:
        data = path.read_bytes()
    except OSError:
        return None
    try:
        graph = pickle.loads(data)
    except Exception as e:  # noqa: BLE001 - a torn or foreign file is a miss, rebuilt and replaced
        logger.debug("ignoring cached graph %s: %s", path, e)
        return None
    return graph if isinstance(graph, ActionGraph) else None


@functools.cache
def graph_folder() -> Path | None:
    """This torch's and this autotune's folder of cached graphs, or None without a cache. Keyed by the sources the
    graphs come from (torch's schedules and autotune's schedule and graph code), read without importing torch:
    another torch, an edited schedule or a new autotune gets a folder of its own."""
    setting = os.environ.get(CACHE_ENV)
    if setting == "":
        return None
    base = Path(setting) if setting else Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "autotune"
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return None
    torch_dir = Path(next(iter(spec.submodule_search_locations)))
    here = Path(__file__).parent
    sources = [torch_dir / "distributed/pipelining/schedules.py",
               torch_dir / "distributed/pipelining/_schedule_visualizer.py",
               here / "action_graph.py", here / "actions.py", here / "schedules.py", here / "vshape.py",
               here / "compat.py"]
    digest = hashlib.sha256()
    try:
        for source in sources:
            digest.update(source.read_bytes())
    except OSError:
        return None
    return base / "graphs" / digest.hexdigest()[:16]
