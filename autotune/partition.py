"""Pure: per-layer costs -> layers_per_stage (uniform, exact min-max, memory-aware, placement-aware)."""

from __future__ import annotations

import bisect
import functools
import random
from collections.abc import Callable, Sequence
from itertools import accumulate, pairwise

from autotune.candidate import uniform_split
from autotune.costs import LayerCost
from autotune.errors import InfeasibleError, InvalidCandidateError, UsageError
from autotune.schedules import Schedule, stage_ranks
from autotune.units import format_bytes

StageMemory = Callable[[int, int, int], float]
"""stage_memory(stage, start, stop) -> bytes that stage needs when it holds layers[start:stop].

The memory-aware searches are exact when a stage that fits still fits after losing a layer at either end. It must be a
function of its arguments alone: balance_for_schedule computes each (stage, start, stop) once."""

_WORK_BUDGET = 4_000_000
"""Stage-cost evaluations one balance_for_schedule may spend (a round of moves over S stages costs S^2 (S+1)):
16 stages use ~0.3-0.5M, 32 stages ~2.8M, so it binds from ~48 stages on, keeping one call under ~0.5 s."""

EVEN_WITHIN = 0.03
"""Splits whose busiest rank is within this fraction of the best split's count as equally fast, and the most even of
them (in layers per stage) is taken: profiled layer times carry a few per cent of noise (repeated profiles spread by
up to 8 %, bench/results/profile_stability.md), and a person trusts [6, 6, 6, 6] over [8, 5, 7, 4] for equal layers."""

# Relative slack when comparing a segment sum with a bottleneck drawn from the same prefix sums: a + (b - a) can
# round one ulp above b.
_EPS = 1e-12


def part_costs(costs: Sequence[float], layers_per_stage: Sequence[int]) -> list[float]:
    """The summed cost of each part of a split."""
    prefix = _prefix(costs)
    bounds = list(accumulate(layers_per_stage, initial=0))
    return [prefix[b] - prefix[a] for a, b in pairwise(bounds)]


def bottleneck(costs: Sequence[float], layers_per_stage: Sequence[int]) -> float:
    """The cost of the most expensive part of a split."""
    return max(part_costs(costs, layers_per_stage))


def balance_min_max(costs: Sequence[float], n_parts: int) -> tuple[int, ...]:
    """The contiguous split into n_parts non-empty parts whose most expensive part is as cheap as possible (exact).

    The optimal bottleneck is one of the O(n^2) segment sums; binary search over them with a greedy feasibility
    check (each part takes layers while it stays under the bottleneck) finds it in O(n^2 log n)."""
    return _min_max(costs, n_parts, None, None)


def balance_under_memory(
    costs: Sequence[float], n_parts: int, *, stage_memory: StageMemory, memory_cap: float
) -> tuple[int, ...]:
    """balance_min_max, keeping every part's stage_memory under memory_cap.

    Raises InfeasibleError naming the smallest cap any split reaches when no split fits."""
    return _min_max(costs, n_parts, stage_memory, memory_cap)


def additive_memory(
    layer_bytes: Sequence[float], *, fixed_bytes: float = 0.0, multipliers: Sequence[float] | None = None
) -> StageMemory:
    """A StageMemory summing per-layer bytes, times a per-stage multiplier (e.g. in-flight micro-batches), plus a
    fixed amount per stage."""
    prefix = _prefix(layer_bytes)

    def stage_memory(stage: int, start: int, stop: int) -> float:
        scale = multipliers[stage] if multipliers is not None else 1.0
        return fixed_bytes + scale * (prefix[stop] - prefix[start])

    return stage_memory


def min_memory_cap(n_layers: int, n_parts: int, stage_memory: StageMemory) -> float:
    """The smallest per-part memory cap that some split meets (bisection to 0.1 %, rounded up)."""
    _check_counts(n_layers, n_parts)
    free = [0.0] * n_layers
    hi = max(stage_memory(j, 0, n_layers) for j in range(n_parts)) or 1.0
    while _greedy(_prefix(free), n_parts, 0.0, stage_memory, hi) is None:
        hi *= 2  # stage_memory is not monotone in the slice (receive buffers depend on the cut): widen
        if hi > 1e30:
            return float("inf")
    lo = 0.0
    while hi - lo > 1e-3 * hi:
        mid = (lo + hi) / 2
        if _greedy(_prefix(free), n_parts, 0.0, stage_memory, mid) is None:
            lo = mid
        else:
            hi = mid
    return hi


