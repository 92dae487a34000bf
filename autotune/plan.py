"""Pure: enumerate schedules x micro-batch counts x balanced splits, simulate each, rank them by predicted speed."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, replace
from itertools import accumulate
from typing import Any

from autotune.action_graph import graph_source
from autotune.candidate import DATA_PARALLEL_MODES, Candidate, DataParallelMode, pipeline_layouts, uniform_split
from autotune.costs import LayerCost, Profile, shared_copy_bytes
from autotune.errors import InfeasibleError, InvalidCandidateError, UsageError
from autotune.layouts import data_parallel_choices, layout_choices, parallel_layout_choices
from autotune.memory_model import autocast_copy_bytes, boundary_shared, stage_memory_bytes, wire_bytes
from autotune.partition import EVEN_WITHIN, StageMemory, balance_for_schedule, balanced_split, evened, layer_times
from autotune.placement import RANK_ORDERS, RankOrder, order_matters
from autotune.schedules import (
    SYNCHRONOUS_SCHEDULES,
    Schedule,
    default_stages_per_rank,
    order_from_torch,
    parse_schedule,
    stage_ranks,
)
from autotune.simulate import (
    Estimate,
    LinkModel,
    max_in_flight,
    optimizer_call_ms,
    optimizer_ms_per_byte,
    simulate_costs,
    step_time_lower_bound,
)
from autotune.tp_costs import tensor_parallel_layer_costs
from autotune.units import format_bytes

logger = logging.getLogger(__name__)

CHECKPOINTED_VARIANTS = 8
"""How many of the fastest candidates without activation checkpointing plan() also simulates with it."""
MEMORY_SPLIT_KICKS = 2
"""Random restarts of the memory-aware split's local search (partition.balance_for_schedule's default is up to 16).
On the benchmark profiles (96 layers over 1024 and 64 GPUs, 48 over 8) more found no other split, and the restarts
were half of plan()'s time."""
REFINED_CONFIGURATIONS = 4
"""How many of the fastest configurations plan() refines the split of by simulation (_refined)."""
REFINE_SIMULATIONS = 32
"""Simulations each refined configuration may spend looking for a faster neighbouring split."""
REFINE_MIN_GAIN = 0.002
"""A neighbouring split replaces the current one only when predicted this much faster (0.2 %): below it the
step is noise of the simulation's own rounding, and the climb would wander between equal splits."""


@dataclass(frozen=True, kw_only=True)
class PlannedCandidate:
    """A candidate and what the simulator predicts for it."""

    candidate: Candidate
    """The configuration."""
    estimate: Estimate
    """Its simulated step time, bubble and memory (no timeline: re-simulate one candidate to draw it)."""
    even_split_of: str | None = None
    """Set by the ranking when this split is ranked at the speed of a faster split of the same configuration (the
    key of that split): it is within EVEN_WITHIN of it and more even, see _even_first."""
    ranked_throughput_samples_per_s: float | None = None
    """The throughput the ranking sorted this candidate by: its own, or its configuration's fastest split's when
    even_split_of is set."""

    def to_dict(self) -> dict[str, Any]:
        ranked = self.ranked_throughput_samples_per_s
        c = self.candidate
        return {
            **c.to_dict(),
            # always, so a ranking of replicate and shard layouts reads the same way down every row
            "precision": c.precision,
            "data_parallel_mode": c.data_parallel_mode,
            "fsdp_reshard_after_forward": c.reshard_after_forward,
            "tensor_parallel_degree": c.tensor_parallel_degree,
            "predicted_tensor_parallel_ms": self.estimate.tensor_parallel_ms,
            "predicted_step_time_ms": self.estimate.step_time_ms,
            "predicted_throughput_samples_per_s": self.estimate.throughput_samples_per_s,
            "predicted_bubble_fraction": self.estimate.bubble_fraction,
            "predicted_peak_memory_bytes": list(self.estimate.peak_memory_bytes),
            "feasible": self.estimate.feasible,
            "ranked_throughput_samples_per_s": ranked if ranked is not None else self.estimate.throughput_samples_per_s,
            "ranked_as": (
                f"a more even split of {self.even_split_of}, predicted within {EVEN_WITHIN:.0%} of it: ranked at its "
                "speed (the profile's noise cannot tell them apart)" if self.even_split_of else None
            ),
        }


