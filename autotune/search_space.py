"""The search space: Optuna parameters <-> candidates. The split is a base (the planner's balanced split, or the
uniform one) with each stage boundary shifted by a few layers.

Only combinations that can run are asked: the schedules a layout offers, and the micro-batch counts a schedule
accepts at that layout, are each a parameter of their own (Optuna's categorical choices cannot change between
trials), so the sampler never spends a trial on an invalid one. Equivalent runs are asked once: at pp = 1 only 1F1B
(not GPipe, the same run), no wire dtype (nothing crosses a rank) and no split; the rank order (pp-inner, dp-inner:
autotune.placement) only where it changes what crosses nodes (a pipeline and replicas spanning nodes).

Tensor parallelism is part of the layout: "pp1xdp1xtp2" beside "pp2xdp1" (a tp 1 layout keeps its name, so a study
from before tp resumes), for the tp degrees the search allows (SpaceOptions.tensor_parallel_degrees: the model's plan
and the node's size; layouts.parallel_layout_choices)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any, Protocol, cast

import optuna

from autotune.candidate import Candidate, DataParallelMode, Precision, WireDtype, stage_bounds, uniform_split
from autotune.costs import Profile
from autotune.errors import InvalidCandidateError
from autotune.layouts import DataParallelChoice, data_parallel_choices, parallel_layout_choices
from autotune.partition import balanced_split
from autotune.placement import RANK_ORDERS, RankOrder, order_matters
from autotune.schedules import Schedule, default_stages_per_rank

SPLIT_BASES = ("balanced", "uniform")


class SpaceOptions(Protocol):
    """What the space reads of a search's options (search.SearchOptions has these and more)."""

    @property
    def gpus(self) -> int: ...
    @property
    def batch_size(self) -> int: ...
    @property
    def schedules(self) -> tuple[Schedule, ...]: ...
    @property
    def layouts(self) -> tuple[tuple[int, int], ...] | None: ...
    @property
    def checkpointing(self) -> tuple[bool, ...]: ...
    @property
    def wire_dtypes(self) -> tuple[WireDtype, ...]: ...
    @property
    def precision(self) -> Precision: ...
    @property
    def data_parallel_modes(self) -> tuple[DataParallelMode, ...]: ...
    @property
    def max_shift(self) -> int: ...
    @property
    def gpus_per_node(self) -> int | None: ...
    @property
    def tensor_parallel_degrees(self) -> tuple[int, ...]: ...


