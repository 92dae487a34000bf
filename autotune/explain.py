"""Pure: sentences that say why a search chose what it chose, for the report."""

from __future__ import annotations

from autotune.candidate import Candidate
from autotune.costs import Profile
from autotune.errors import AutotuneError
from autotune.plan import PlannedCandidate, plan
from autotune.records import SearchResult
from autotune.schedules import Schedule
from autotune.simulate import LinkModel, Predictor
from autotune.units import format_bytes


def best_one_f_one_b(
    profile: Profile, *, gpus: int, batch_size: int, link: LinkModel | None = None, gpus_per_node: int | None = None
) -> PlannedCandidate | None:
    """What one would run without a memory limit: 1F1B over all GPUs as one pipeline (dp 1), no checkpointing,
    float32 between stages, at its fastest predicted B/M and split. None when no such pipeline runs."""
    try:
        planned = plan(
            profile, gpus=gpus, batch_size=batch_size, memory_limit_bytes=None, schedules=[Schedule.ONE_F_ONE_B],
            layouts=[(gpus, 1)], link=link, gpus_per_node=gpus_per_node,
        )
    except AutotuneError:
        return None
    plain = [p for p in planned if not p.candidate.activation_checkpointing and p.candidate.wire_dtype == "float32"]
    return plain[0] if plain else None


def memory_choice_reason(result: SearchResult, predict: Predictor) -> str | None:
    """One sentence for the report when the memory limit excluded 1F1B at its best B/M: which lower-memory choice
    won and what it saved (predicted peak bytes of the fullest rank). None when there is no limit, no chosen config,
    or 1F1B at its best B/M fits anyway."""
    memory_limit_bytes = predict.memory_limit_bytes
    if memory_limit_bytes is None or result.best is None:
        return None
    chosen = result.best.candidate
    baseline = best_one_f_one_b(predict.profile, gpus=chosen.world_size, batch_size=chosen.global_batch_size,
                                link=predict.link, gpus_per_node=predict.gpus_per_node)
    if baseline is None:
        return None
    baseline_peak = max(baseline.estimate.peak_memory_bytes)
    if baseline_peak <= memory_limit_bytes:
        return None
    estimate = predict(chosen)
    chosen_peak = max(estimate.peak_memory_bytes)
    saved = baseline_peak - chosen_peak
    measured = (
        f" (measured {format_bytes(max(result.best.peak_memory_bytes))})" if result.best.peak_memory_bytes else ""
    )
    changes = lower_memory_changes(baseline.candidate, chosen) or ["another configuration"]
    what = changes[0] if len(changes) == 1 else ", ".join(changes[:-1]) + " and " + changes[-1]
    return (
        f"The memory limit of {format_bytes(memory_limit_bytes)} per rank excluded 1F1B at its best B/M "
        f"({baseline.candidate.key}, predicted peak {format_bytes(baseline_peak)} on its fullest rank); the chosen "
        f"{chosen.key} fits with a predicted {format_bytes(chosen_peak)}{measured} through {what}: "
        f"{format_bytes(saved)} ({saved / baseline_peak:.0%}) less on the fullest rank."
    )


def lower_memory_changes(baseline: Candidate, chosen: Candidate) -> list[str]:
    """How `chosen` differs from `baseline` in the ways that change memory, as phrases."""
    changes: list[str] = []
    if chosen.schedule is Schedule.V_HALF:
        changes.append("the V-Half schedule (about half of 1F1B's activations in flight)")
    elif chosen.schedule is Schedule.V_MIN:
        changes.append("the V-Min schedule (about a third of 1F1B's activations in flight)")
    elif chosen.schedule is not baseline.schedule:
        changes.append(f"the {chosen.schedule.value} schedule")
    if chosen.activation_checkpointing and not baseline.activation_checkpointing:
        changes.append("activation checkpointing (each stage keeps its input and recomputes its forward)")
    if chosen.data_parallel_degree > baseline.data_parallel_degree:
        if chosen.pipeline_degree == 1:
            changes.append(f"plain data parallelism over {chosen.data_parallel_degree} replicas (no pipeline)")
        else:
            changes.append(
                f"{chosen.data_parallel_degree} data-parallel replicas of a {chosen.pipeline_degree}-rank pipeline"
            )
    if chosen.micro_batch_size < baseline.micro_batch_size:
        changes.append(
            f"smaller micro-batches ({chosen.n_microbatches} of {chosen.micro_batch_size} per replica instead of "
            f"{baseline.n_microbatches} of {baseline.micro_batch_size})"
        )
    if chosen.wire_dtype == "bfloat16" and baseline.wire_dtype != "bfloat16":
        changes.append("bfloat16 between stages (half the receive buffers)")
    same_shape = (chosen.schedule, chosen.n_stages) == (baseline.schedule, baseline.n_stages)
    if same_shape and chosen.layers_per_stage != baseline.layers_per_stage:
        changes.append(
            f"the split {list(chosen.layers_per_stage)} instead of {list(baseline.layers_per_stage)}"
        )
    return changes