def plan(
    profile: Profile,
    *,
    gpus: int,
    batch_size: int,
    memory_limit_bytes: int | None,
    schedules: Iterable[Schedule | str] | None = None,
    top: int | None = None,
    link: LinkModel | None = None,
    prune_within: float | None = 0.25,
    layouts: Iterable[tuple[int, int]] | None = None,
    gpus_per_node: int | None = None,
    data_parallel_modes: Iterable[DataParallelMode] = DATA_PARALLEL_MODES,
    tensor_parallel_degrees: Iterable[int] = (1,),
) -> list[PlannedCandidate]:
    """Valid (layout, schedule, n_microbatches) points with their balanced and uniform splits, simulated;
    fastest first, candidates over the memory limit last.

    Layouts are the (pp, dp) pairs of candidate.pipeline_layouts (or `layouts`): every pp x dp = gpus whose dp
    divides B and whose pp has a layer per rank, pp = 1 (plain data parallelism) included. Micro-batch counts
    are the divisors of B/dp that the schedule accepts (invalid ones are skipped); B/M and M are per replica.
    Splits: the placement-aware min-max split of per-layer time (partition.balanced_split) and the uniform
    split; when both exceed the memory limit, a memory-aware split, then the same with activation checkpointing.
    The CHECKPOINTED_VARIANTS fastest candidates also get a checkpointed twin, fitting or not, so a tight limit
    ranks checkpointing against the other ways of saving memory. Points are simulated cheapest lower bound
    first, and a point whose lower bound is more than prune_within (25 %) slower than the best feasible step so
    far is skipped: it cannot rank near the top, and building torch's action lists for large micro-batch counts
    is the expensive part. prune_within=None simulates everything.

    gpus_per_node: the ranks span nodes of this many (gpus / gpus_per_node of them). Sends between stages on
    different nodes and all-reduces over nodes then take the inter-node link (link.across_nodes()), and each point
    with a pipeline and replicas over several nodes is planned in both rank orders (placement.RankOrder): pipelines
    inside nodes, or each stage's replicas inside nodes. None: one machine.

    data_parallel_modes: how the replicas of a layout with dp > 1 may hold their stages, each a point of its own
    (layouts.data_parallel_choices): replicate, and shard (FSDP2) keeping the stages gathered for the step or
    resharding after every forward; pp = 1 x shard is pure FSDP. Resharding does the same work plus all-gathers,
    so it is planned only where keeping the stages gathered does not fit as it is (it can only save memory).
    Candidates train in the profile's precision (its times and bytes are that precision's).

    tensor_parallel_degrees: the tp degrees to plan (layouts.tensor_parallel_degrees: the model's plan allows them,
    they divide the GPUs and fit a node); each tp > 1 adds the pp x dp layouts of gpus / tp ranks, simulated on one
    tp rank's costs (autotune.tp_costs). Given `layouts` are tp 1's."""
    if gpus < 1 or batch_size < 1:
        raise UsageError(f"gpus and batch size must be at least 1, got {gpus} and {batch_size}")
    if top is not None and top < 1:
        raise UsageError(f"top must be at least 1, got {top}")
    if prune_within is not None and prune_within < 0:
        raise UsageError(f"prune_within must be at least 0, got {prune_within}")
    if gpus_per_node is not None and (gpus_per_node < 1 or gpus % gpus_per_node):
        raise UsageError(f"--gpus {gpus} is not a whole number of nodes of {gpus_per_node}; pass a multiple")
    chosen = [parse_schedule(s) for s in schedules] if schedules is not None else list(SYNCHRONOUS_SCHEDULES)
    link = link or LinkModel.for_profile(profile)
    chosen_layouts = list(layouts) if layouts is not None else pipeline_layouts(gpus, batch_size, profile.n_layers)
    modes = list(data_parallel_modes)
    unknown = [m for m in modes if m not in DATA_PARALLEL_MODES]
    if unknown or not modes:
        raise UsageError(f"data-parallel modes {unknown or modes} are not a choice of {', '.join(DATA_PARALLEL_MODES)}")
    costs_at: dict[tuple[int, int], _Costs] = {}
    tp_degrees = sorted(set(tensor_parallel_degrees))
    if gpus_per_node is not None and any(gpus_per_node % tp for tp in tp_degrees):
        raise UsageError(f"tensor-parallel degrees {tp_degrees} must divide the {gpus_per_node} GPUs of a node")
    points = _points(profile, gpus, batch_size, chosen, chosen_layouts, link, gpus_per_node, costs_at, modes,
                     tp_degrees, layouts_given=layouts is not None)
    planned = _simulated(points, costs_at, memory_limit_bytes, prune_within)
    ranked = _even_first(planned.values())
    return ranked[:top] if top is not None else ranked


