"""Per-rank action lists compiled into a dependency graph the simulator replays: each action's previous action
on its rank, the other stage's action whose tensor it needs, its own stage's earlier action, and one topological
order (an action list that has none deadlocks). A schedule's own graph is kept on disk between runs
(AUTOTUNE_CACHE_DIR)."""

from __future__ import annotations

import contextlib
import functools
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
from dataclasses import dataclass
from pathlib import Path

from autotune.errors import AutotuneError
from autotune.files import atomic_write_bytes, ensure_writable
from autotune.schedules import Action, ActionKind, Schedule, action_lists, order_from_torch

logger = logging.getLogger(__name__)

CACHE_ENV = "AUTOTUNE_CACHE_DIR"
"""Where compiled graphs are kept between runs (default $XDG_CACHE_HOME/autotune, else ~/.cache/autotune); set to
an empty string to keep none."""


class DeadlockError(AutotuneError):
    """An action list that can never finish: some rank waits on work that waits on it (exit 1: a schedule bug)."""

    exit_code = 1


@dataclass(frozen=True, kw_only=True)
class ActionGraph:
    """Action lists flattened to arrays, with each action's dependencies and one topological order."""

    rank: tuple[int, ...]
    stage: tuple[int, ...]
    kind: tuple[ActionKind, ...]
    microbatch: tuple[int, ...]
    prev: tuple[int, ...]
    """Previous action on the same rank, or -1."""
    dep: tuple[int, ...]
    """The other stage's action whose tensor this one needs (F: F of s-1; B/I: B/I of s+1), or -1."""
    cross: tuple[bool, ...]
    """dep runs on another rank, so its tensor travels."""
    messages: tuple[int, ...]
    """Sends and receives the action posts: one receive if dep crosses ranks, one send per action on another rank
    that needs its tensor."""
    own: tuple[int, ...]
    """This stage's earlier action it needs (B/I: F; W: I), or -1."""
    order: tuple[int, ...]
    rank_actions: tuple[tuple[int, ...], ...]
    stage_rank: tuple[int, ...]
    in_flight: tuple[int, ...]
    """Per stage, the most micro-batches held at once."""
    slot: tuple[int, ...]
    """Where the action's per-stage figures sit in a kind-major table (F, B, I, W; n_stages entries each):
    KINDS.index(kind) * n_stages + stage. The simulator looks up every action's duration by it."""


KINDS: tuple[ActionKind, ...] = ("F", "B", "I", "W")
"""The order of ActionGraph.slot's kind-major tables."""


@functools.lru_cache(maxsize=128)  # ~1 MB per plan of 10k actions
def compiled_graph(schedule: Schedule, pipeline_degree: int, n_microbatches: int, n_stages: int) -> ActionGraph:
    """The graph of a schedule's own action lists (cached: the planner simulates many candidates per schedule),
    kept on disk between runs: building torch's orders needs torch.distributed.pipelining (~2 s to import) and
    ~10 ms a schedule, a 128-node plan builds 120 of them, and a repeated plan then imports no torch at all. A graph
    a worker of torch_orders_built_ahead is building is waited for."""
    name = _graph_name(schedule, pipeline_degree, n_microbatches, n_stages)
    folder = _graph_folder()
    if folder is not None:
        graph = _load_graph(folder / name)
        if graph is None and name in _ahead:
            graph = _await_ahead(folder / name, _ahead[name])
        if graph is not None:
            return graph
    lists = action_lists(schedule, pipeline_degree, n_microbatches, n_stages)
    graph = compile_graph(tuple(tuple(rank) for rank in lists), n_stages, n_microbatches)
    if folder is not None:
        try:
            atomic_write_bytes(folder / name, pickle.dumps(graph, protocol=pickle.HIGHEST_PROTOCOL), durable=False)
        except OSError as e:  # a read-only or full disk costs speed, nothing else
            logger.debug("not caching %s: %s", name, e)
    return graph


GraphKey = tuple[Schedule, int, int, int]
"""(schedule, pipeline_degree, n_microbatches, n_stages): compiled_graph's arguments."""

BUILT_AHEAD_FROM = 8
"""torch_orders_built_ahead starts workers from this many uncached graphs of torch's orders on."""

_ahead: dict[str, subprocess.Popen[bytes]] = {}
"""Graph file names being built ahead, with the worker building each."""


