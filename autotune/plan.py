"""Pure: enumerate schedules x micro-batch counts x balanced splits, simulate each, rank them by predicted speed."""

from __future__ import annotations

import contextlib
import gc
import logging
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, replace
from itertools import accumulate
from typing import Any

from autotune.action_graph import graph_ready, torch_orders_built_ahead
from autotune.candidate import Candidate, pipeline_layouts, uniform_split
from autotune.costs import LayerCost, Profile, shared_copy_bytes
from autotune.errors import InfeasibleError, InvalidCandidateError, UsageError
from autotune.memory_model import stage_memory_bytes
from autotune.partition import EVEN_WITHIN, StageMemory, balance_for_schedule, balanced_split, evened, layer_times
from autotune.placement import RANK_ORDERS, RankOrder, order_matters
from autotune.schedules import (
    Schedule,
    default_stages_per_rank,
    order_from_torch,
    parse_schedule,
    schedules_for,
    stage_ranks,
    validate_schedule,
)
from autotune.simulate import (
    Estimate,
    LinkModel,
    max_in_flight,
    optimizer_ms_per_byte,
    simulate_costs,
    step_time_lower_bound,
)
from autotune.units import format_bytes

logger = logging.getLogger(__name__)

CHECKPOINTED_VARIANTS = 8
"""How many of the fastest candidates without activation checkpointing plan() also simulates with it."""
MEMORY_SPLIT_KICKS = 2
"""Random restarts of the memory-aware split's local search (partition.balance_for_schedule's default is up to 16).
On the benchmark profiles (96 layers over 1024 and 64 GPUs, 48 over 8) more found no other split, and the restarts
were half of plan()'s time."""


@dataclass(frozen=True, kw_only=True)
class PlannedCandidate:
    """A candidate and what the simulator predicts for it."""

    candidate: Candidate
    """The configuration."""
    estimate: Estimate
    """Its simulated step time, bubble and memory (no timeline: re-simulate one candidate to draw it)."""

    def to_dict(self) -> dict[str, Any]:
        return {
            **self.candidate.to_dict(),
            "predicted_step_time_ms": self.estimate.step_time_ms,
            "predicted_throughput_samples_per_s": self.estimate.throughput_samples_per_s,
            "predicted_bubble_fraction": self.estimate.bubble_fraction,
            "predicted_peak_memory_bytes": list(self.estimate.peak_memory_bytes),
            "feasible": self.estimate.feasible,
        }


