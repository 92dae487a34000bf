"""V-Half and V-Min, the controllable-memory V-shape schedules torch does not ship, as per-rank action lists.

Qi et al., "Pipeline Parallelism with Controllable Memory" (NeurIPS 2024, arXiv 2405.15362): a schedule is one
micro-batch's building block repeated every period, and the block's lifespan (a stage's F to its last backward)
bounds the activations a rank holds. Both schedules use the V placement (rank r holds stages r and 2p-1-r) and split
backward into I (input gradient) and W (weight gradient), like ZB-V; their blocks are stretched so that a rank holds
about half (V-Half) or a third (V-Min) of 1F1B's activations.

How the lists are made, after the paper and its public Megatron generator (sail-sg/zero-bubble-pipeline-parallelism,
`--zero-bubble-v-schedule-mem-setup half|min`), with T_F = T_I = T_W = one slot:
  1. the building block: the slot of each F and I of micro-batch 0 on every rank (`_block`);
  2. repeat it every PERIOD = 6 slots (a rank's F, I and W on both of its stages) and put each W into the first
     free slot after its I;
  3. squeeze: move every action, in slot order, to the earliest free slot after its dependencies where its rank's
     activation peak does not grow (this shortens warm-up and cool-down; the steady state is the block's).
The runtime runs each rank's list in order, as fast as the dependencies allow.

V-Half, pp=2, m=4, after squeezing. Rank 0 holds stages 0 and 3, rank 1 stages 1 and 2; capitals are the down leg
(stage 0 / 1), lower case the up leg (stage 3 / 2); I input gradient, W weight gradient, . idle:

    slot    0  1  2  3  4  5  6  7  8  9 10 11 12 13 14 15 16 17 18 19 20 21 22 23 24 25
    rank 0  F0 F1 F2 f0 i0 w0 f1 i1 I0 w1 W0 f2 F3 i2 I1 w2 W1 f3 i3 w3 I2 W2 .  .  I3 W3
    rank 1  .  F0 f0 F1 f1 i0 w0 I0 W0 F2 f2 i1 w1 I1 W1 F3 f3 i2 w2 I2 W2 i3 w3 I3 W3

After F0 F1 F2 f0 rank 0 holds 4 micro-batches' activations of a V stage, i.e. 2 of a whole 1F1B stage (twice the
layers): as much as 1F1B at pp=2, where (p+2)//2 = p. The saving starts at pp=4 (3 against 4; 5 against 8 at pp=8).
"""

from __future__ import annotations

from collections import deque
from typing import Literal

from autotune.actions import Action, ActionKind

MemorySetup = Literal["half", "min"]
"""half: V-Half, about 1/2 of 1F1B's activations; min: V-Min, about 1/3."""

PERIOD = 6
"""Slots of one micro-batch on a rank: F and I on each of its two stages, and their two W."""


def activation_cap(memory: MemorySetup, pipeline_degree: int) -> int:
    """The paper's bound on what one rank holds, in micro-batches of a whole 1F1B stage (both V stages of the rank):
    V-Half (p+2)//2, V-Min (p+4)//3, against 1F1B's p on its first rank. Equal to 1F1B's at p=2."""
    p = pipeline_degree
    return (p + 2) // 2 if memory == "half" else (p + 4) // 3


def v_shape_actions(memory: MemorySetup, pipeline_degree: int, n_microbatches: int) -> list[list[Action]]:
    """Per-rank compute actions (F, I, W) of V-Half or V-Min over 2 x pipeline_degree stages, in execution order."""
    p, m = pipeline_degree, n_microbatches
    timelines = [_repeat_block(memory, p, m, rank) for rank in range(p)]
    _squeeze(timelines, p)
    return [[action for action in timeline if action is not None] for timeline in timelines]