def _points(
    profile: Profile,
    gpus: int,
    batch_size: int,
    schedules: list[Schedule],
    layouts: list[tuple[int, int]],
    link: LinkModel,
    gpus_per_node: int | None,
    costs_at: dict[tuple[int, int], _Costs],
    modes: list[DataParallelMode],
    tp_degrees: Sequence[int] = (1,),
    *,
    layouts_given: bool = True,
) -> list[_Point]:
    """One point per valid (layout, data-parallel choice, schedule, B/M) of the layout space, their costs per
    micro-batch size and tp degree filled in costs_at; an InvalidCandidateError that says what would run when there
    is none."""
    n_layers = profile.n_layers
    splits: dict[tuple[Any, ...], tuple[int, ...]] = {}  # balanced splits, shared by micro-batch sizes
    points: list[_Point] = []
    # given (pp, dp) layouts are tp 1's; otherwise every tp degree's pp x dp layouts of gpus / tp ranks
    space = parallel_layout_choices(gpus, batch_size, n_layers, tp_degrees=tp_degrees, schedules=schedules,
                                    layouts=layouts if layouts_given else None)
    for (pp, dp, tp), per_schedule in space.items():
        for schedule, counts in per_schedule.items():
            n_stages = pp * default_stages_per_rank(schedule)
            for m in counts:
                micro = batch_size // (m * dp)
                if not profile.fits_micro_batch(micro):
                    continue  # a block alone ran out of memory (or failed as too small) at this size while profiling
                costs = costs_at.get((micro, tp)) or costs_at.setdefault(
                    (micro, tp), _Costs(profile, micro, link, splits, gpus_per_node=gpus_per_node, tp=tp)
                )
                keep: _Point | None = None
                for mode, reshard in data_parallel_choices(dp, modes, schedule):
                    point = _Point(costs=costs, schedule=schedule, pp=pp, dp=dp, m=m, n_stages=n_stages,
                                   batch_size=batch_size, mode=mode, reshard=reshard,
                                   keep_twin=keep if reshard else None)
                    if mode == "shard" and not reshard:
                        keep = point
                    if point.first:
                        points.append(point)
    if points:
        return points
    if profile.too_small_micro_batch_sizes:
        raise InvalidCandidateError(
            f"every candidate over {gpus} ranks needs micro-batches of {profile.too_small_micro_batch_sizes[-1]} or "
            f"fewer samples, which the model failed to train while profiling (a BatchNorm over one value per "
            f"channel, say); use a larger batch size or fewer GPUs"
        )
    if profile.infeasible_micro_batch_sizes:
        raise InfeasibleError(
            f"every candidate over {gpus} ranks needs micro-batches of {profile.infeasible_micro_batch_sizes[0]} "
            f"or more samples, which ran out of memory for a single block while profiling; use a smaller batch "
            f"size, more GPUs (more data parallelism) or a device with more memory"
        )
    if not layouts:
        raise InvalidCandidateError(
            f"the model has {n_layers} layers, too few for a pipeline over {gpus} ranks (a stage needs at least "
            f"one layer), and no data-parallel degree dividing both {gpus} and batch size {batch_size} leaves a "
            f"pipeline that short; use --gpus {n_layers} or fewer, or a batch size that is a multiple of {gpus}"
        )
    names = ", ".join(s.value for s in schedules)
    raise InvalidCandidateError(
        f"none of {names} runs {n_layers} layers over {gpus} pipeline ranks with any micro-batch count dividing "
        f"batch size {batch_size}; use a larger batch size (a multiple of {gpus}) or add GPipe"
    )