@contextlib.contextmanager
def _cycle_collection_paused() -> Iterator[None]:
    """Python's cycle collector off for the duration: the planner allocates millions of small acyclic objects
    (action graphs, candidates, estimates) beside torch's modules, and each full collection walks them all; paused,
    a 128-node plan took ~30 % less time. Its garbage is freed by reference counting; what cycles there are wait
    for the next collection after."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


@_cycle_collection_paused()
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
    inside nodes, or each stage's replicas inside nodes. None: one machine."""
    if gpus < 1 or batch_size < 1:
        raise UsageError(f"gpus and batch size must be at least 1, got {gpus} and {batch_size}")
    if top is not None and top < 1:
        raise UsageError(f"top must be at least 1, got {top}")
    if prune_within is not None and prune_within < 0:
        raise UsageError(f"prune_within must be at least 0, got {prune_within}")
    if gpus_per_node is not None and (gpus_per_node < 1 or gpus % gpus_per_node):
        raise UsageError(f"--gpus {gpus} is not a whole number of nodes of {gpus_per_node}; pass a multiple")
    chosen = [parse_schedule(s) for s in schedules] if schedules is not None else list(Schedule)
    link = link or LinkModel.for_device(profile.device)
    n_layers = profile.n_layers
    costs_at: dict[int, _Costs] = {}
    splits: dict[tuple[Any, ...], tuple[int, ...]] = {}  # balanced splits, shared by micro-batch sizes
    points: list[_Point] = []
    chosen_layouts = list(layouts) if layouts is not None else pipeline_layouts(gpus, batch_size, n_layers)
    for pp, dp in chosen_layouts:
        if pp * dp != gpus or batch_size % dp:
            raise UsageError(f"layout pp {pp} x dp {dp} does not cover {gpus} GPUs with a dp dividing {batch_size}")
        for schedule in schedules_for(pp, chosen):  # at pp = 1: single-stage ones, GPipe folded into 1F1B
            n_stages = pp * default_stages_per_rank(schedule)
            if n_stages > n_layers:
                continue
            for m in _divisors(batch_size // dp):
                try:
                    validate_schedule(schedule, pipeline_degree=pp, n_microbatches=m, n_stages=n_stages)
                except InvalidCandidateError:
                    continue
                micro = batch_size // (m * dp)
                costs = costs_at.get(micro) or costs_at.setdefault(
                    micro, _Costs(profile, micro, link, splits, gpus_per_node=gpus_per_node)
                )
                point = _Point(costs=costs, schedule=schedule, pp=pp, dp=dp, m=m, n_stages=n_stages,
                               batch_size=batch_size)
                if point.first:
                    points.append(point)
    if not points:
        if not chosen_layouts:
            raise InvalidCandidateError(
                f"the model has {n_layers} layers, too few for a pipeline over {gpus} ranks (a stage needs at least "
                f"one layer), and no data-parallel degree dividing both {gpus} and batch size {batch_size} leaves a "
                f"pipeline that short; use --gpus {n_layers} or fewer, or a batch size that is a multiple of {gpus}"
            )
        names = ", ".join(s.value for s in chosen)
        raise InvalidCandidateError(
            f"none of {names} runs {n_layers} layers over {gpus} pipeline ranks with any micro-batch count dividing "
            f"batch size {batch_size}; use a larger batch size (a multiple of {gpus}) or add GPipe"
        )
    planned: dict[str, PlannedCandidate] = {}
    best: list[float] = []  # the best feasible step time so far, once there is one
    pruned = 0
    ordered = sorted(points, key=lambda p: p.bound)
    with torch_orders_built_ahead((p.schedule, p.pp, p.m, p.n_stages) for p in ordered):
        for i, point in enumerate(ordered):
            limit = best[0] * (1 + prune_within) if best and prune_within is not None else float("inf")
            if point.bound > limit:
                pruned += 1
                continue
            # While a worker still builds this point's torch order, evaluate later points that need none: their
            # simulations and splits are memoized (_Costs.simulate, _Point), so the ranking is the one without it.
            if not graph_ready(point.schedule, point.pp, point.m, point.n_stages):
                spare = (p for p in ordered[i + 1:] if not order_from_torch(p.schedule) and p.bound <= limit)
                while not graph_ready(point.schedule, point.pp, point.m, point.n_stages):
                    ahead = next(spare, None)
                    if ahead is None:
                        break
                    ahead.evaluate(memory_limit_bytes, limit)
            for entry in point.evaluate(memory_limit_bytes, limit):
                planned.setdefault(entry.candidate.key, entry)
                if entry.estimate.feasible and (not best or entry.estimate.step_time_ms < best[0]):
                    best[:] = [entry.estimate.step_time_ms]
        limit = best[0] * (1 + prune_within) if best and prune_within is not None else float("inf")
        for entry in _checkpointed_variants(list(planned.values()), costs_at, memory_limit_bytes, limit):
            planned.setdefault(entry.candidate.key, entry)
    logger.debug("planned %d candidates at %d points, pruned %d points", len(planned), len(points), pruned)
    ranked = _even_first(planned.values())
    return ranked[:top] if top is not None else ranked


def _even_first(planned: Iterable[PlannedCandidate]) -> list[PlannedCandidate]:
    """Fastest first, candidates over the memory limit last; among splits of one configuration (same layout,
    schedule, B/M, checkpointing, wire dtype) predicted within EVEN_WITHIN of that configuration's fastest, the more
    even split first (fewer layers away from the uniform split): the profile's noise cannot tell them apart, a
    person can."""
    entries = list(planned)
    best: dict[tuple[Any, ...], float] = {}
    for p in entries:
        group = (_configuration(p.candidate), p.estimate.feasible)
        best[group] = max(best.get(group, 0.0), p.estimate.throughput_samples_per_s)

    def rank(p: PlannedCandidate) -> tuple[Any, ...]:
        throughput = p.estimate.throughput_samples_per_s
        fastest = best[(_configuration(p.candidate), p.estimate.feasible)]
        tied = throughput >= fastest / (1 + EVEN_WITHIN)
        return (not p.estimate.feasible, -(fastest if tied else throughput), _unevenness(p.candidate),
                -throughput, p.candidate.key)

    return sorted(entries, key=rank)


def _configuration(c: Candidate) -> tuple[Any, ...]:
    """A candidate without its split."""
    return (c.pipeline_degree, c.data_parallel_degree, c.schedule, c.n_microbatches, c.activation_checkpointing,
            c.wire_dtype, c.n_stages)


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
    chosen = [parse_schedule(s) for s in schedules] if schedules is not None else list(Schedule)
    largest = 0
    for pp, dp in pipeline_layouts(gpus, batch_size, n_layers):
        per_replica = batch_size // dp
        for schedule in schedules_for(pp, chosen):
            n_stages = pp * default_stages_per_rank(schedule)
            if n_stages > n_layers:
                continue
            for m in _divisors(per_replica):  # fewest micro-batches first
                try:
                    validate_schedule(schedule, pipeline_degree=pp, n_microbatches=m, n_stages=n_stages)
                except InvalidCandidateError:
                    continue
                largest = max(largest, per_replica // m)
                break
    return largest or batch_size


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


def _checkpointed_variants(
    planned: Sequence[PlannedCandidate], costs_at: dict[int, _Costs], memory_limit_bytes: int | None, limit_ms: float
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
        costs = costs_at[c.micro_batch_size]
        balanced = costs.balanced(c.schedule, c.pipeline_degree, c.n_stages, checkpointing=True)
        for split in dict.fromkeys((c.layers_per_stage, balanced)):
            twin = replace(c, layers_per_stage=split, activation_checkpointing=True)
            if twin.key in have or costs.lower_bound(twin) > limit_ms:
                continue
            have.add(twin.key)
            twins.append(PlannedCandidate(candidate=twin, estimate=costs.simulate(twin, memory_limit_bytes)))
    return twins


def _divisors(n: int) -> list[int]:
    small = [d for d in range(1, int(n**0.5) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


class _Costs:
    """Per-layer costs at one micro-batch size, with what every candidate at that size shares."""

    def __init__(
        self, profile: Profile, micro_batch_size: int, link: LinkModel,
        splits: dict[tuple[Any, ...], tuple[int, ...]] | None = None, *, gpus_per_node: int | None = None,
    ) -> None:
        self.layers: list[LayerCost] = profile.layer_costs(micro_batch_size)
        self.gpus_per_node = gpus_per_node
        self.input_bytes = profile.input_bytes_at(micro_batch_size)
        self.link = link
        self.state_ratio = profile.optimizer_state_ratio
        self.step_ratio = profile.optimizer_peak_ratio
        self.step_per_tensor = profile.device == "cpu"
        self.loss_saved = profile.loss_saved_bytes_at(micro_batch_size)
        self.optimizer_ms_per_byte = optimizer_ms_per_byte(profile, link)
        self.time = layer_times(self.layers)
        self.time_checkpointed = layer_times(self.layers, checkpointing=True)
        self.saved_prefix = list(accumulate((c.saved_bytes for c in self.layers), initial=0))
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
            optimizer_state_ratio=self.state_ratio,
            optimizer_peak_ratio=self.step_ratio,
            optimizer_per_tensor=self.step_per_tensor,
            loss_saved_bytes=self.loss_saved,
            link=self.link,
            memory_limit_bytes=memory_limit_bytes,
            with_timeline=False,
            shared_parameters=self.shared,
            gpus_per_node=self.gpus_per_node,
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
            link=self.link,
        )

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
                saved=self.saved_prefix[stop] - self.saved_prefix[start],
                stage_in=self.input_bytes if start == 0 else self.layers[start - 1].output_bytes,
                stage_out=self.layers[stop - 1].output_bytes,
                in_flight=in_flight[stage],
                candidate=candidate,
                first=stage == 0,
                last=stage == last,
                optimizer_state_ratio=self.state_ratio,
            )

        return stage_memory


class _Point:
    """One (layout, schedule, n_microbatches): its first candidates and a lower bound on their step time."""

    def __init__(
        self, *, costs: _Costs, schedule: Schedule, pp: int, dp: int, m: int, n_stages: int, batch_size: int
    ) -> None:
        self.costs, self.schedule, self.pp, self.dp, self.m = costs, schedule, pp, dp, m
        self.n_stages, self.batch_size = n_stages, batch_size
        n_layers = len(costs.layers)
        balanced = costs.balanced(schedule, pp, n_stages)
        # The balanced split, the most even one within noise of it (partition.evened), and the uniform one.
        splits = [balanced, evened(costs.time, balanced, schedule, pp), uniform_split(n_layers, n_stages)]
        self.orders: tuple[RankOrder, ...] = RANK_ORDERS if order_matters(pp, dp, costs.gpus_per_node) else (
            "pp-inner",)
        self.first = [self.make(split, order=order) for i, split in enumerate(splits) if split not in splits[:i]
                      for order in self.orders]
        self.bound = min((costs.lower_bound(c) for c in self.first), default=float("inf"))
        self._memory_splits: dict[tuple[bool, int], tuple[int, ...] | None] = {}  # evaluate()'s, memoized

    def make(self, split: tuple[int, ...], checkpointing: bool = False, order: RankOrder = "pp-inner") -> Candidate:
        return Candidate(
            schedule=self.schedule, pipeline_degree=self.pp, data_parallel_degree=self.dp,
            global_batch_size=self.batch_size, n_microbatches=self.m, layers_per_stage=split,
            activation_checkpointing=checkpointing, rank_order=order,
        )

    def evaluate(self, memory_limit_bytes: int | None, limit_ms: float) -> list[PlannedCandidate]:
        """Simulate the first candidates; when none fits the memory limit, try a memory-aware split, then
        activation checkpointing (skipping any whose lower bound is over limit_ms)."""
        costs = self.costs
        results = [PlannedCandidate(candidate=c, estimate=costs.simulate(c, memory_limit_bytes)) for c in self.first]
        if memory_limit_bytes is None or any(r.estimate.feasible for r in results):
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