@contextlib.contextmanager
def torch_orders_built_ahead(keys: Iterable[GraphKey]) -> Iterator[None]:
    """While the caller works, worker processes build the uncached graphs of `keys` whose orders come from torch's
    schedule classes, in that order, into the disk cache: this process then never imports
    torch.distributed.pipelining (with torch 3-5 s, and ~1 s more to tear down at exit), and the builds run beside
    its simulations. compiled_graph waits for a key's file while its worker lives and builds the graph itself
    otherwise. Only with a disk cache, from BUILT_AHEAD_FROM such graphs on, with two or more usable cores and
    torch not imported here (with torch loaded, importing its pipelining here is faster than a worker's start);
    otherwise nothing happens. The workers (one per usable core but one, up to 4; each imports torch) are stopped
    on exit: graphs of keys the caller never asked for (pruned candidates) are not waited for."""
    from autotune.devices import usable_cores

    folder = _graph_folder()
    wanted = [] if folder is None else [
        key for key in dict.fromkeys((Schedule(s), pp, m, n) for s, pp, m, n in keys)
        if order_from_torch(key[0]) and not (folder / _graph_name(*key)).exists()
    ]
    workers = min(4, usable_cores() - 1, len(wanted))
    if folder is None or workers < 1 or len(wanted) < BUILT_AHEAD_FROM or "torch" in sys.modules:
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
                [sys.executable, "-c", "from autotune.action_graph import _build_ahead; _build_ahead()",
                 json.dumps([[s.value, pp, m, n] for s, pp, m, n in share])],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            )
            started.append(worker)
            _ahead.update((_graph_name(*key), worker) for key in share)
        yield
    finally:
        _ahead.clear()
        for worker in started:
            worker.kill()
        for worker in started:
            worker.wait()
        for key in wanted:  # a worker stopped mid-write leaves atomic_write_bytes' temp file
            for torn in folder.glob(f".{_graph_name(*key)}.*.tmp"):
                torn.unlink(missing_ok=True)


def graph_ready(schedule: Schedule, pipeline_degree: int, n_microbatches: int, n_stages: int) -> bool:
    """False while a worker of torch_orders_built_ahead still builds this graph (compiled_graph would wait)."""
    name = _graph_name(schedule, pipeline_degree, n_microbatches, n_stages)
    if name not in _ahead or _ahead[name].poll() is not None:
        return True
    folder = _graph_folder()
    return folder is None or (folder / name).exists()


def _build_ahead() -> None:
    """A worker of torch_orders_built_ahead: build the graphs named in argv[1] (JSON) into the disk cache."""
    for schedule, pp, m, n in json.loads(sys.argv[1]):
        compiled_graph(Schedule(schedule), pp, m, n)


def _await_ahead(path: Path, worker: subprocess.Popen[bytes]) -> ActionGraph | None:
    """The graph at path once its worker has written it; None when the worker ends without it."""
    pause = 0.001
    while True:
        graph = _load_graph(path) if path.exists() else None
        if graph is not None or worker.poll() is not None:
            return graph
        time.sleep(pause)
        pause = min(pause * 2, 0.02)


def _graph_name(schedule: Schedule | str, pipeline_degree: int, n_microbatches: int, n_stages: int) -> str:
    return f"{Schedule(schedule).value}-pp{pipeline_degree}-m{n_microbatches}-s{n_stages}.pickle"


def _load_graph(path: Path) -> ActionGraph | None:
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
def _graph_folder() -> Path | None:
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
               here / "action_graph.py", here / "schedules.py", here / "vshape.py", here / "compat.py"]
    digest = hashlib.sha256()
    try:
        for source in sources:
            digest.update(source.read_bytes())
    except OSError:
        return None
    return base / "graphs" / digest.hexdigest()[:16]


