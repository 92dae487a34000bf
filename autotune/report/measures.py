"""Pure: the numbers behind the report's claims: gain over the default, stage balance, the B/M curves, the
leaders' memory."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from statistics import median
from typing import Literal

from autotune.candidate import PARALLELISMS, Candidate, Measurement, WireDtype, uniform_split
from autotune.costs import Profile
from autotune.errors import AutotuneError
from autotune.partition import balanced_split, part_costs
from autotune.plan import PlannedCandidate, recommended_microbatch_range
from autotune.records import SearchResult, TrialRecord
from autotune.schedules import (
    SCHEDULES,
    SYNCHRONOUS_SCHEDULES,
    Schedule,
    default_stages_per_rank,
    stage_ranks,
    validate_schedule,
)
from autotune.simulate import Estimate, LinkModel, Predictor

GainBasis = Literal["measured", "predicted"]


@dataclass(frozen=True, kw_only=True)
class Gain:
    """The chosen config against the rule-of-thumb default (uniform split, 1F1B, B/M = 4 x stages)."""

    default: Candidate
    basis: GainBasis
    """measured: the default ran in this search (phase "default"); predicted: both simulated."""
    chosen_samples_per_s: float
    default_samples_per_s: float | None
    """None when the default could not run (see note)."""
    note: str = ""
    """Why the basis is what it is, e.g. the default ran out of memory."""

    @property
    def ratio(self) -> float | None:
        if not self.default_samples_per_s:
            return None
        return self.chosen_samples_per_s / self.default_samples_per_s


@dataclass(frozen=True, kw_only=True)
class StageBalance:
    """Compute per micro-batch (forward + backward, + recompute with checkpointing) of each pipeline rank, in ms,
    per stage the rank holds, for the uniform split and the chosen one."""

    micro_batch_size: int
    uniform_split: tuple[int, ...]
    chosen_split: tuple[int, ...]
    uniform_ms: tuple[tuple[float, ...], ...]
    """Per rank, the ms of each stage it holds."""
    chosen_ms: tuple[tuple[float, ...], ...]

    @staticmethod
    def imbalance(per_rank: Sequence[Sequence[float]]) -> float:
        """Slowest rank over the mean rank, minus 1 (0: perfectly balanced)."""
        loads = [sum(r) for r in per_rank]
        mean = sum(loads) / len(loads)
        return max(loads) / mean - 1.0 if mean > 0 else 0.0


@dataclass(frozen=True, kw_only=True)
class Curve:
    """The simulator's predicted throughput over B/M for one schedule (and layout)."""

    schedule: Schedule
    pipeline_degree: int
    data_parallel_degree: int
    points: tuple[tuple[int, float], ...]
    """(n_microbatches, samples/s), increasing B/M."""


@dataclass(frozen=True, kw_only=True)
class RunMemory:
    """Measured peak memory per global rank of one leader (max over its runs)."""

    candidate: Candidate
    peak_memory_bytes: tuple[int, ...]
    step_time_ms: float


# --- the comparison with the default -----------------------------------------------------------------------------


def compare_with_default(
    result: SearchResult, chosen: Measurement | None, estimate: Estimate | None, default_estimate: Estimate | None
) -> Gain | None:
    default = result.default
    if chosen is None or default is None or chosen.throughput_samples_per_s is None or estimate is None:
        return None
    measured_default = [r for r in result.records if r.phase == "default" and r.candidate == default]
    leader = next((lead for lead in result.leaders if lead.candidate == default), None)
    if leader is not None:
        return Gain(
            default=default, basis="measured", chosen_samples_per_s=chosen.throughput_samples_per_s,
            default_samples_per_s=default.global_batch_size / leader.step_time_ms * 1e3,
        )
    failed = next((r for r in measured_default if r.outcome in ("oom", "error", "timeout")), None)
    predicted_default = default_estimate.throughput_samples_per_s if default_estimate else None
    if failed is not None:
        return Gain(
            default=default, basis="measured", chosen_samples_per_s=chosen.throughput_samples_per_s,
            default_samples_per_s=None,
            note=f"the default ran in trial {failed.number} and failed "
            f"({failed.outcome}: {failed.reason or 'no reason'})",
        )
    if predicted_default is None:
        return None
    return Gain(
        default=default, basis="predicted", chosen_samples_per_s=estimate.throughput_samples_per_s,
        default_samples_per_s=predicted_default,
        note="the default was not run in this search, so both are the simulator's predictions",
    )


