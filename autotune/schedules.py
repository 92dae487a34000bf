"""Schedule names, their constraints and stage placement, and per-rank action lists shared by simulator and runtime."""

from __future__ import annotations

import enum
import functools
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

from autotune.actions import Action, ActionKind  # noqa: F401 - ActionKind re-exported beside Action
from autotune.errors import InvalidCandidateError, UsageError

Placement = Literal["single", "loop", "v"]


class Schedule(str, enum.Enum):
    """Pipeline schedules, named as torch and torchtitan name them."""

    GPIPE = "GPipe"
    ONE_F_ONE_B = "1F1B"
    INTERLEAVED_1F1B = "Interleaved1F1B"
    LOOPED_BFS = "LoopedBFS"
    INTERLEAVED_ZERO_BUBBLE = "InterleavedZeroBubble"
    ZBV_ZERO_BUBBLE = "ZBVZeroBubble"
    DUAL_PIPE_V = "DualPipeV"
    V_HALF = "VHalf"
    """Qi et al. 2024, controllable memory: about 1/2 of 1F1B's activations; torch has no class, see vshape."""
    V_MIN = "VMin"
    """Qi et al. 2024, controllable memory: about 1/3 of 1F1B's activations; torch has no class, see vshape."""
    TWO_BW = "2BW"
    """PipeDream-2BW (Narayanan et al. 2021), asynchronous: 1F1B running on across optimizer steps, two weight
    versions per stage, updates one step stale (autotune.weight_versions). Opt-in only: it changes the optimizer's
    semantics."""

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True, kw_only=True)
class ScheduleInfo:
    placement: Placement
    """single: one stage per rank; loop: rank r holds r, r+pp, ...; v: rank r holds r and 2pp-1-r."""
    stages_per_rank: int | None
    """Fixed number of stages per rank, or None where any v >= 2 works (loop placement)."""
    torch_class: str | None
    """Class name in torch.distributed.pipelining.schedules; None for a schedule torch does not ship, whose order
    autotune generates (action_lists) and runs on torch's own runtime (compat.runtime_schedule)."""
    splits_backward: bool = False
    """Some backwards run as I then W (zero-bubble split); the others as one B."""
    asynchronous: bool = False
    """No flush between optimizer steps: each update uses a gradient one step stale. Never chosen unless the user
    allows it (--allow-async)."""


SCHEDULES: dict[Schedule, ScheduleInfo] = {
    Schedule.GPIPE: ScheduleInfo(placement="single", stages_per_rank=1, torch_class="ScheduleGPipe"),
    Schedule.ONE_F_ONE_B: ScheduleInfo(placement="single", stages_per_rank=1, torch_class="Schedule1F1B"),
    Schedule.INTERLEAVED_1F1B: ScheduleInfo(
        placement="loop", stages_per_rank=None, torch_class="ScheduleInterleaved1F1B"
    ),
    Schedule.LOOPED_BFS: ScheduleInfo(placement="loop", stages_per_rank=None, torch_class="ScheduleLoopedBFS"),
    Schedule.INTERLEAVED_ZERO_BUBBLE: ScheduleInfo(
        placement="loop", stages_per_rank=None, torch_class="ScheduleInterleavedZeroBubble", splits_backward=True
    ),
    Schedule.ZBV_ZERO_BUBBLE: ScheduleInfo(
        placement="v", stages_per_rank=2, torch_class="ScheduleZBVZeroBubble", splits_backward=True
    ),
    Schedule.DUAL_PIPE_V: ScheduleInfo(
        placement="v", stages_per_rank=2, torch_class="ScheduleDualPipeV", splits_backward=True
    ),
    Schedule.V_HALF: ScheduleInfo(placement="v", stages_per_rank=2, torch_class=None, splits_backward=True),
    Schedule.V_MIN: ScheduleInfo(placement="v", stages_per_rank=2, torch_class=None, splits_backward=True),
    Schedule.TWO_BW: ScheduleInfo(placement="single", stages_per_rank=1, torch_class=None, asynchronous=True),
}

SYNCHRONOUS_SCHEDULES: tuple[Schedule, ...] = tuple(s for s in Schedule if not SCHEDULES[s].asynchronous)
"""The schedules planned, searched and accepted by default: every one that flushes at each optimizer step."""


def allowed_schedules(allow_async: bool, *, tied: bool = False) -> tuple[Schedule, ...]:
    """The schedules a run may use: the synchronous ones, and with allow_async the asynchronous ones too, unless the
    model has parameters tied between blocks (tied: see TIED_ASYNC)."""
    return tuple(Schedule) if allow_async and not tied else SYNCHRONOUS_SCHEDULES