def _block(memory: MemorySetup, p: int, rank: int) -> dict[tuple[int, ActionKind], int]:
    """Slot of each F and I of micro-batch 0 on `rank`, keyed by (stage, kind).

    V-Min: the forward goes one stage per slot (stage s at slot s) and the backward comes straight back, one stage
    per slot: the shortest lifespans the V allows. V-Half: the forward goes down the first leg (stages 0..p-1) one
    stage every 2 slots and up the second leg one per slot; the backward goes down the second leg one stage every 2
    slots and back up the first leg one per slot, so lifespans are longer and the repeated blocks leave fewer
    bubbles. The gap keeps the four slots of a rank distinct modulo PERIOD (checked in tests for p up to 64)."""
    down, up = rank, 2 * p - 1 - rank
    if memory == "min":
        gap = 2 if p % 3 == 0 else 0
        return {(down, "F"): rank, (up, "F"): up, (up, "I"): 2 * p + gap + rank, (down, "I"): 4 * p - 1 + gap - rank}
    gap = 3 if p % 2 == 0 else 0
    return {
        (down, "F"): 2 * rank,
        (up, "F"): 3 * p - 2 - rank,
        (up, "I"): 3 * p - 1 + gap + 2 * rank,
        (down, "I"): 6 * p - 2 + gap - rank,
    }


def _repeat_block(memory: MemorySetup, p: int, m: int, rank: int) -> list[Action | None]:
    """One rank's slots: the block every PERIOD slots, each W in the first free slot after its I (up leg first)."""
    block = _block(memory, p, rank)
    timeline: list[Action | None] = [None] * (max(block.values()) + PERIOD * (m - 1) + 1)
    for mb in range(m):
        for (stage, kind), slot in block.items():
            timeline[slot + PERIOD * mb] = Action(stage, kind, mb)
    down, up = rank, 2 * p - 1 - rank
    waiting: dict[int, deque[int]] = {up: deque(), down: deque()}
    for slot, action in enumerate(timeline):
        if action is None:
            ready = next((s for s in (up, down) if waiting[s]), None)
            if ready is not None:
                timeline[slot] = Action(ready, "W", waiting[ready].popleft())
        elif action.kind == "I":
            waiting[action.stage].append(action.microbatch)
    for stage in (up, down):
        timeline.extend(Action(stage, "W", mb) for mb in waiting[stage])
    return timeline


def _squeeze(timelines: list[list[Action | None]], p: int) -> None:
    """Move each action, in slot order, to the earliest free slot of its rank after its dependencies, unless that
    raises the rank's peak of held activations (F holds one stage's, W releases it)."""
    n_stages = 2 * p
    rank_of = [s if s < p else n_stages - 1 - s for s in range(n_stages)]
    where: dict[tuple[int, str, int], int] = {}
    for timeline in timelines:
        for slot, action in enumerate(timeline):
            if action is not None:
                where[action.stage, action.kind, action.microbatch] = slot
    # held[r][t]: activations rank r holds after slot t.
    held: list[list[int]] = []
    for timeline in timelines:
        level, levels = 0, []
        for action in timeline:
            level += _held_delta(action)
            levels.append(level)
        held.append(levels)
    caps = [max(levels, default=0) for levels in held]

    for key in sorted(where, key=lambda k: (where[k], rank_of[k[0]])):
        stage, kind, mb = key
        rank, slot = rank_of[stage], where[key]
        timeline, levels = timelines[rank], held[rank]
        earliest = max((where[d] + 1 for d in _dependencies(stage, kind, mb, n_stages)), default=0)
        for new in range(earliest, slot):
            if timeline[new] is not None:
                continue
            delta = _held_delta(timeline[slot])
            if delta > 0 and max(levels[new:slot]) + delta > caps[rank]:
                continue
            timeline[new], timeline[slot] = timeline[slot], None
            for t in range(new, slot):
                levels[t] += delta
            where[key] = new
            break


def _held_delta(action: Action | None) -> int:
    if action is None:
        return 0
    return 1 if action.kind == "F" else -1 if action.kind == "W" else 0


def _dependencies(stage: int, kind: str, mb: int, n_stages: int) -> list[tuple[int, str, int]]:
    """What must finish first: the neighbouring stage's action for the same micro-batch, this stage's previous action
    of the same kind (each stage runs each kind in micro-batch order), and F before I before W."""
    deps = [(stage, kind, mb - 1)] if mb > 0 else []
    if kind == "F" and stage > 0:
        deps.append((stage - 1, "F", mb))
    elif kind == "I":
        deps.append((stage, "F", mb))
        if stage < n_stages - 1:
            deps.append((stage + 1, "I", mb))
    elif kind == "W":
        deps.append((stage, "I", mb))
    return deps