def describe_gain(gain: Gain) -> str:
    """'+39 % (measured)' style text."""
    ratio = gain.ratio
    if ratio is None:
        return "n/a"
    return f"{percent(ratio - 1.0, signed=True)} ({gain.basis})"


# --- stage balance -----------------------------------------------------------------------------------------------


def balance_of(profile: Profile, candidate: Candidate) -> StageBalance:
    costs = profile.layer_costs(candidate.micro_batch_size)
    extra = 1.0 if candidate.activation_checkpointing else 0.0
    per_layer = [c.forward_ms * (1.0 + extra) + c.backward_ms for c in costs]
    uniform = uniform_split(profile.n_layers, candidate.n_stages)
    return StageBalance(
        micro_batch_size=candidate.micro_batch_size,
        uniform_split=uniform,
        chosen_split=candidate.layers_per_stage,
        uniform_ms=_per_rank(per_layer, uniform, candidate),
        chosen_ms=_per_rank(per_layer, candidate.layers_per_stage, candidate),
    )


def ms_per_sample(profile: Profile, candidate: Candidate) -> float:
    """Forward + backward compute per sample at the candidate's micro-batch size (the whole model, one device):
    small micro-batches pay a fixed per-micro-batch cost more often, which is why B/M has an optimum."""
    m = candidate.micro_batch_size
    return sum(c.forward_ms + c.backward_ms for c in profile.layer_costs(m)) / m


def _per_rank(per_layer: Sequence[float], split: Sequence[int], candidate: Candidate) -> tuple[tuple[float, ...], ...]:
    ranks = stage_ranks(candidate.schedule, candidate.pipeline_degree, len(split))
    stage_ms = part_costs(per_layer, split)
    return tuple(
        tuple(ms for s, ms in enumerate(stage_ms) if ranks[s] == r) for r in range(candidate.pipeline_degree)
    )


# --- the B/M curve -----------------------------------------------------------------------------------------------


MAX_CURVE_ACTIONS = 4096
"""B/M x stages above this is not simulated for the curve: torch builds the action lists of large micro-batch counts
slowly (minutes at 8 ranks and B/M 2048), and by then the curve has long fallen."""


def bm_curves(
    predict: Predictor, gpus: int | None, batch: int | None, chosen: Candidate | None
) -> tuple[tuple[Curve, ...], tuple[int, int] | None]:
    """Predicted throughput over B/M: each schedule with one pipeline over all ranks, at each valid B/M with its
    balanced split, plus the chosen schedule at the chosen layout when that one has dp > 1; and the recommended
    B/M range over the one-pipeline points (plan.recommended_microbatch_range). Points over the predictor's memory
    limit are left out when any point fits."""
    if not gpus or not batch:
        return (), None
    layouts: list[tuple[Schedule, int, int, WireDtype]] = [
        (schedule, gpus, 1, "float32") for schedule in SYNCHRONOUS_SCHEDULES
    ]
    if chosen is not None and chosen.data_parallel_degree > 1:
        layouts.append((chosen.schedule, chosen.pipeline_degree, chosen.data_parallel_degree, chosen.wire_dtype))
    simulated = [_simulated(predict, schedule, pp, dp, batch, wire) for schedule, pp, dp, wire in layouts]
    one_pipeline = [p for points in simulated[: len(SYNCHRONOUS_SCHEDULES)] for p in points]
    feasible_only = any(p.estimate.feasible for points in simulated for p in points)
    curves = []
    for (schedule, pp, dp, _), points in zip(layouts, simulated):
        kept = tuple((p.candidate.n_microbatches, p.estimate.throughput_samples_per_s) for p in points
                     if p.estimate.feasible or not feasible_only)
        if kept:
            curves.append(Curve(schedule=schedule, pipeline_degree=pp, data_parallel_degree=dp, points=kept))
    recommended = recommended_microbatch_range(one_pipeline) if one_pipeline else None
    return tuple(curves), recommended