TIED_ASYNC = (
    "2BW cannot yet run a model with parameters tied between blocks (GPT-2's embedding and LM head): the tied copies "
    "on two pipeline ranks would need their delayed updates kept in step; use a synchronous schedule, or untie them"
)
"""Why a model with tied parameters gets no asynchronous schedule (a 2BW trial of tied GPT-2 hung at pp 2)."""


def check_async_allowed(schedules: Iterable[Schedule], allow_async: bool) -> None:
    """Refuse an asynchronous schedule the user did not opt into: it trains with stale weights."""
    refused = [s.value for s in schedules if SCHEDULES[s].asynchronous and not allow_async]
    if refused:
        raise UsageError(
            f"{', '.join(refused)} is asynchronous (each update uses a gradient one step stale, so training differs "
            f"from a synchronous schedule's); pass --allow-async to run it"
        )


def parse_schedule(name: str | Schedule) -> Schedule:
    """Case-insensitive schedule lookup; the error lists the names that exist."""
    if isinstance(name, Schedule):
        return name
    for schedule in Schedule:
        if schedule.value.lower() == name.strip().lower():
            return schedule
    names = ", ".join(s.value for s in Schedule)
    raise UsageError(f"unknown schedule {name!r}; pass --schedule with one of: {names}")


def default_stages_per_rank(schedule: Schedule) -> int:
    """Stages per rank when the user does not say: the fixed count, or 2 for loop placement."""
    return SCHEDULES[schedule].stages_per_rank or 2


def stage_ranks(schedule: Schedule, pipeline_degree: int, n_stages: int) -> list[int]:
    """The pipeline rank that holds each stage, in stage order."""
    placement = SCHEDULES[schedule].placement
    if placement == "v":
        return [s if s < pipeline_degree else 2 * pipeline_degree - 1 - s for s in range(n_stages)]
    return [s % pipeline_degree for s in range(n_stages)]


def stages_of_rank(schedule: Schedule, pipeline_degree: int, n_stages: int, rank: int) -> list[int]:
    """The stage indices a rank holds, in increasing order."""
    return [s for s, r in enumerate(stage_ranks(schedule, pipeline_degree, n_stages)) if r == rank]