def _simulated(
    points: list[_Point], costs_at: dict[tuple[int, int], _Costs], memory_limit_bytes: int | None,
    prune_within: float | None,
) -> dict[str, PlannedCandidate]:
    """The points simulated cheapest lower bound first, pruned against the best feasible step so far, then the
    checkpointed twins of the fastest; torch's orders built ahead by the edge's graph source while it works. The
    cheapest point of each tensor-parallel degree is never pruned: the ranking says what each degree would do (the
    search seeds the best tp candidate, the report compares it), however far behind it is."""
    planned: dict[str, PlannedCandidate] = {}
    best: list[float] = []  # the best feasible step time so far, once there is one
    pruned = 0
    ordered = sorted(points, key=lambda p: p.bound)
    kept = {id(next(p for p in ordered if p.costs.tp == tp)) for tp in {p.costs.tp for p in ordered}}
    source = graph_source()  # the edge's store of graphs (graph_cache.planning), if any

    def ready(point: _Point) -> bool:
        return source is None or source.ready((point.schedule, point.pp, point.m, point.n_stages))

    ahead = source.built_ahead([(p.schedule, p.pp, p.m, p.n_stages) for p in ordered]) if source else nullcontext()
    with ahead:
        for i, point in enumerate(ordered):
            limit = best[0] * (1 + prune_within) if best and prune_within is not None else float("inf")
            if (point.bound > limit and id(point) not in kept) or point.dominated():
                pruned += 1
                continue
            # While a worker still builds this point's torch order, evaluate later points that need none: their
            # simulations and splits are memoized (_Costs.simulate, _Point), so the ranking is the one without it.
            if not ready(point):
                spare = (p for p in ordered[i + 1:]
                         if not order_from_torch(p.schedule) and p.bound <= limit and p.keep_twin is None)
                while not ready(point):
                    later = next(spare, None)
                    if later is None:
                        break
                    later.evaluate(memory_limit_bytes, limit)
            for entry in point.evaluate(memory_limit_bytes, limit):
                planned.setdefault(entry.candidate.key, entry)
                if entry.estimate.feasible and (not best or entry.estimate.step_time_ms < best[0]):
                    best[:] = [entry.estimate.step_time_ms]
        for entry in _refined(list(planned.values()), costs_at, memory_limit_bytes):
            planned.setdefault(entry.candidate.key, entry)
        limit = best[0] * (1 + prune_within) if best and prune_within is not None else float("inf")
        for entry in _checkpointed_variants(list(planned.values()), costs_at, memory_limit_bytes, limit):
            planned.setdefault(entry.candidate.key, entry)
    logger.debug("planned %d candidates at %d points, pruned %d points", len(planned), len(points), pruned)
    return planned


def _even_first(planned: Iterable[PlannedCandidate]) -> list[PlannedCandidate]:
    """Fastest first, candidates over the memory limit last; among splits of one configuration (same layout,
    schedule, B/M, checkpointing, wire dtype) predicted within EVEN_WITHIN of that configuration's fastest, the more
    even split first (fewer layers away from the uniform split): the profile's noise cannot tell them apart, a
    person can. Such a split is ranked at its configuration's fastest speed, so it may stand above a slightly faster
    candidate of another configuration; each entry says what it was ranked by (ranked_throughput_samples_per_s, and
    even_split_of where that is not its own)."""
    entries = list(planned)
    best: dict[tuple[Any, ...], PlannedCandidate] = {}
    for p in entries:
        group = (_configuration(p.candidate), p.estimate.feasible)
        if group not in best or p.estimate.throughput_samples_per_s > best[group].estimate.throughput_samples_per_s:
            best[group] = p

    ranked: list[tuple[tuple[Any, ...], PlannedCandidate]] = []
    for p in entries:
        throughput = p.estimate.throughput_samples_per_s
        fastest = best[(_configuration(p.candidate), p.estimate.feasible)]
        fastest_throughput = fastest.estimate.throughput_samples_per_s
        tied = throughput >= fastest_throughput / (1 + EVEN_WITHIN)
        by = fastest_throughput if tied else throughput
        lifted = tied and fastest is not p and fastest_throughput > throughput
        entry = replace(p, ranked_throughput_samples_per_s=by,
                        even_split_of=fastest.candidate.key if lifted else None)
        ranked.append(((not p.estimate.feasible, -by, _unevenness(p.candidate), -throughput, p.candidate.key), entry))
    ranked.sort(key=lambda pair: pair[0])
    return [entry for _, entry in ranked]


def _configuration(c: Candidate) -> tuple[Any, ...]:
    """A candidate without its split."""
    return (c.pipeline_degree, c.data_parallel_degree, c.schedule, c.n_microbatches, c.activation_checkpointing,
            c.wire_dtype, c.n_stages, c.precision, c.data_parallel_mode, c.reshard_after_forward,
            c.tensor_parallel_degree)


def _unevenness(c: Candidate) -> int:
    """Layers the split's stage boundaries lie away from the uniform split's."""
    uniform = accumulate(uniform_split(sum(c.layers_per_stage), c.n_stages), initial=0)
    return sum(abs(a - b) for a, b in zip(accumulate(c.layers_per_stage, initial=0), uniform))