def _simulated(
    predict: Predictor, schedule: Schedule, pp: int, dp: int, batch: int, wire: WireDtype
) -> list[PlannedCandidate]:
    """The schedule at every valid B/M of the layout, balanced split, increasing B/M."""
    profile = predict.profile
    n_stages = pp * default_stages_per_rank(schedule)
    if n_stages > profile.n_layers or batch % dp:
        return []
    replica = batch // dp
    points = []
    for m in (d for d in range(1, replica + 1) if replica % d == 0):
        if m * n_stages > MAX_CURVE_ACTIONS:
            break
        try:
            validate_schedule(schedule, pipeline_degree=pp, n_microbatches=m, n_stages=n_stages)
            split = balanced_split(profile.layer_costs(replica // m), schedule, pp, n_stages)
            candidate = Candidate(
                schedule=schedule, pipeline_degree=pp, data_parallel_degree=dp, global_batch_size=batch,
                n_microbatches=m, layers_per_stage=split, wire_dtype=wire, precision=profile.precision,
            )
            estimate = predict(candidate)
        except AutotuneError:
            continue
        points.append(PlannedCandidate(candidate=candidate, estimate=estimate))
    return points


# --- pipeline or FSDP? -------------------------------------------------------------------------------------------

@dataclass(frozen=True, kw_only=True)
class ParallelismBest:
    """The best measured run of one kind of parallelism in the search (or why it has none)."""

    parallelism: str
    """One of PARALLELISMS."""
    best: Measurement | None
    """Its fastest candidate by median over its ok runs; None when none ran ok."""
    ok: int
    """Configurations of this kind that ran ok."""
    failed: dict[str, int]
    """Real runs that ended otherwise, by outcome (oom, error, timeout)."""
    pruned: int
    """Candidates of this kind the simulator ruled out before launching (cannot fit, or cannot win)."""


def parallelism_comparison(result: SearchResult) -> tuple[ParallelismBest, ...]:
    """Per kind of parallelism the search asked about, in PARALLELISMS order: its best measured run (medians over
    runs, as the leaders are ranked), what failed and what was pruned. Empty when the search asked about one kind
    only (nothing to compare)."""
    asked: dict[str, list[TrialRecord]] = {}
    for r in result.records:
        if r.candidate is not None:
            asked.setdefault(r.candidate.parallelism, []).append(r)
    if len(asked) < 2:
        return ()
    leaders = {leader.candidate.parallelism: leader for leader in reversed(result.leaders)}  # fastest wins
    rows = []
    for kind in PARALLELISMS:
        records = asked.get(kind)
        if not records:
            continue
        failed: dict[str, int] = {}
        for r in records:
            if r.launched and r.outcome in ("oom", "error", "timeout"):
                failed[r.outcome] = failed.get(r.outcome, 0) + 1
        leader = leaders.get(kind)
        best = None
        if leader is not None:
            runs = [r for r in records if r.candidate == leader.candidate and r.outcome == "ok"]
            best = Measurement(candidate=leader.candidate, status="ok", step_time_ms=leader.step_time_ms,
                               throughput_samples_per_s=leader.candidate.global_batch_size * 1000 / leader.step_time_ms,
                               peak_memory_bytes=_max_peaks(r.peak_memory_bytes for r in runs if r.peak_memory_bytes))
        rows.append(ParallelismBest(
            parallelism=kind, best=best, failed=failed,
            ok=len({r.candidate for r in records if r.outcome == "ok"}),
            pruned=sum(1 for r in records if r.outcome == "pruned"),
        ))
    return tuple(rows)


# --- the link between nodes --------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class CrossNodeError:
    """One run of a configuration spanning nodes: the simulator's step time beside the measured one."""

    candidate: Candidate
    trial: int
    predicted_ms: float
    """global_batch_size / the trial's predicted throughput (what the search predicted when it asked)."""
    measured_ms: float

    @property
    def error(self) -> float:
        """Signed, relative to the measurement: +0.2 predicted 20 % slower than it ran."""
        return self.predicted_ms / self.measured_ms - 1.0


@dataclass(frozen=True, kw_only=True)
class NodeLink:
    """A multi-node search's link between nodes, as the simulator charged it after the probe, beside the device's
    default (what the planner assumes without a probe, between nodes too), and how far the predictions for
    configurations spanning nodes were from their runs: the probe is the one input a single-node calibration
    cannot check."""

    gpus_per_node: int
    link: LinkModel
    """The search's link: its inter-node figures from the probe, its intra-node ones the search's too."""
    default: LinkModel
    """LinkModel.for_device of the search's device."""
    errors: tuple[CrossNodeError, ...]
    """Launched trials of configurations over more than one node with a measured step time and a prediction, in
    trial order; empty when none ran."""

    @property
    def median_error(self) -> float | None:
        return median(e.error for e in self.errors) if self.errors else None

    @property
    def worst(self) -> CrossNodeError | None:
        return max(self.errors, key=lambda e: abs(e.error), default=None)


def node_link(result: SearchResult, predict: Predictor, device: str) -> NodeLink | None:
    """The link section's numbers; None unless the search ran over nodes with a probed link (its predictor has
    gpus_per_node and inter-node figures). A configuration spans nodes when its ranks outnumber one node's."""
    per_node, link = predict.gpus_per_node, predict.link
    if per_node is None or link.inter_node_bandwidth_bytes_per_s is None:
        return None
    errors = tuple(
        CrossNodeError(candidate=r.candidate, trial=r.number, measured_ms=r.step_time_ms,
                       predicted_ms=r.candidate.global_batch_size / r.predicted_throughput_samples_per_s * 1e3)
        for r in result.records
        if r.launched and r.candidate is not None and r.candidate.world_size > per_node
        and r.step_time_ms and r.predicted_throughput_samples_per_s
    )
    return NodeLink(gpus_per_node=per_node, link=link, default=LinkModel.for_device(device), errors=errors)


# --- loss per step (asynchronous schedules) ----------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class LossCurve:
    """One run's mean loss per trained step, for comparing an asynchronous schedule's training with a synchronous
    one's: every trial trains the same batch from the same initial weights, so synchronous schedules follow one
    curve and 2BW, its gradients one step stale, another."""

    candidate: Candidate
    trial: int
    """The trial number of the run."""
    losses: tuple[float, ...]
    """Per step, warm-up steps first."""

    @property
    def asynchronous(self) -> bool:
        return SCHEDULES[self.candidate.schedule].asynchronous


def asynchronous_leaders(result: SearchResult) -> list[Candidate]:
    """Configurations of an asynchronous schedule (2BW) that ran ok, fastest first: what a user might adopt."""
    return [leader.candidate for leader in result.leaders if SCHEDULES[leader.candidate.schedule].asynchronous]


def loss_curves(result: SearchResult) -> tuple[LossCurve, ...]:
    """The fastest asynchronous configuration's loss per step, then the fastest synchronous one's (when one ran), each
    from its first run that recorded its losses; empty when no asynchronous configuration ran ok with its losses
    recorded (a search without 2BW, or one stored before trials recorded them)."""
    curves: dict[bool, LossCurve] = {}
    for leader in result.leaders:  # fastest first
        kind = SCHEDULES[leader.candidate.schedule].asynchronous
        run = next((r for r in result.records
                    if r.candidate == leader.candidate and r.outcome == "ok" and r.launched and r.losses), None)
        if kind not in curves and run is not None:
            curves[kind] = LossCurve(candidate=leader.candidate, trial=run.number, losses=run.losses)
    if True not in curves:
        return ()
    return tuple(curves[kind] for kind in (True, False) if kind in curves)


# --- memory of the leaders ---------------------------------------------------------------------------------------


def leader_memory(result: SearchResult, chosen: Measurement | None, n: int = 4) -> tuple[RunMemory, ...]:
    """The n fastest leaders (the chosen one first) with their measured peak memory per rank."""
    rivals = []
    for leader in result.leaders[:n]:
        if chosen is not None and leader.candidate == chosen.candidate:
            peaks = chosen.peak_memory_bytes
        else:
            peaks = _max_peaks(
                r.peak_memory_bytes for r in result.records
                if r.candidate == leader.candidate and r.outcome == "ok" and r.peak_memory_bytes
            )
        if peaks:
            rivals.append(RunMemory(candidate=leader.candidate, peak_memory_bytes=peaks,
                                    step_time_ms=leader.step_time_ms))
    return tuple(rivals)


def _max_peaks(runs: Iterable[tuple[int, ...]]) -> tuple[int, ...]:
    """Per rank, the highest peak over the runs."""
    return tuple(max(values) for values in zip(*runs))


def percent(fraction: float, *, signed: bool = False) -> str:
    """'39 %', '+39 %', '0.4 %'."""
    value = fraction * 100
    text = f"{value:+.0f} %" if signed else f"{value:.0f} %"
    if abs(value) < 1 and value != 0:
        text = f"{value:+.1f} %" if signed else f"{value:.1f} %"
    return text
