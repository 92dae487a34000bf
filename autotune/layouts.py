"""Pure: the layout space, defined once. Which pipeline x data-parallel (x tensor-parallel) layouts a run of `gpus`
ranks over a model of `n_layers` blocks and a global batch allows, which schedules each layout runs, and which
micro-batch counts (B/M per replica) each schedule accepts there. The planner, the search space and
`largest_micro_batch` all ask it, so a new dimension of the space is taught here (and to the simulator and the
runtime), nowhere else.

Tensor parallelism splits each stage over tp consecutive ranks of one node, so a pp x dp x tp layout is a pp x dp
layout of gpus / tp ranks: its schedules and micro-batch counts are those of (pp, dp) over gpus / tp
(parallel_layout_choices). Which tp degrees a run may use is the model's (its plan: autotune.models.
allowed_tp_degrees) and the machine's (tensor_parallel_degrees)."""

from __future__ import annotations

from collections.abc import Iterable

from autotune.candidate import DATA_PARALLEL_MODES, DataParallelMode, pipeline_layouts
from autotune.errors import InvalidCandidateError, UsageError
from autotune.schedules import (
    SCHEDULES,
    SYNCHRONOUS_SCHEDULES,
    Schedule,
    default_stages_per_rank,
    parse_schedule,
    schedules_for,
    validate_schedule,
)

Layout = tuple[int, int]
"""(pp, dp): pipeline degree, data-parallel degree."""
LayoutChoices = dict[Layout, dict[Schedule, list[int]]]
"""Per layout, per schedule that runs there, the micro-batch counts it accepts, fewest first."""
ParallelLayout = tuple[int, int, int]
"""(pp, dp, tp): pipeline, data-parallel and tensor-parallel degrees; pp x dp x tp = gpus."""
ParallelLayoutChoices = dict[ParallelLayout, dict[Schedule, list[int]]]
"""Per pp x dp x tp layout, per schedule that runs there, the micro-batch counts it accepts, fewest first."""