def validate_schedule(schedule: Schedule, *, pipeline_degree: int, n_microbatches: int, n_stages: int) -> None:
    """Refuse what torch would refuse at construction (or worse, deep inside a step), with the fix."""
    info = SCHEDULES[schedule]
    if n_stages % pipeline_degree:
        raise InvalidCandidateError(
            f"{n_stages} stages cannot be spread evenly over {pipeline_degree} pipeline ranks; "
            f"pass --layers-per-stage with a multiple of {pipeline_degree} entries"
        )
    v = n_stages // pipeline_degree
    if info.stages_per_rank is not None and v != info.stages_per_rank:
        raise InvalidCandidateError(
            f"{schedule.value} runs exactly {info.stages_per_rank} stage(s) per rank, "
            f"so {pipeline_degree * info.stages_per_rank} stages for {pipeline_degree} ranks, not {n_stages}; "
            f"pass --layers-per-stage with {pipeline_degree * info.stages_per_rank} entries"
        )
    if info.stages_per_rank is None and v < 2:
        raise InvalidCandidateError(
            f"{schedule.value} needs at least 2 stages per rank ({2 * pipeline_degree} stages for "
            f"{pipeline_degree} ranks), got {n_stages}; pass --layers-per-stage with {2 * pipeline_degree} entries "
            f"or use 1F1B"
        )
    if schedule is Schedule.TWO_BW and n_microbatches < n_stages:
        raise InvalidCandidateError(
            f"2BW needs at least as many micro-batches per step as stages ({n_stages}), or a stage would need a third "
            f"weight version; got {n_microbatches}: use {n_stages} or more micro-batches (B/M)"
        )
    if schedule is Schedule.ONE_F_ONE_B and n_microbatches < n_stages:
        raise InvalidCandidateError(
            f"1F1B needs at least as many micro-batches as stages ({n_stages}), got {n_microbatches}; "
            f"use {n_stages} or more micro-batches (B/M), or GPipe"
        )
    if schedule in (Schedule.INTERLEAVED_1F1B, Schedule.INTERLEAVED_ZERO_BUBBLE):
        rounds = max(1, n_microbatches // pipeline_degree)
        if n_microbatches % rounds:
            raise InvalidCandidateError(
                f"{schedule.value} with {pipeline_degree} ranks needs the micro-batch count to be a multiple of "
                f"{rounds} (max(1, n_microbatches // pp)); {n_microbatches} is not: use a multiple of "
                f"{pipeline_degree}"
            )
    if schedule is Schedule.DUAL_PIPE_V and n_microbatches < 2 * pipeline_degree:
        raise InvalidCandidateError(
            f"DualPipeV needs at least 2 x pp = {2 * pipeline_degree} micro-batches, got {n_microbatches}; "
            f"use {2 * pipeline_degree} or more micro-batches (B/M)"
        )
    # VHalf and VMin need exactly 2 stages per rank (checked above) and nothing of n_microbatches: autotune.vshape
    # builds a valid order for any count; with fewer micro-batches than the memory cap the cap just never binds.


def schedules_for(pipeline_degree: int, schedules: Iterable[Schedule]) -> list[Schedule]:
    """The schedules worth running at this pipeline degree, one per distinct run. At pp = 1 only single-stage ones
    (more stages on one rank only add overhead), and of GPipe and 1F1B only 1F1B: with one stage both run the same
    forwards and backwards, 1F1B freeing each micro-batch's activations sooner (GPipe is kept when 1F1B is not
    among `schedules`); no asynchronous one: without a pipeline there is no flush for it to remove, only staleness
    to add."""
    chosen = list(dict.fromkeys(schedules))
    if pipeline_degree != 1:
        return chosen
    single = [s for s in chosen if SCHEDULES[s].placement == "single" and not SCHEDULES[s].asynchronous]
    if Schedule.ONE_F_ONE_B in single:
        return [s for s in single if s is not Schedule.GPIPE]
    return single


def order_from_torch(schedule: Schedule) -> bool:
    """Whether action_lists asks torch's schedule classes (importing torch.distributed.pipelining) for the order."""
    return schedule not in (Schedule.ONE_F_ONE_B, Schedule.V_HALF, Schedule.V_MIN, Schedule.TWO_BW)


def action_lists(schedule: Schedule, pipeline_degree: int, n_microbatches: int, n_stages: int) -> list[list[Action]]:
    """Per-rank compute actions in execution order, taken from torch's own schedule so the simulator replays
    exactly what the runtime runs; 1F1B, VHalf and VMin are generated here, and the runtime runs VHalf and VMin
    from these very lists. 2BW's list is one step's 1F1B: the runtime runs consecutive steps' micro-batches as one
    1F1B (autotune.weight_versions), whose steady state this is. Communication is left to the simulator's link
    model."""
    return [list(rank_actions) for rank_actions in _action_lists(schedule, pipeline_degree, n_microbatches, n_stages)]


@functools.lru_cache(maxsize=512)
def _action_lists(
    schedule: Schedule, pipeline_degree: int, n_microbatches: int, n_stages: int
) -> tuple[tuple[Action, ...], ...]:
    validate_schedule(schedule, pipeline_degree=pipeline_degree, n_microbatches=n_microbatches, n_stages=n_stages)
    if schedule in (Schedule.V_HALF, Schedule.V_MIN):
        from autotune.vshape import v_shape_actions

        lists = v_shape_actions("half" if schedule is Schedule.V_HALF else "min", pipeline_degree, n_microbatches)
        return tuple(tuple(rank_actions) for rank_actions in lists)
    if schedule in (Schedule.ONE_F_ONE_B, Schedule.TWO_BW):
        # torch 2.13's get_schedule_ops shifts the last rank's forward micro-batch indices by one (1F4 with 4
        # micro-batches); Schedule1F1B itself runs the textbook order, written out here.
        return tuple(tuple(one_f_one_b(rank, pipeline_degree, n_microbatches)) for rank in range(pipeline_degree))
    from autotune import compat  # torch's private pipelining API, imported only when needed

    ops = compat.schedule_actions(schedule.value, pipeline_degree, n_microbatches, n_stages // pipeline_degree)
    return tuple(tuple(Action(stage, kind, mb, fused) for stage, kind, mb, fused in rank_ops)  # type: ignore[arg-type]
                 for rank_ops in ops)


def one_f_one_b(rank: int, pipeline_degree: int, n_microbatches: int) -> list[Action]:
    """1F1B for one rank: pp - rank warm-up forwards, then one backward and one forward in turn, then the rest.

    pp=2, m=4      t: 0   1   2   3   4   5   6   7
      rank 0          F0  F1  B0  F2  B1  F3  B2  B3
      rank 1          F0  B0  F1  B1  F2  B2  F3  B3
    """
    warmup = min(n_microbatches, pipeline_degree - rank)
    actions = [Action(rank, "F", mb) for mb in range(warmup)]
    next_forward = warmup
    for mb in range(n_microbatches):
        actions.append(Action(rank, "B", mb))
        if next_forward < n_microbatches:
            actions.append(Action(rank, "F", next_forward))
            next_forward += 1
    return actions