def largest_micro_batch(
    gpus: int, batch_size: int, n_layers: int, schedules: Iterable[Schedule | str] | None = None
) -> int:
    """The largest micro-batch size any candidate of plan() (or the search) can have: over every layout, B/dp cut
    into the fewest micro-batches a schedule accepts there. Profiling beyond it measures sizes nothing uses (at
    B 4096 over 1024 GPUs a 96-layer model has dp >= 16, so micro-batches of 256 at most)."""
    space = layout_choices(gpus, batch_size, n_layers, schedules=schedules)
    fewest = [(dp, counts[0]) for (_, dp), per_schedule in space.items() for counts in per_schedule.values()]
    return max((batch_size // dp // m for dp, m in fewest), default=batch_size)


def recommended_microbatch_range(planned: Sequence[PlannedCandidate], within: float = 0.05) -> tuple[int, int]:
    """The smallest and largest B/M whose best candidate (any schedule, any split) comes within `within` of the best
    predicted throughput; only feasible candidates count when there are any."""
    if not planned:
        raise UsageError("no planned candidates to recommend a micro-batch count from; plan first")
    pool = [p for p in planned if p.estimate.feasible] or list(planned)
    best_per_m: dict[int, float] = {}
    for p in pool:
        m = p.candidate.n_microbatches
        best_per_m[m] = max(best_per_m.get(m, 0.0), p.estimate.throughput_samples_per_s)
    best = max(best_per_m.values())
    good = [m for m, t in best_per_m.items() if t >= (1.0 - within) * best]
    return min(good), max(good)


def ensure_feasible(planned: Sequence[PlannedCandidate]) -> None:
    """Raise InfeasibleError, naming the leanest candidate and what it needs, when none fits the memory limit."""
    if not planned or any(p.estimate.feasible for p in planned):
        return
    leanest = min(planned, key=lambda p: max(p.estimate.peak_memory_bytes))
    need = max(leanest.estimate.peak_memory_bytes)
    limit = leanest.estimate.memory_limit_bytes
    raise InfeasibleError(
        f"no candidate fits {format_bytes(limit)} per rank; the leanest ({leanest.candidate.key}) needs "
        f"{format_bytes(need)} on its fullest rank: pass --memory-limit {_size_flag(need)} or more, or use more GPUs"
    )


# --- enumeration --------------------------------------------------------------------------------------------------


def _refined(
    planned: Sequence[PlannedCandidate], costs_at: dict[tuple[int, int], _Costs], memory_limit_bytes: int | None,
) -> list[PlannedCandidate]:
    """Faster splits near the fastest of the REFINED_CONFIGURATIONS fastest feasible configurations, found by
    simulation: a hill climb that moves one stage boundary by one layer and keeps the first move predicted
    REFINE_MIN_GAIN faster (and fitting), until no move is or REFINE_SIMULATIONS are spent.

    The balanced split evens out the stages' compute; the fastest split can lie beside it where what the stages do
    around their compute weighs: with few micro-batches a stage's optimizer step runs while the stage before it is
    still in its backward (recipes/mlp.py, B 64, GPipe m1: [2,8] predicted 16.2 ms, the balanced [3,7] 19.0 ms;
    measured in turn 15.0 and 16.7 ms), and the activation crossing a boundary is smaller at some layers than
    others."""
    fastest: dict[tuple[Any, ...], PlannedCandidate] = {}
    for p in planned:
        if p.estimate.feasible:
            key = _configuration(p.candidate) + (p.candidate.rank_order,)
            if key not in fastest or p.estimate.step_time_ms < fastest[key].estimate.step_time_ms:
                fastest[key] = p
    starts = sorted(fastest.values(), key=lambda p: (p.estimate.step_time_ms, p.candidate.key))
    have = {p.candidate.key for p in planned}
    found: list[PlannedCandidate] = []
    for start in starts[:REFINED_CONFIGURATIONS]:
        c = start.candidate
        if c.n_stages < 2:
            continue
        costs = costs_at[(c.micro_batch_size, c.tensor_parallel_degree)]
        current, spent, moved = start, 0, True
        while moved and spent < REFINE_SIMULATIONS:
            moved = False
            for split in _neighbouring_splits(current.candidate.layers_per_stage):
                if spent >= REFINE_SIMULATIONS:
                    break
                candidate = replace(c, layers_per_stage=split)
                spent += 1
                estimate = costs.simulate(candidate, memory_limit_bytes)
                if estimate.feasible and estimate.step_time_ms < current.estimate.step_time_ms * (1 - REFINE_MIN_GAIN):
                    current, moved = PlannedCandidate(candidate=candidate, estimate=estimate), True
                    break
        if current is not start and current.candidate.key not in have:
            have.add(current.candidate.key)
            found.append(current)
    return found


def _neighbouring_splits(split: tuple[int, ...]) -> Iterable[tuple[int, ...]]:
    """Every split one layer away: one stage boundary moved by one layer, each stage keeping a layer."""
    for j in range(len(split) - 1):
        for delta in (-1, 1):
            a, b = split[j] + delta, split[j + 1] - delta
            if a >= 1 and b >= 1:
                yield (*split[:j], a, b, *split[j + 2:])


def _checkpointed_variants(
    planned: Sequence[PlannedCandidate], costs_at: dict[tuple[int, int], _Costs], memory_limit_bytes: int | None,
    limit_ms: float,
) -> list[PlannedCandidate]:
    """The checkpointed twins of the CHECKPOINTED_VARIANTS fastest candidates without checkpointing, fitting or not:
    the same split, and the split balanced for the recomputing backward. A twin whose lower bound is over limit_ms
    is skipped."""
    plain = sorted((p for p in planned if not p.candidate.activation_checkpointing),
                   key=lambda p: (-p.estimate.throughput_samples_per_s, p.candidate.key))
    have = {p.candidate.key for p in planned}
    twins: list[PlannedCandidate] = []
    for p in plain[:CHECKPOINTED_VARIANTS]:
        c = p.candidate
        costs = costs_at[(c.micro_batch_size, c.tensor_parallel_degree)]
        balanced = costs.balanced(c.schedule, c.pipeline_degree, c.n_stages, checkpointing=True)
        for split in dict.fromkeys((c.layers_per_stage, balanced)):
            twin = replace(c, layers_per_stage=split, activation_checkpointing=True)
            if twin.key in have or costs.lower_bound(twin) > limit_ms:
                continue
            have.add(twin.key)
            twins.append(PlannedCandidate(candidate=twin, estimate=costs.simulate(twin, memory_limit_bytes)))
    return twins


class _Costs:
    """Per-layer costs at one micro-batch size on one rank of a tp group (tp_costs; tp 1: the profile's), with what
    every candidate at that size and tp shares."""

    def __init__(
        self, profile: Profile, micro_batch_size: int, link: LinkModel,
        splits: dict[tuple[Any, ...], tuple[int, ...]] | None = None, *, gpus_per_node: int | None = None,
        tp: int = 1,
    ) -> None:
        tp_costs = tensor_parallel_layer_costs(profile, micro_batch_size, tp, link)
        self.tp = tp
        self.layers: list[LayerCost] = tp_costs.layers
        self.collective_ms = tp_costs.collective_ms
        self.gpus_per_node = gpus_per_node
        self.input_bytes = profile.input_bytes_at(micro_batch_size)
        self.link = link
        self.state_ratio = profile.optimizer_state_ratio
        self.step_ratio = profile.optimizer_peak_ratio
        self.step_per_tensor = profile.device == "cpu"
        self.loss_saved = profile.loss_saved_bytes_at(micro_batch_size)
        self.loss_input = profile.loss_input_bytes_at(micro_batch_size)
        self.loss_backward = profile.loss_backward_bytes_at(micro_batch_size)
        self.target_bytes = profile.target_bytes_at(micro_batch_size)
        self.workspace_bytes = profile.device_workspace_bytes
        self.optimizer_ms_per_byte = optimizer_ms_per_byte(profile, link)
        self.optimizer_call_ms = optimizer_call_ms(profile)
        self.time = layer_times(self.layers)
        self.time_checkpointed = layer_times(self.layers, checkpointing=True)
        self.saved_prefix = list(accumulate((c.saved_bytes for c in self.layers), initial=0))
        self.copies_prefix = list(accumulate((c.autocast_copy_bytes for c in self.layers), initial=0))
        self.precision = profile.precision
        self.param_prefix = list(accumulate((c.parameter_bytes for c in self.layers), initial=0))
        self.shared = profile.shared_parameters
        self._balanced = splits if splits is not None else {}
        self._simulated: dict[tuple[Candidate, int | None], Estimate] = {}
        # A min-max split depends on the layer times only up to scale: sizes whose times are proportional (a profile
        # of one size, or layers without fixed costs) share their splits, the planner's costliest computation.
        self._shape = {flag: _shape(t) for flag, t in ((False, self.time), (True, self.time_checkpointed))}

    def simulate(self, candidate: Candidate, memory_limit_bytes: int | None) -> Estimate:
        key = (candidate, memory_limit_bytes)
        if key not in self._simulated:
            self._simulated[key] = self._simulate(candidate, memory_limit_bytes)
        return self._simulated[key]

    def _simulate(self, candidate: Candidate, memory_limit_bytes: int | None) -> Estimate:
        return simulate_costs(
            self.layers,
            candidate,
            input_bytes=self.input_bytes,
            optimizer_ms_per_byte=self.optimizer_ms_per_byte,
            optimizer_call_ms=self.optimizer_call_ms,
            optimizer_state_ratio=self.state_ratio,
            optimizer_peak_ratio=self.step_ratio,
            optimizer_per_tensor=self.step_per_tensor,
            loss_saved_bytes=self.loss_saved,
            loss_input_bytes=self.loss_input,
            loss_backward_bytes=self.loss_backward,
            target_bytes=self.target_bytes,
            link=self.link,
            memory_limit_bytes=memory_limit_bytes,
            with_timeline=False,
            shared_parameters=self.shared,
            gpus_per_node=self.gpus_per_node,
            collective_ms=self.collective_ms if self.tp > 1 else (),
            workspace_bytes=self.workspace_bytes,
        )

    def balanced(
        self, schedule: Schedule, pipeline_degree: int, n_stages: int, checkpointing: bool = False
    ) -> tuple[int, ...]:
        """The placement-aware time-balanced split; schedules with the same placement share it."""
        key = (tuple(stage_ranks(schedule, pipeline_degree, n_stages)), self._shape[checkpointing])
        if key not in self._balanced:
            self._balanced[key] = balanced_split(
                self.layers, schedule, pipeline_degree, n_stages, checkpointing=checkpointing
            )
        return self._balanced[key]

    def lower_bound(self, candidate: Candidate) -> float:
        return step_time_lower_bound(
            self.layers, candidate, input_bytes=self.input_bytes, optimizer_ms_per_byte=self.optimizer_ms_per_byte,
            optimizer_call_ms=self.optimizer_call_ms, link=self.link,
        )

    def _wire(self, layer: int, candidate: Candidate) -> float:
        """The layer's output as it travels to the next stage (memory_model.wire_bytes)."""
        cost = self.layers[layer]
        return wire_bytes(cost.output_bytes, cost.wire_output_bytes, candidate=candidate)

    def stage_memory(self, candidate: Candidate) -> StageMemory:
        """The memory model's bytes of one stage alone (memory_model.stage_memory_bytes), at the stage's worst
        in-flight count."""
        in_flight = max_in_flight(
            candidate.schedule, candidate.pipeline_degree, candidate.n_microbatches, candidate.n_stages
        )
        last = candidate.n_stages - 1

        def stage_memory(stage: int, start: int, stop: int) -> float:
            return stage_memory_bytes(
                parameter_bytes=self.param_prefix[stop] - self.param_prefix[start]
                + shared_copy_bytes(self.shared, start, stop),
                saved=self.saved_prefix[stop] - self.saved_prefix[start] + autocast_copy_bytes(
                    self.copies_prefix[stop] - self.copies_prefix[start], candidate=candidate)
                + (self.layers[start].saved_handoff_bytes if start and not boundary_shared(candidate) else 0),
                stage_in=self.input_bytes if start == 0 else self.layers[start - 1].output_bytes,
                stage_out=(self.loss_input if stage == last and self.loss_input is not None
                           else self.layers[stop - 1].output_bytes),  # the last keeps the loss's input
                wire_in=0.0 if start == 0 else self._wire(start - 1, candidate),
                wire_out=self._wire(stop - 1, candidate),
                in_flight=in_flight[stage],
                candidate=candidate,
                first=stage == 0,
                last=stage == last,
                optimizer_state_ratio=self.state_ratio,
            )

        return stage_memory


class _Point:
    """One (layout, data-parallel choice, schedule, n_microbatches): its first candidates and a lower bound on
    their step time."""

    def __init__(
        self, *, costs: _Costs, schedule: Schedule, pp: int, dp: int, m: int, n_stages: int, batch_size: int,
        mode: DataParallelMode = "replicate", reshard: bool = False, keep_twin: _Point | None = None,
    ) -> None:
        self.costs, self.schedule, self.pp, self.dp, self.m = costs, schedule, pp, dp, m
        self.n_stages, self.batch_size = n_stages, batch_size
        self.mode, self.reshard = mode, reshard
        self.keep_twin = keep_twin
        """Resharding after forward: the same point keeping its stages gathered (evaluated first: same bound)."""
        self.fits_as_is: bool | None = None
        """After evaluate(): whether a first candidate (no memory-aware split, no checkpointing) fits."""
        n_layers = len(costs.layers)
        balanced = costs.balanced(schedule, pp, n_stages)
        # The balanced split, the most even one within noise of it (partition.evened), and the uniform one.
        splits = [balanced, evened(costs.time, balanced, schedule, pp), uniform_split(n_layers, n_stages)]
        per_node = costs.gpus_per_node // costs.tp if costs.gpus_per_node is not None else None  # grid of tp groups
        self.orders: tuple[RankOrder, ...] = RANK_ORDERS if order_matters(pp, dp, per_node) else ("pp-inner",)
        self.first = [self.make(split, order=order) for i, split in enumerate(splits) if split not in splits[:i]
                      for order in self.orders]
        self.bound = min((costs.lower_bound(c) for c in self.first), default=float("inf"))
        self._memory_splits: dict[tuple[bool, int], tuple[int, ...] | None] = {}  # evaluate()'s, memoized

    def dominated(self) -> bool:
        """Resharding after forward does the same work as keeping the stages gathered, plus all-gathers: never
        faster, it can only save memory. Not worth simulating where the kept twin fits as it is."""
        return self.keep_twin is not None and bool(self.keep_twin.fits_as_is)

    def make(self, split: tuple[int, ...], checkpointing: bool = False, order: RankOrder = "pp-inner") -> Candidate:
        return Candidate(
            schedule=self.schedule, pipeline_degree=self.pp, data_parallel_degree=self.dp,
            global_batch_size=self.batch_size, n_microbatches=self.m, layers_per_stage=split,
            activation_checkpointing=checkpointing, rank_order=order, precision=self.costs.precision,
            data_parallel_mode=self.mode, reshard_after_forward=self.reshard,
            tensor_parallel_degree=self.costs.tp,
        )

    def evaluate(self, memory_limit_bytes: int | None, limit_ms: float) -> list[PlannedCandidate]:
        """Simulate the first candidates; when none fits the memory limit, try a memory-aware split, then
        activation checkpointing (skipping any whose lower bound is over limit_ms)."""
        costs = self.costs
        results = [PlannedCandidate(candidate=c, estimate=costs.simulate(c, memory_limit_bytes)) for c in self.first]
        self.fits_as_is = memory_limit_bytes is None or any(r.estimate.feasible for r in results)
        if self.fits_as_is:
            return results
        n_layers = len(costs.layers)
        for checkpointing in (False, True):
            probe = self.make(uniform_split(n_layers, self.n_stages), checkpointing)
            time = costs.time_checkpointed if checkpointing else costs.time
            splits = [costs.balanced(self.schedule, self.pp, self.n_stages, checkpointing)] if checkpointing else []
            memory_key = (checkpointing, memory_limit_bytes)
            if memory_key not in self._memory_splits:
                try:
                    self._memory_splits[memory_key] = balance_for_schedule(
                        time, self.schedule, self.pp, self.n_stages,
                        stage_memory=costs.stage_memory(probe), memory_cap=memory_limit_bytes, explain=False,
                        kicks=MEMORY_SPLIT_KICKS,
                    )
                except InfeasibleError:
                    self._memory_splits[memory_key] = None
            memory_split = self._memory_splits[memory_key]
            if memory_split is not None:
                splits.append(memory_split)
            for split in splits:
                for order in self.orders:
                    candidate = self.make(split, checkpointing, order)
                    if any(r.candidate == candidate for r in results) or costs.lower_bound(candidate) > limit_ms:
                        continue
                    results.append(PlannedCandidate(candidate=candidate,
                                                    estimate=costs.simulate(candidate, memory_limit_bytes)))
            if any(r.estimate.feasible for r in results):
                break
        return results


def _shape(times: Sequence[float]) -> tuple[float, ...]:
    """Times relative to the largest, rounded past float noise: equal for proportional time vectors."""
    top = max(times, default=0.0) or 1.0
    return tuple(round(t / top, 9) for t in times)


def _size_flag(nbytes: float) -> str:
    """A --memory-limit value just above nbytes, in MiB or GiB."""
    mib = nbytes / 2**20
    if mib < 1024:
        return f"{int(mib) + 1}MiB"
    return f"{nbytes / 2**30 + 0.05:.1f}GiB"