class SearchSpace:
    """Maps Optuna parameters to candidates and back.

    Parameters: layout ("pp2xdp1", "pp1xdp1xtp2"); schedule_<layout> (the schedules that run there);
    n_microbatches_<layout>_<schedule> (the counts that schedule accepts there); with more than one stage, split base
    (balanced | uniform) and one shift per stage boundary in [-max_shift, max_shift] layers; activation
    checkpointing; with pp > 1 and fp32 compute, wire dtype; where the layout spans nodes with pp > 1 and dp > 1,
    rank_order; with dp > 1 and more than one way to hold the replicas, data_parallel (replicate | shard |
    shard-reshard: layouts.data_parallel_choices). The precision is the search's, not a parameter (the profile was
    measured at it)."""

    def __init__(self, profile: Profile, options: SpaceOptions) -> None:
        self.profile = profile
        self.options = options
        self.n_layers = profile.n_layers
        self.choices = parallel_layout_choices(options.gpus, options.batch_size, self.n_layers,
                                               tp_degrees=options.tensor_parallel_degrees,
                                               schedules=options.schedules, layouts=options.layouts or None)
        """Per (pp, dp, tp) layout: the schedules that can run there, each with the micro-batch counts it accepts."""
        self.layouts = list(self.choices)
        if not self.layouts:
            raise InvalidCandidateError(
                f"no pipeline x data-parallel layout of {options.gpus} GPUs fits a {self.n_layers}-layer model with "
                f"batch size {options.batch_size}; use --gpus {min(options.gpus, self.n_layers)}"
            )
        self._balanced: dict[tuple[Schedule, int, int, int, bool], tuple[int, ...]] = {}

    @staticmethod
    def _layout_name(pp: int, dp: int, tp: int = 1) -> str:
        return f"pp{pp}xdp{dp}" + (f"xtp{tp}" if tp > 1 else "")

    def balanced(self, schedule: Schedule, pp: int, dp: int, m: int, checkpointing: bool = False) -> tuple[int, ...]:
        """The planner's balanced split (partition.balanced_split) at this micro-batch size, checkpointing included."""
        key = (schedule, pp, dp, m, checkpointing)
        if key not in self._balanced:
            micro = self.options.batch_size // (m * dp)
            n_stages = pp * default_stages_per_rank(schedule)
            self._balanced[key] = balanced_split(
                self.profile.layer_costs(micro), schedule, pp, n_stages, checkpointing=checkpointing
            )
        return self._balanced[key]

    def suggest(self, trial: optuna.Trial) -> Candidate:
        """The trial's candidate; raises InvalidCandidateError for a combination that cannot run (parameters from
        outside this space, e.g. a resumed study's)."""
        names = [self._layout_name(*layout) for layout in self.layouts]
        layout = trial.suggest_categorical("layout", names)
        pp, dp, tp = self.layouts[names.index(layout)]
        choices = self.choices[(pp, dp, tp)]
        schedule = Schedule(trial.suggest_categorical(f"schedule_{layout}", [s.value for s in choices]))
        m = trial.suggest_categorical(f"n_microbatches_{layout}_{schedule.value}", choices[schedule])
        n_stages = pp * default_stages_per_rank(schedule)
        base_name, shifts = "uniform", []
        if n_stages > 1:
            base_name = trial.suggest_categorical("split", list(SPLIT_BASES))
            shifts = [
                trial.suggest_int(f"shift{j}_of_{n_stages}", -self.options.max_shift, self.options.max_shift)
                for j in range(1, n_stages)
            ]
        checkpointing = trial.suggest_categorical("activation_checkpointing", list(self.options.checkpointing))
        order: RankOrder = "pp-inner"
        if self.orders_matter(pp, dp, tp):
            order = cast(RankOrder, trial.suggest_categorical("rank_order", list(RANK_ORDERS)))
        mode, reshard = self._data_parallel(trial, dp, schedule)
        wire: WireDtype = "float32"
        if self._asks_wire(pp):
            wire = cast(WireDtype, trial.suggest_categorical("wire_dtype", list(self.options.wire_dtypes)))
        elif "float32" not in self.options.wire_dtypes:
            raise InvalidCandidateError(
                "no wire dtype to choose here (pp = 1: nothing crosses a rank; bf16 compute: activations cross as "
                "bfloat16 already): only float32 applies"
            )
        candidate = Candidate(
            schedule=schedule,
            pipeline_degree=pp,
            data_parallel_degree=dp,
            global_batch_size=self.options.batch_size,
            n_microbatches=m,
            layers_per_stage=self._split_base(base_name, schedule, pp, dp, m, n_stages, checkpointing),
            activation_checkpointing=checkpointing,
            wire_dtype=wire,
            rank_order=order,
            precision=self.options.precision,
            data_parallel_mode=mode,
            reshard_after_forward=reshard,
            tensor_parallel_degree=tp,
        )
        candidate = replace(candidate, layers_per_stage=_shifted(candidate.layers_per_stage, shifts))
        candidate.validate(self.n_layers)
        return candidate

    def _asks_wire(self, pp: int) -> bool:
        """The wire dtype is a parameter: activations cross ranks (pp > 1) in float32 unless cast (fp32 compute;
        under bf16 compute they cross as bfloat16 already)."""
        return pp > 1 and self.options.precision == "fp32"

    def data_parallel_choices(self, dp: int, schedule: Schedule | None = None) -> list[DataParallelChoice]:
        """How dp replicas may hold their stages in this search under `schedule` (layouts.data_parallel_choices)."""
        return data_parallel_choices(dp, self.options.data_parallel_modes, schedule)

    def _data_parallel(self, trial: optuna.Trial, dp: int, schedule: Schedule) -> DataParallelChoice:
        choices = self.data_parallel_choices(dp, schedule)
        if not choices:
            raise InvalidCandidateError(
                f"dp {dp} allows none of the data-parallel modes {', '.join(self.options.data_parallel_modes)}"
            )
        if len(choices) == 1:
            return choices[0]
        names = [_choice_name(c) for c in choices]
        return choices[names.index(trial.suggest_categorical("data_parallel", names))]

    def orders_matter(self, pp: int, dp: int, tp: int = 1) -> bool:
        """The rank order is a parameter at this layout: its pipelines and replicas span nodes (the pp x dp grid of
        tp groups: gpus_per_node / tp of them a node)."""
        per_node = self.options.gpus_per_node
        return order_matters(pp, dp, per_node // tp if per_node is not None else None)

    def _split_base(
        self, name: str, schedule: Schedule, pp: int, dp: int, m: int, n_stages: int, checkpointing: bool
    ) -> tuple[int, ...]:
        if name == "uniform":
            return uniform_split(self.n_layers, n_stages)
        return self.balanced(schedule, pp, dp, m, checkpointing)

    def params_for(self, candidate: Candidate) -> dict[str, Any] | None:
        """Parameters that make suggest() return this candidate, or None when it lies outside the space."""
        pp, dp, tp = candidate.pipeline_degree, candidate.data_parallel_degree, candidate.tensor_parallel_degree
        valid = self.choices.get((pp, dp, tp), {})
        if (
            (pp, dp, tp) not in self.layouts
            or candidate.n_microbatches not in valid.get(candidate.schedule, [])
            or candidate.activation_checkpointing not in self.options.checkpointing
            or (self._asks_wire(pp) and candidate.wire_dtype not in self.options.wire_dtypes)
            or (not self._asks_wire(pp) and candidate.wire_dtype != "float32")
            or (candidate.rank_order != "pp-inner" and not self.orders_matter(pp, dp, tp))
            or candidate.precision != self.options.precision
            or (candidate.data_parallel_mode, candidate.reshard_after_forward)
            not in self.data_parallel_choices(dp, candidate.schedule)
        ):
            return None
        layout = self._layout_name(pp, dp, tp)
        params: dict[str, Any] = {
            "layout": layout,
            f"schedule_{layout}": candidate.schedule.value,
            f"n_microbatches_{layout}_{candidate.schedule.value}": candidate.n_microbatches,
            "activation_checkpointing": candidate.activation_checkpointing,
        }
        if self._asks_wire(pp):
            params["wire_dtype"] = candidate.wire_dtype
        if self.orders_matter(pp, dp, tp):
            params["rank_order"] = candidate.rank_order
        if len(self.data_parallel_choices(dp, candidate.schedule)) > 1:
            params["data_parallel"] = _choice_name((candidate.data_parallel_mode, candidate.reshard_after_forward))
        n_stages = candidate.n_stages
        if n_stages == 1:
            return params
        for base_name in SPLIT_BASES:
            base = self._split_base(
                base_name,
                candidate.schedule,
                pp,
                dp,
                candidate.n_microbatches,
                n_stages,
                candidate.activation_checkpointing,
            )
            shifts = [b - a for a, b in zip(stage_bounds(base)[1:-1], stage_bounds(candidate.layers_per_stage)[1:-1])]
            if all(abs(s) <= self.options.max_shift for s in shifts):
                params["split"] = base_name
                params.update({f"shift{j}_of_{n_stages}": s for j, s in enumerate(shifts, start=1)})
                return params
        return None


def _choice_name(choice: DataParallelChoice) -> str:
    """The data_parallel parameter's value for a choice: replicate, shard or shard-reshard."""
    mode, reshard = choice
    return f"{mode}-reshard" if reshard else mode


def _shifted(split: tuple[int, ...], shifts: Sequence[int]) -> tuple[int, ...]:
    """Move each inner boundary by its shift, keeping boundaries strictly increasing (every stage >= 1 layer)."""
    bounds = stage_bounds(split)
    total, n = bounds[-1], len(split)
    moved = [0]
    for j in range(1, n):
        lo, hi = moved[-1] + 1, total - (n - j)
        moved.append(min(max(bounds[j] + shifts[j - 1], lo), hi))
    moved.append(total)
    return tuple(b - a for a, b in zip(moved, moved[1:]))
