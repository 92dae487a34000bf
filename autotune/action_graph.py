"""Pure: per-rank action lists compiled into a dependency graph the simulator replays: each action's previous action
on its rank, the other stage's action whose tensor it needs, its own stage's earlier action, and one topological
order (an action list that has none deadlocks). Keeping graphs on disk between runs is the edge's business
(autotune.graph_cache, installed with graphs_from)."""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

from autotune.errors import AutotuneError
from autotune.schedules import Action, ActionKind, Schedule, action_lists


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
    fused_end: tuple[int, ...]
    """The last action of the run of fused actions this one is in (Action.fused_with_next: torch runs DualPipeV's
    OVERLAP_F_B, a forward and a backward, as one action and posts their sends after both); itself if not fused."""
    sent: tuple[int, ...]
    """The action whose end sends this one the tensor it needs: fused_end of dep; -1 without dep."""
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


GraphKey = tuple[Schedule, int, int, int]
"""(schedule, pipeline_degree, n_microbatches, n_stages): compiled_graph's arguments."""


class GraphSource(Protocol):
    """Where compiled graphs may come from besides building them: a store the caller hands in at the edge
    (autotune.graph_cache keeps them on disk and builds torch's orders in worker processes). The planning code
    itself starts no process and writes no file."""

    def load(self, key: GraphKey) -> ActionGraph | None:
        """The stored graph of key, waiting for one being built for it; None: build it here."""

    def save(self, key: GraphKey, graph: ActionGraph) -> None:
        """Keep a graph built here."""

    def ready(self, key: GraphKey) -> bool:
        """False while load(key) would wait."""

    def built_ahead(self, keys: Iterable[GraphKey]) -> contextlib.AbstractContextManager[None]:
        """While the caller works, build these keys' graphs elsewhere (the caller's most likely order)."""


_source: contextvars.ContextVar[GraphSource | None] = contextvars.ContextVar("autotune_graph_source", default=None)


def graph_source() -> GraphSource | None:
    """The source graphs_from installed, if any."""
    return _source.get()


@contextlib.contextmanager
def graphs_from(source: GraphSource | None) -> Iterator[None]:
    """compiled_graph asks source for its graphs (and hands it the ones it builds) inside the block."""
    token = _source.set(source)
    try:
        yield
    finally:
        _source.reset(token)


@functools.lru_cache(maxsize=128)  # ~1 MB per plan of 10k actions
def compiled_graph(schedule: Schedule, pipeline_degree: int, n_microbatches: int, n_stages: int) -> ActionGraph:
    """The graph of a schedule's own action lists, cached in memory (the planner simulates many candidates per
    schedule); from the installed GraphSource when it has it: building torch's orders needs
    torch.distributed.pipelining (~2 s to import) and ~10 ms a schedule, and a 128-node plan builds 120 of them."""
    key = (Schedule(schedule), pipeline_degree, n_microbatches, n_stages)
    source = _source.get()
    if source is not None:
        graph = source.load(key)
        if graph is not None:
            return graph
    lists = action_lists(schedule, pipeline_degree, n_microbatches, n_stages)
    graph = compile_graph(tuple(tuple(rank) for rank in lists), n_stages, n_microbatches)
    if source is not None:
        source.save(key, graph)
    return graph


def sweep_order(
    rank_actions: Sequence[Sequence[int]], ready: Callable[[int, bytearray], object]
) -> tuple[list[int], bytearray]:
    """Sweep the ranks, each running its actions (ids rising along its list) while ready(action, done) is true,
    until a sweep runs nothing: the actions in the order they ran, and done (1 per action run; done[-1], one past
    the actions, is 1, so an absent dependency -1 reads as done)."""
    n = sum(map(len, rank_actions))
    done = bytearray(n + 1)
    done[n] = 1
    order: list[int] = []
    next_action = [ids[0] if ids else 0 for ids in rank_actions]
    ends = [ids[-1] + 1 if ids else 0 for ids in rank_actions]
    moved = True
    while moved:
        moved = False
        for r, a in enumerate(next_action):
            start = a
            while a < ends[r] and ready(a, done):
                done[a] = 1
                order.append(a)
                a += 1
            if a != start:
                next_action[r] = a
                moved = True
    return order, done


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
    fused_end = list(range(n))  # per action, the last action of the fused run it is in (itself unless fused)
    for a in range(n - 2, -1, -1):
        if flat[a].fused_with_next and rank[a + 1] == rank[a]:
            fused_end[a] = fused_end[a + 1]
    sent = [fused_end[d] if d >= 0 else -1 for d in dep]

    rank_actions = []
    offset = 0
    for actions in lists:
        rank_actions.append(tuple(range(offset, offset + len(actions))))
        offset += len(actions)
    # One topological order. What is left never becomes ready: a deadlock. (Any topological order replays to the
    # same times.)
    order, done = sweep_order(rank_actions, lambda a, done: done[sent[a]] and done[own[a]])
    if len(order) < n:
        stuck = []
        for r, ids in enumerate(rank_actions):
            first = next((a for a in ids if not done[a]), None)
            if first is not None:
                needs = [str(flat[d]) for d in (sent[first], own[first]) if d >= 0 and not done[d]]
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
        fused_end=tuple(fused_end),
        sent=tuple(sent),
        messages=tuple(int(c) + k for c, k in zip(cross, sends)),
        own=tuple(own),
        order=tuple(order),
        rank_actions=tuple(rank_actions),
        stage_rank=tuple(stage_rank[s] for s in range(n_stages)),
        in_flight=tuple(in_flight),
        slot=tuple(first_slot[a.kind] + a.stage for a in flat),
    )