def rank_loads(
    costs: Sequence[float], layers_per_stage: Sequence[int], schedule: Schedule, pipeline_degree: int
) -> list[float]:
    """Summed cost of the stages each pipeline rank holds (loop or V placement for multi-stage schedules)."""
    loads = [0.0] * pipeline_degree
    ranks = stage_ranks(schedule, pipeline_degree, len(layers_per_stage))
    for rank, cost in zip(ranks, part_costs(costs, layers_per_stage)):
        loads[rank] += cost
    return loads


def layer_times(costs: Sequence[LayerCost], *, checkpointing: bool = False) -> list[float]:
    """What the balanced split evens out, per layer: forward + backward time, plus the forward again when the stage
    is checkpointed (its backward recomputes it)."""
    if checkpointing:
        return [2 * c.forward_ms + c.backward_ms for c in costs]
    return [c.forward_ms + c.backward_ms for c in costs]


def balanced_split(
    costs: Sequence[LayerCost], schedule: Schedule, pipeline_degree: int, n_stages: int, *, checkpointing: bool = False
) -> tuple[int, ...]:
    """The time-balanced split the planner and the search start from: balance_for_schedule of layer_times."""
    return balance_for_schedule(layer_times(costs, checkpointing=checkpointing), schedule, pipeline_degree, n_stages)


def evened(
    costs: Sequence[float],
    layers_per_stage: Sequence[int],
    schedule: Schedule,
    pipeline_degree: int,
    *,
    within: float = EVEN_WITHIN,
) -> tuple[int, ...]:
    """The split moved toward the uniform one as far as its busiest rank stays within `within` of the given split's:
    the uniform split itself when it qualifies, else each stage boundary stepped toward its uniform place while
    the two stages it moves keep their ranks under the bound (ties between equally fast splits go to balance)."""
    n_stages = len(layers_per_stage)
    ranks = stage_ranks(schedule, pipeline_degree, n_stages)
    bound = max(rank_loads(costs, layers_per_stage, schedule, pipeline_degree)) * (1 + within) * (1 + _EPS)
    target = uniform_split(len(costs), n_stages)
    if max(rank_loads(costs, target, schedule, pipeline_degree)) <= bound:
        return target
    prefix = _prefix(costs)
    cuts = list(accumulate(layers_per_stage, initial=0))
    goal = list(accumulate(target, initial=0))
    loads = [0.0] * pipeline_degree
    for stage, rank in enumerate(ranks):
        loads[rank] += prefix[cuts[stage + 1]] - prefix[cuts[stage]]
    moved = True
    while moved:  # each move brings one cut a layer nearer its goal, so this ends
        moved = False
        for j in range(1, n_stages):
            if cuts[j] == goal[j]:
                continue
            new = cuts[j] + (1 if goal[j] > cuts[j] else -1)
            if not cuts[j - 1] < new < cuts[j + 1]:
                continue
            before = {ranks[j - 1]: loads[ranks[j - 1]], ranks[j]: loads[ranks[j]]}
            changed = dict(before)
            changed[ranks[j - 1]] += (prefix[new] - prefix[cuts[j - 1]]) - (prefix[cuts[j]] - prefix[cuts[j - 1]])
            changed[ranks[j]] += (prefix[cuts[j + 1]] - prefix[new]) - (prefix[cuts[j + 1]] - prefix[cuts[j]])
            if all(load <= bound for load in changed.values()):
                loads[ranks[j - 1]], loads[ranks[j]] = changed[ranks[j - 1]], changed[ranks[j]]
                cuts[j] = new
                moved = True
    return tuple(b - a for a, b in pairwise(cuts))