def layout_choices(
    gpus: int,
    batch_size: int,
    n_layers: int,
    *,
    schedules: Iterable[Schedule | str] | None = None,
    layouts: Iterable[Layout] | None = None,
) -> LayoutChoices:
    """Every valid (layout, schedule, B/M) of the run. Layouts are candidate.pipeline_layouts (every pp x dp = gpus
    whose dp divides the batch and whose pp has a layer per rank, pp = 1 included) or the given ones, which must
    cover the ranks with a dp dividing the batch (UsageError otherwise). A schedule runs at a layout when its stages
    (pp x its stages per rank) have a layer each; at pp = 1 only single-stage schedules, GPipe folded into 1F1B
    (schedules.schedules_for). B/M counts are the divisors of B/dp the schedule accepts (validate_schedule). Layouts
    and schedules with no valid count are left out; the order is the layouts', then the schedules' given order."""
    chosen = [parse_schedule(s) for s in schedules] if schedules is not None else list(SYNCHRONOUS_SCHEDULES)
    if layouts is None:
        candidates = pipeline_layouts(gpus, batch_size, n_layers)
    else:
        candidates = list(layouts)
        for pp, dp in candidates:
            if pp * dp != gpus or batch_size % dp:
                raise UsageError(
                    f"layout pp {pp} x dp {dp} does not cover {gpus} GPUs with a dp dividing {batch_size}"
                )
    space: LayoutChoices = {}
    for pp, dp in candidates:
        counts = divisors(batch_size // dp)
        per_layout: dict[Schedule, list[int]] = {}
        for schedule in schedules_for(pp, chosen):
            n_stages = pp * default_stages_per_rank(schedule)
            if n_stages > n_layers:
                continue
            valid = [m for m in counts if _accepts(schedule, pp, m, n_stages)]
            if valid:
                per_layout[schedule] = valid
        if per_layout:
            space[(pp, dp)] = per_layout
    return space


def tensor_parallel_degrees(gpus: int, allowed: Iterable[int], gpus_per_node: int | None = None) -> tuple[int, ...]:
    """The tp degrees a run of `gpus` ranks may use, increasing: of the model's `allowed` ones (models.
    allowed_tp_degrees: divisors of what its plan's heads and sharded sizes allow), those dividing the ranks and at
    most the GPUs of one node (a tp group is consecutive ranks of one node; gpus_per_node None: one machine, all
    `gpus`). Always includes 1."""
    node = gpus if gpus_per_node is None else min(gpus, gpus_per_node)
    return tuple(sorted({1} | {tp for tp in allowed if tp >= 1 and gpus % tp == 0 and tp <= node
                               and (gpus_per_node is None or gpus_per_node % tp == 0)}))


def parallel_layout_choices(
    gpus: int,
    batch_size: int,
    n_layers: int,
    *,
    tp_degrees: Iterable[int] = (1,),
    schedules: Iterable[Schedule | str] | None = None,
    layouts: Iterable[Layout] | None = None,
) -> ParallelLayoutChoices:
    """layout_choices with tensor parallelism: for each tp degree (tensor_parallel_degrees; each must divide gpus),
    the pp x dp layouts of gpus / tp ranks, keyed (pp, dp, tp), tp 1 first. Given `layouts` ((pp, dp) pairs covering
    all gpus) are the tp 1 layouts only: a run asked for those layouts gets no tp. Asynchronous schedules (2BW) only
    at tp 1 (they do not run with tensor parallelism)."""
    space: ParallelLayoutChoices = {}
    chosen = list(schedules) if schedules is not None else None
    for tp in sorted(set(tp_degrees)):
        if tp < 1 or gpus % tp:
            raise UsageError(f"tensor-parallel degree {tp} does not divide {gpus} GPUs; use a divisor of {gpus}")
        if tp > 1 and layouts is not None:
            continue
        given = layouts if tp == 1 else None
        for (pp, dp), per_schedule in layout_choices(gpus // tp, batch_size, n_layers, schedules=chosen,
                                                     layouts=given).items():
            if tp > 1:
                per_schedule = {s: m for s, m in per_schedule.items() if not SCHEDULES[s].asynchronous}
            if per_schedule:
                space[(pp, dp, tp)] = per_schedule
    return space


DataParallelChoice = tuple[DataParallelMode, bool]
"""(data_parallel_mode, reshard_after_forward) of a candidate."""


def data_parallel_choices(
    dp: int, modes: Iterable[DataParallelMode] = DATA_PARALLEL_MODES, schedule: Schedule | None = None
) -> list[DataParallelChoice]:
    """How dp replicas may hold their stages, of the modes asked: replicate; with dp > 1, shard (FSDP2) keeping each
    stage gathered for the step, and shard resharding after every forward (reshard_after_forward). With dp = 1
    only replicate (nothing to shard over; asked for shard alone, that is still the one choice). An asynchronous
    `schedule` (2BW) only replicates (it keeps two whole versions of its stages' weights)."""
    wanted = list(modes)
    if dp == 1:
        return [("replicate", False)]
    if schedule is not None and SCHEDULES[schedule].asynchronous:
        return [("replicate", False)] if "replicate" in wanted else []
    choices: list[DataParallelChoice] = []
    if "replicate" in wanted:
        choices.append(("replicate", False))
    if "shard" in wanted:
        choices += [("shard", False), ("shard", True)]
    return choices


def divisors(n: int) -> list[int]:
    """The divisors of n, increasing."""
    small = [d for d in range(1, int(n**0.5) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def _accepts(schedule: Schedule, pp: int, m: int, n_stages: int) -> bool:
    try:
        validate_schedule(schedule, pipeline_degree=pp, n_microbatches=m, n_stages=n_stages)
    except InvalidCandidateError:
        return False
    return True