def compile_graph(lists: tuple[tuple[Action, ...], ...], n_stages: int, n_microbatches: int) -> ActionGraph:
    """The graph of the given per-rank lists; a DeadlockError names what is missing, doubled or waits forever."""
    rank: list[int] = []
    where: dict[tuple[int, str, int], int] = {}
    stage_rank: dict[int, int] = {}
    for r, actions in enumerate(lists):
        for act in actions:
            key = (act.stage, act.kind, act.microbatch)
            if key in where:
                raise DeadlockError(f"rank {r} runs {act} twice; each stage runs each action once per micro-batch")
            if stage_rank.setdefault(act.stage, r) != r:
                raise DeadlockError(
                    f"stage {act.stage} has actions on ranks {stage_rank[act.stage]} and {r}; a stage lives on one rank"
                )
            where[key] = len(rank)
            rank.append(r)
    flat = [act for actions in lists for act in actions]
    for s in range(n_stages):
        for i in range(n_microbatches):
            has_b = (s, "B", i) in where
            split = (s, "I", i) in where, (s, "W", i) in where
            if (s, "F", i) not in where or not (has_b or all(split)) or (has_b and any(split)):
                raise DeadlockError(
                    f"the action lists lack stage {s}'s work for micro-batch {i}: each stage needs F and either B or "
                    f"I and W for every micro-batch"
                )
    if set(stage_rank) != set(range(n_stages)):
        raise DeadlockError(f"the action lists name stages {sorted(stage_rank)}, expected 0..{n_stages - 1}")

    n = len(flat)
    prev, dep, own, cross = [-1] * n, [-1] * n, [-1] * n, [False] * n
    offset = 0
    for actions in lists:
        for k in range(1, len(actions)):
            prev[offset + k] = offset + k - 1
        offset += len(actions)
    for a, act in enumerate(flat):
        s, i = act.stage, act.microbatch
        if act.kind == "F":
            d = where.get((s - 1, "F", i), -1)
        elif act.kind in ("B", "I"):
            d = where.get((s + 1, "B", i), where.get((s + 1, "I", i), -1)) if s < n_stages - 1 else -1
            own[a] = where[(s, "F", i)]
        else:
            d = -1
            own[a] = where[(s, "I", i)]
        dep[a] = d
        cross[a] = d >= 0 and rank[d] != rank[a]
    sends = [0] * n
    for a in range(n):
        if cross[a]:
            sends[dep[a]] += 1

    rank_actions = []
    offset = 0
    for actions in lists:
        rank_actions.append(tuple(range(offset, offset + len(actions))))
        offset += len(actions)
    # One topological order: sweep the ranks, each running its actions while their tensors are ready, until a sweep
    # runs nothing. What is left never becomes ready: a deadlock. (Any topological order replays to the same times.)
    done = bytearray(n)
    order: list[int] = []
    next_action = [ids[0] if ids else 0 for ids in rank_actions]
    ends = [ids[-1] + 1 if ids else 0 for ids in rank_actions]
    moved = True
    while moved:
        moved = False
        for r, a in enumerate(next_action):
            start = a
            while a < ends[r] and not ((dep[a] >= 0 and not done[dep[a]]) or (own[a] >= 0 and not done[own[a]])):
                done[a] = 1
                order.append(a)
                a += 1
            if a != start:
                next_action[r] = a
                moved = True
    if len(order) < n:
        stuck = []
        for r, ids in enumerate(rank_actions):
            first = next((a for a in ids if not done[a]), None)
            if first is not None:
                needs = [str(flat[d]) for d in (dep[first], own[first]) if d >= 0 and not done[d]]
                stuck.append(f"rank {r} at {flat[first]} waits for {', '.join(needs) or 'its previous action'}")
        raise DeadlockError("the schedule deadlocks: " + "; ".join(stuck) + "; fix the action order")

    in_flight = [0] * n_stages
    live = [0] * n_stages
    for act in flat:  # per stage, list order on its own rank is time order
        if act.kind == "F":
            live[act.stage] += 1
            in_flight[act.stage] = max(in_flight[act.stage], live[act.stage])
        elif act.kind in ("B", "W"):
            live[act.stage] -= 1
    first_slot = {kind: i * n_stages for i, kind in enumerate(KINDS)}
    return ActionGraph(
        rank=tuple(rank),
        stage=tuple(a.stage for a in flat),
        kind=tuple(a.kind for a in flat),
        microbatch=tuple(a.microbatch for a in flat),
        prev=tuple(prev),
        dep=tuple(dep),
        cross=tuple(cross),
        messages=tuple(int(c) + k for c, k in zip(cross, sends)),
        own=tuple(own),
        order=tuple(order),
        rank_actions=tuple(rank_actions),
        stage_rank=tuple(stage_rank[s] for s in range(n_stages)),
        in_flight=tuple(in_flight),
        slot=tuple(first_slot[a.kind] + a.stage for a in flat),
    )