def balance_for_schedule(
    costs: Sequence[float],
    schedule: Schedule,
    pipeline_degree: int,
    n_stages: int,
    *,
    stage_memory: StageMemory | None = None,
    memory_cap: float | None = None,
    kicks: int | None = None,
    explain: bool = True,
) -> tuple[int, ...]:
    """A split whose busiest rank (sum of the stages it holds) is as cheap as local search finds.

    Single-stage schedules: the exact min-max split. Multi-stage ones (loop: rank r holds r, r+pp, ...; V: r and
    2pp-1-r): start from the min-max split of the stages (and from the uniform one), shift runs of cuts by one layer
    while that lowers the sorted rank loads (lexicographically), then `kicks` times (default: 16 up to 16 stages,
    fewer on longer pipelines, where each descent costs ~S^3) move a few random cuts and
    descend again, keeping what improves (seeded by the costs: same input, same split). Not exact: on random
    small cases it finds the optimum about 9 times in 10 and stays within ~10 % of it. With stage_memory and
    memory_cap the cap bounds each RANK's summed stage memory: the start is the time-balanced split under the
    smallest per-stage cap (from memory_cap / stages-per-rank up) whose ranks fit, and moves keep them fitting.
    explain=False: when nothing fits, an InfeasibleError without the leanest split's need in its message (finding it
    costs more than the split itself; a caller that only tries, like the planner, skips it)."""
    _check_counts(len(costs), n_stages)
    if (stage_memory is None) != (memory_cap is None):
        raise UsageError("pass stage_memory and memory_cap together, or neither")
    if n_stages % pipeline_degree:
        raise InvalidCandidateError(
            f"{n_stages} stages cannot be spread evenly over {pipeline_degree} pipeline ranks; "
            f"use a multiple of {pipeline_degree} stages"
        )
    v = n_stages // pipeline_degree
    ranks = stage_ranks(schedule, pipeline_degree, n_stages)
    if stage_memory is not None:
        # The seed's bisection and every improving move ask for the same slices again and again.
        stage_memory = functools.cache(stage_memory)
    if stage_memory is not None and memory_cap is not None:
        seed = _memory_seed(costs, ranks, stage_memory, memory_cap, v, explain=explain)
    else:
        seed = balance_min_max(costs, n_stages)
    if v == 1:
        return seed
    seeds = [seed]
    if stage_memory is None:
        seeds.append(uniform_split(len(costs), n_stages))
    # Integer costs (1e-9 of the total each) make every sum exact, so a key that looks lower is lower.
    total = sum(costs) or 1.0
    prefix = list(accumulate((round(c / total * 1e9) for c in costs), initial=0))
    budget = [_WORK_BUDGET]  # stage-cost evaluations left; bounds the time on big pipelines, deterministically
    search = functools.partial(
        _local_search,
        prefix,
        ranks=ranks,
        pipeline_degree=pipeline_degree,
        stage_memory=stage_memory,
        memory_cap=memory_cap,
        budget=budget,
    )
    best, best_key = min((search(list(accumulate(s, initial=0))) for s in seeds), key=lambda found: found[1])
    # Kicks: move a few random cuts anywhere between their neighbours and descend again; keep what improves.
    # Seeded by the problem, so the same costs always give the same split.
    rng = random.Random(hash((tuple(prefix), pipeline_degree, n_stages)))
    for _ in range(kicks if kicks is not None else max(2, 256 // n_stages)):
        if budget[0] <= 0:
            break
        cuts = best.copy()
        for _ in range(rng.randint(1, 3)):
            j = rng.randrange(1, n_stages)
            if cuts[j + 1] - cuts[j - 1] > 2:
                cuts[j] = rng.randrange(cuts[j - 1] + 1, cuts[j + 1])
        if (
            stage_memory is not None
            and memory_cap is not None
            and not _ranks_fit(cuts, ranks, set(ranks), stage_memory, memory_cap)
        ):
            continue
        found, found_key = search(cuts)
        if found_key < best_key:
            best, best_key = found, found_key
    return tuple(b - a for a, b in pairwise(best))


def _memory_seed(
    costs: Sequence[float], ranks: list[int], stage_memory: StageMemory, memory_cap: float, v: int, *, explain: bool
) -> tuple[int, ...]:
    """A time-balanced split whose ranks all fit: per-stage caps from memory_cap / v up to memory_cap, first fit."""
    n_stages = len(ranks)
    if v == 1:
        return _min_max(costs, n_stages, stage_memory, memory_cap, explain=explain)
    for factor in (1.0, 1.25, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0):
        stage_cap = min(memory_cap, memory_cap / v * factor)
        try:
            split = _min_max(costs, n_stages, stage_memory, stage_cap, explain=False)
        except InfeasibleError:
            continue
        if _ranks_fit(list(accumulate(split, initial=0)), ranks, set(ranks), stage_memory, memory_cap):
            return split
        if stage_cap >= memory_cap:
            break
    if not explain:
        raise InfeasibleError(f"no split of {len(costs)} layers into {n_stages} stages fits {format_bytes(memory_cap)}")
    need = min_memory_cap(len(costs), n_stages, stage_memory)
    raise InfeasibleError(
        f"no split of {len(costs)} layers into {n_stages} stages ({v} per rank) found that keeps every rank under "
        f"{format_bytes(memory_cap)} (the leanest split needs {format_bytes(need)} per stage, up to "
        f"{format_bytes(need * v)} per rank); raise the memory limit, use more GPUs or turn on activation "
        f"checkpointing"
    )


def _local_search(
    prefix: list[int],
    cuts: list[int],
    ranks: list[int],
    pipeline_degree: int,
    stage_memory: StageMemory | None,
    memory_cap: float | None,
    budget: list[int],
) -> tuple[list[int], tuple[int, ...]]:
    # Moves: shift a run of consecutive cuts j..k by one layer, left or right (k = j moves one cut; longer runs
    # carry load between ranks whose stages are far apart, which single-cut moves cannot). Each round takes the move
    # that lowers the key most (the first found, in order of j, k, then left before right); the key strictly falls,
    # so the search ends.
    #
    #   cuts      0 |  a   b   c   d  | n        shift cuts a..c right by one:
    #   before      [s0 ][ s1 ][ s2 ][ s3 ]      s0 gains a layer, s1 and s2 slide by one, s3 loses one
    key = _key(prefix, cuts, ranks, pipeline_degree)
    n = len(ranks)
    while budget[0] > 0:
        budget[0] -= n * n * (n + 1)  # one round: ~S^2 moves of O(S) each (the budget's unit, kept as it was)
        # A move of cuts j..k changes only stages j-1..k: score it from this round's stage costs and rank loads,
        # with the costliest untouched stage from prefix/suffix maxima. Runs from one j are scored as k grows: the
        # run j..k+1 is the run j..k with stage k slid whole and stage k+1 shortened, so each move costs O(pp).
        costs = [prefix[b] - prefix[a] for a, b in pairwise(cuts)]
        loads = [0] * pipeline_degree
        for cost, rank in zip(costs, ranks):
            loads[rank] += cost
        head_max = list(accumulate(costs, max))
        tail_max = list(accumulate(reversed(costs), max))[::-1]
        best: tuple[tuple[int, ...], int, int, int] | None = None
        for j in range(1, n):
            # Per direction: the rank loads with stages j-1..k-1 moved, and the costliest of those stages.
            runs: dict[int, tuple[list[int], int]] = {}
            for delta in (-1, 1):
                if delta < 0 and cuts[j] - 1 <= cuts[j - 1]:
                    continue  # every stage keeps at least one layer: stage j-1 has none to give
                head = prefix[cuts[j] + delta] - prefix[cuts[j - 1]]
                moved = loads.copy()
                moved[ranks[j - 1]] += head - costs[j - 1]
                runs[delta] = (moved, head)
            untouched_head = head_max[j - 2] if j >= 2 else 0
            for k in range(j, n):
                untouched = tail_max[k + 1] if k + 1 < n and tail_max[k + 1] > untouched_head else untouched_head
                for delta, (moved, fixed) in runs.items():
                    if k > j:  # stage k-1 slides whole with the run
                        slid = prefix[cuts[k] + delta] - prefix[cuts[k - 1] + delta]
                        moved[ranks[k - 1]] += slid - costs[k - 1]
                        if slid > fixed:
                            fixed = slid
                            runs[delta] = (moved, fixed)
                    if delta > 0 and cuts[k] + 1 >= cuts[k + 1]:
                        continue  # stage k has no layer to give
                    tail = prefix[cuts[k + 1]] - prefix[cuts[k] + delta]
                    bar = best[0] if best else key
                    rank = ranks[k]
                    if moved[rank] + tail - costs[k] > bar[0]:
                        continue  # stage k's rank alone rules it out
                    moved_loads = moved.copy()
                    moved_loads[rank] += tail - costs[k]
                    busiest = max(moved_loads)
                    if busiest > bar[0]:
                        continue  # the busiest rank alone rules it out
                    costliest = fixed if fixed > untouched else untouched
                    if tail > costliest:
                        costliest = tail
                    if busiest == bar[0] and costliest > bar[1]:
                        continue  # so does the costliest stage, at an equal busiest rank
                    moved_loads.sort(reverse=True)
                    moved_key = (busiest, costliest, *moved_loads[1:])
                    if moved_key < bar and (
                        stage_memory is None
                        or memory_cap is None
                        or _ranks_fit(_shift(cuts, j, k, delta), ranks, {ranks[s] for s in range(j - 1, k + 1)},
                                      stage_memory, memory_cap)
                    ):
                        best = (moved_key, j, k, delta)
        if best is None:
            break
        key, cuts = best[0], _shift(cuts, best[1], best[2], best[3])
    return cuts, key


def _shift(cuts: list[int], j: int, k: int, delta: int) -> list[int]:
    moved = cuts.copy()
    for i in range(j, k + 1):
        moved[i] += delta
    return moved


def _key(prefix: list[int], cuts: list[int], ranks: list[int], pipeline_degree: int) -> tuple[int, ...]:
    # What the search minimises, lexicographically: the busiest rank; then the costliest stage (a lopsided stage
    # stretches every micro-batch's path through the pipeline); then the other ranks, busiest first.
    loads = [0] * pipeline_degree
    costliest = 0
    for s, rank in enumerate(ranks):
        cost = prefix[cuts[s + 1]] - prefix[cuts[s]]
        loads[rank] += cost
        costliest = max(costliest, cost)
    loads.sort(reverse=True)
    return (loads[0], costliest, *loads[1:])


def _ranks_fit(
    cuts: Sequence[int], ranks: list[int], which: set[int], stage_memory: StageMemory, memory_cap: float
) -> bool:
    used = dict.fromkeys(which, 0.0)
    for stage, rank in enumerate(ranks):
        if rank in used:
            used[rank] += stage_memory(stage, cuts[stage], cuts[stage + 1])
    return all(u <= memory_cap for u in used.values())


def _min_max(
    costs: Sequence[float],
    n_parts: int,
    stage_memory: StageMemory | None,
    memory_cap: float | None,
    *,
    explain: bool = True,
) -> tuple[int, ...]:
    n = len(costs)
    _check_counts(n, n_parts)
    if any(c < 0 for c in costs):
        raise UsageError(f"layer costs must be non-negative, got {min(costs)}; profile the model again")
    prefix = _prefix(costs)
    lower = max(max(costs), prefix[-1] / n_parts)
    sums = _segment_sums(tuple(prefix))
    sums = sums[bisect.bisect_left(sums, lower * (1 - _EPS)) :] or [prefix[-1]]
    if _greedy(prefix, n_parts, sums[-1], stage_memory, memory_cap) is None:
        # Even without a time bound no split fits: memory alone rules every split out.
        if not explain:
            raise InfeasibleError(f"no split of {n} layers into {n_parts} stages fits {format_bytes(memory_cap)}")
        need = min_memory_cap(n, n_parts, stage_memory) if stage_memory is not None else float("inf")
        raise InfeasibleError(
            f"no split of {n} layers into {n_parts} stages keeps every stage under {format_bytes(memory_cap)} "
            f"(the leanest split needs {format_bytes(need)} per stage); raise the memory limit to at least "
            f"{format_bytes(need)}, use more GPUs or turn on activation checkpointing"
        )
    lo, hi = 0, len(sums) - 1  # sums[hi] is feasible; find the first feasible bottleneck
    while lo < hi:
        mid = (lo + hi) // 2
        if _greedy(prefix, n_parts, sums[mid], stage_memory, memory_cap) is None:
            lo = mid + 1
        else:
            hi = mid
    split = _greedy(prefix, n_parts, sums[lo], stage_memory, memory_cap)
    if split is None:  # cannot happen: sums[lo] was found feasible
        raise RuntimeError("min-max partition lost its feasible bottleneck")
    return split


@functools.lru_cache(maxsize=16)
def _segment_sums(prefix: tuple[float, ...]) -> list[float]:
    """Every contiguous segment's sum, sorted, without repeats: the candidate bottlenecks of _min_max (cached: the
    memory-aware seed bisects the same costs under several caps). Callers must not change the list."""
    n = len(prefix) - 1
    return sorted({prefix[b] - prefix[a] for a in range(n) for b in range(a + 1, n + 1)})


def _greedy(
    prefix: list[float], n_parts: int, limit: float, stage_memory: StageMemory | None, memory_cap: float | None
) -> tuple[int, ...] | None:
    """Each part takes as many layers as fit under the time limit (and the memory cap) while leaving one layer for
    each later part; None when some part cannot take even one layer or layers are left over."""
    n = len(prefix) - 1
    slack = limit * _EPS + 1e-300
    split: list[int] = []
    start = 0
    for part in range(n_parts):
        last = part == n_parts - 1
        stop = (
            n if last else min(n - (n_parts - part - 1), bisect.bisect_right(prefix, prefix[start] + limit + slack) - 1)
        )
        if last and prefix[n] - prefix[start] > limit + slack:
            return None
        if stage_memory is not None and memory_cap is not None:
            while stop > start and stage_memory(part, start, stop) > memory_cap:
                if last:
                    return None
                stop -= 1
        if stop <= start:
            return None
        split.append(stop - start)
        start = stop
    return tuple(split) if start == n else None


def _prefix(values: Sequence[float]) -> list[float]:
    return list(accumulate((float(v) for v in values), initial=0.0))


def _check_counts(n_layers: int, n_parts: int) -> None:
    uniform_split(n_layers, n_parts)  # its checks: a part needs a layer
