"""Pure: the report's sentences: why the chosen config won, the warnings that apply, the commands that repeat it."""

from __future__ import annotations

import math
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from autotune.candidate import Candidate, Measurement, stage_bounds
from autotune.costs import Profile
from autotune.errors import AutotuneError
from autotune.plan import PlannedCandidate, plan
from autotune.records import SearchResult, TrialRecord
from autotune.report.measures import Gain, LossCurve, StageBalance, asynchronous_leaders, percent
from autotune.schedules import SCHEDULES, Schedule
from autotune.simulate import Estimate, LinkModel, Predictor
from autotune.tuned_config import mask_password
from autotune.units import format_bytes

WarningKind = Literal[
    "batchnorm", "oom_neighbour", "too_noisy", "interrupted", "no_result", "config_differs", "asynchronous"
]


@dataclass(frozen=True, kw_only=True)
class ReportWarning:
    """Something a practitioner must know before using the chosen config."""

    kind: WarningKind
    title: str
    """One line."""
    text: str
    """What was seen and what to do (inline Markdown: `code`, **bold**)."""


# --- why ---------------------------------------------------------------------------------------------------------


def why_chosen(
    result: SearchResult,
    chosen: Measurement | None,
    chosen_runs: int,
    estimate: Estimate | None,
    default_estimate: Estimate | None,
    gain: Gain | None,
    balance: StageBalance | None,
    default_balance: StageBalance | None,
    recommended: tuple[int, int] | None,
    limit: int | None,
    per_sample: tuple[float, float] | None = None,
) -> tuple[str, ...]:
    """Bullets, strongest reason first: measured speed, gain over the default, bubble, balance, memory, B/M, the
    runner-up, and how well the simulator predicted it."""
    if chosen is None or estimate is None:
        return ()
    c = chosen.candidate
    runs = f"median of {chosen_runs} run{'s' if chosen_runs != 1 else ''}"
    bullets = [
        f"**Fastest measured**: {chosen.throughput_samples_per_s or 0:.0f} samples/s, "
        f"{chosen.step_time_ms or 0:.1f} ms per step ({runs}) of {result.feasible} successful trials.",
        _gain_bullet(c, gain),
        _bubble_bullet(c, result.default, estimate, default_estimate, per_sample),
        _balance_bullet(c, balance, default_balance),
        _layout_bullet(c, estimate),
        _memory_bullet(chosen, estimate, limit),
        _microbatch_bullet(c, recommended),
        _extras_bullet(c),
        _runner_up_bullet(result, c),
        _prediction_bullet(chosen, estimate),
    ]
    return tuple(b for b in bullets if b)


def _gain_bullet(c: Candidate, gain: Gain | None) -> str | None:
    """Against the rule-of-thumb default."""
    if gain is None:
        return None
    d = gain.default
    default_text = f"`{d.key}` (1F1B, B/M {d.n_microbatches}, uniform split {list(d.layers_per_stage)})"
    if gain.ratio is None:
        return f"**Against the rule-of-thumb default** {default_text}: {gain.note}; the chosen config runs."
    if c == d:
        return f"**The rule-of-thumb default itself won**: nothing the search tried beat {default_text}."
    basis = "measured, median over each config's runs" if gain.basis == "measured" else gain.note
    return (
        f"**{percent(gain.ratio - 1.0, signed=True)} throughput over the rule-of-thumb default** "
        f"{default_text}: {gain.chosen_samples_per_s:.0f} vs {gain.default_samples_per_s:.0f} samples/s "
        f"({basis})."
    )


def _bubble_bullet(
    c: Candidate,
    default: Candidate | None,
    estimate: Estimate,
    default_estimate: Estimate | None,
    per_sample: tuple[float, float] | None,
) -> str:
    """The simulated idle time, against the default's, and why a bigger bubble may pay."""
    bubble = f"**Bubble**: the simulator puts idle time at {percent(estimate.bubble_fraction)} of rank-time"
    if default_estimate is not None and default is not None and c != default:
        bubble += f" (the default: {percent(default_estimate.bubble_fraction)})"
        if (estimate.bubble_fraction > default_estimate.bubble_fraction and per_sample is not None
                and c.micro_batch_size > default.micro_batch_size):
            bubble += (
                f", a price worth paying: micro-batches of {c.micro_batch_size} cost {per_sample[0]:.3f} ms of "
                f"compute per sample against {per_sample[1]:.3f} ms at the default's {default.micro_batch_size}"
            )
    if c.pipeline_degree == 1:
        bubble += "; with one rank per pipeline there is no pipeline bubble to fill"
    return bubble + "."


def _balance_bullet(c: Candidate, balance: StageBalance | None, default_balance: StageBalance | None) -> str:
    """How even the split's ranks are, against the uniform split."""
    if balance is not None:
        chosen_imb = StageBalance.imbalance(balance.chosen_ms)
        uniform_imb = StageBalance.imbalance(balance.uniform_ms)
        slowest = max(sum(r) for r in balance.chosen_ms)
        text = (
            f"**Stage balance**: split {list(c.layers_per_stage)}; its slowest rank computes {slowest:.2f} ms per "
            f"micro-batch of {balance.micro_batch_size}, {percent(chosen_imb)} above the mean rank"
        )
        if balance.uniform_split != balance.chosen_split:
            text += f" (the uniform split {list(balance.uniform_split)}: {percent(uniform_imb)} above)"
            if chosen_imb > uniform_imb + 0.02:
                text += "; balance is not what won here, the measured step time is"
        return text + "."
    text = "**Stage balance**: one rank runs every stage of its pipeline, so no rank waits on a slower one"
    if default_balance is not None:
        text += (
            f" (the default's uniform split {list(default_balance.uniform_split)} leaves its slowest rank "
            f"{percent(StageBalance.imbalance(default_balance.uniform_ms))} above the mean at micro-batch "
            f"{default_balance.micro_batch_size})"
        )
    return text + "."


def _layout_bullet(c: Candidate, estimate: Estimate) -> str | None:
    """The data-parallel replicas and their all-reduce; tensor parallelism inside the stages."""
    tp = c.tensor_parallel_degree
    inside = (f" Each stage is split over {tp} consecutive ranks with the model's tensor-parallel plan (its "
              f"projections sharded, all-reduces of the activations in each block on the intra-node link: the "
              f"simulator charges {estimate.tensor_parallel_ms:.1f} ms of the step for them).") if tp > 1 else ""
    if c.data_parallel_degree == 1:
        return f"**Layout**: pp x dp x tp = {c.pipeline_degree} x 1 x {tp}.{inside}" if tp > 1 else None
    return (
        f"**Layout**: {c.data_parallel_degree} data-parallel replicas of a {c.pipeline_degree}-rank pipeline; each "
        f"replica runs {c.replica_batch_size} samples per step and the gradients are all-reduced (the simulator "
        f"charges {estimate.allreduce_ms:.1f} ms for it).{inside}"
    )


def _memory_bullet(chosen: Measurement, estimate: Estimate, limit: int | None) -> str:
    """The fullest rank's peak against the limit."""
    peak = max(chosen.peak_memory_bytes) if chosen.peak_memory_bytes else max(estimate.peak_memory_bytes)
    source = "measured" if chosen.peak_memory_bytes else "predicted"
    if not limit:
        return f"**Memory**: peak {format_bytes(peak)} ({source}, fullest rank); no memory limit was set."
    spare = f"{percent(1 - peak / limit)} to spare" if peak <= limit else f"{percent(peak / limit - 1)} OVER it"
    return (
        f"**Memory headroom**: peak {format_bytes(peak)} ({source}, fullest rank) of the {format_bytes(limit)} "
        f"limit: {spare}."
    )


def _microbatch_bullet(c: Candidate, recommended: tuple[int, int] | None) -> str | None:
    """The chosen B/M against the simulator's recommended range."""
    span = ""
    if recommended is not None:
        lo, hi = recommended
        span = f"{lo}" if lo == hi else f"{lo} to {hi}"
    bm = f"**B/M = {c.n_microbatches}** (micro-batches of {c.micro_batch_size} samples"
    bm += " per replica)" if c.data_parallel_degree > 1 else ")"
    if c.pipeline_degree == 1:
        text = (f"{bm}: with a one-rank pipeline more micro-batches cannot shrink a bubble, they only make each one "
                f"smaller and slower per sample")
        if span:
            text += f"; for one pipeline over all ranks the simulator recommends B/M {span}"
        return text + "."
    if not span:
        return None
    inside = recommended is not None and recommended[0] <= c.n_microbatches <= recommended[1]
    if inside and "to" not in span:
        where = "is the B/M the simulator recommends"
    else:
        where = f"lies {'inside' if inside else 'outside'} the recommended range {span}"
    layout_note = " (the range is for one pipeline over all ranks)" if c.data_parallel_degree > 1 else ""
    return (
        f"{bm} {where}{layout_note}: fewer micro-batches leave a longer bubble, more make each one too small to "
        f"run the device well."
    )


def _extras_bullet(c: Candidate) -> str | None:
    """The wire dtype and activation checkpointing, when used."""
    extras = []
    if c.wire_dtype == "bfloat16" and c.pipeline_degree > 1:
        extras.append("sends bfloat16 between stages (half the bytes on the wire)")
    if c.activation_checkpointing:
        extras.append("recomputes each stage's forward in its backward (activation checkpointing) to save memory")
    return "**Also**: it " + " and ".join(extras) + "." if extras else None


def _runner_up_bullet(result: SearchResult, c: Candidate) -> str | None:
    if len(result.leaders) < 2 or result.leaders[0].candidate != c:
        return None
    runner_up = result.leaders[1]
    margin = runner_up.step_time_ms / result.leaders[0].step_time_ms - 1.0
    return (
        f"**Runner-up** `{runner_up.candidate.key}`: {runner_up.step_time_ms:.1f} ms per step, "
        f"{percent(margin)} slower" + (" — within measurement noise" if result.too_noisy else "") + "."
    )


def _prediction_bullet(chosen: Measurement, estimate: Estimate) -> str | None:
    if not chosen.step_time_ms:
        return None
    error = estimate.step_time_ms / chosen.step_time_ms - 1.0
    return (
        f"**Prediction check**: the simulator predicted {estimate.step_time_ms:.1f} ms per step, "
        f"{percent(abs(error))} {'above' if error >= 0 else 'below'} the measurement."
    )


# --- warnings ----------------------------------------------------------------------------------------------------


def warnings_for(
    result: SearchResult,
    chosen: Measurement | None,
    batchnorm_layers: Sequence[str],
    config_candidate: Candidate | None,
    config_path: str | None,
    loss_curves: Sequence[LossCurve] = (),
) -> tuple[ReportWarning, ...]:
    """Each warning whose condition holds: nothing ran, interrupted, BatchNorm over micro-batches, an OOM next to
    the choice, leaders within noise, a config file that kept an earlier choice, an asynchronous schedule (2BW) that
    ran ok: first when it is the choice, last otherwise."""
    warnings = []
    if chosen is None:
        counts = _outcome_counts(result.records)
        warnings.append(ReportWarning(
            kind="no_result", title="No configuration ran successfully",
            text=f"Outcomes: {counts}. The trial table below gives each reason; the most common fixes are a higher "
            f"--memory-limit, more GPUs, or a smaller --batch-size.",
        ))
    if result.interrupted:
        warnings.append(ReportWarning(
            kind="interrupted", title="The search was interrupted",
            text="It stopped before its budget was spent; continue it with `--resume` and the same --study-name.",
        ))
    if batchnorm_layers and chosen is not None and chosen.candidate.n_microbatches > 1:
        c = chosen.candidate
        warnings.append(ReportWarning(
            kind="batchnorm", title="BatchNorm statistics come from small micro-batches",
            text=f"Layer(s) {', '.join(batchnorm_layers)} use BatchNorm. Under pipelining each micro-batch is "
            f"normalised on its own: statistics over **M = {c.micro_batch_size}** samples, not the global batch of "
            f"{c.global_batch_size}, and they change whenever B/M does, which can cost accuracy. Use **GroupNorm** (or "
            f"LayerNorm), which does not depend on the micro-batch size; with data parallelism, SyncBatchNorm shares "
            f"statistics across replicas but not across micro-batches.",
        ))
    if chosen is not None:
        neighbours = oom_neighbours(chosen.candidate, result.records)
        if neighbours:
            listed = "; ".join(f"trial {r.number} `{r.candidate.key}`" for r in neighbours if r.candidate)
            same = any(r.candidate == chosen.candidate for r in neighbours)
            lead = ("The chosen config itself ran out of memory in one run, and" if same
                    else "The chosen config fits, but")
            warnings.append(ReportWarning(
                kind="oom_neighbour", title="Out of memory next to the chosen config",
                text=f"{lead} a neighbouring configuration (same schedule, a neighbouring B/M or split) ran out of "
                f"memory: {listed}. The chosen one sits close to the edge: a longer sequence, a bigger model or "
                f"another process on the device may push it over. Keep headroom, or prefer a config further from it.",
            ))
    if result.too_noisy and len(result.leaders) >= 2:
        a, b = result.leaders[0], result.leaders[1]
        warnings.append(ReportWarning(
            kind="too_noisy", title="Measurements too noisy to separate the leaders",
            text=f"`{a.candidate.key}` ran {_runs(a.step_times_ms)} ms and `{b.candidate.key}` ran "
            f"{_runs(b.step_times_ms)} ms per step: their runs overlap, so the choice between them is within noise "
            f"(either is sound). To separate them, re-run with more --steps and on a quiet machine.",
        ))
    if config_candidate is not None and chosen is not None and config_candidate != chosen.candidate and config_path:
        warnings.append(ReportWarning(
            kind="config_differs", title=f"{config_path} holds the earlier config",
            text=f"The config file keeps `{config_candidate.key}`; the search's best was `{chosen.candidate.key}` but "
            f"did not beat it by the required margin (--min-improvement).",
        ))
    stale = _asynchronous_warning(result, chosen, loss_curves)
    if stale is not None:
        chosen_is_stale = chosen is not None and SCHEDULES[chosen.candidate.schedule].asynchronous
        warnings.insert(0 if chosen_is_stale else len(warnings), stale)
    return tuple(warnings)


def _asynchronous_warning(
    result: SearchResult, chosen: Measurement | None, loss_curves: Sequence[LossCurve]
) -> ReportWarning | None:
    """A 2BW configuration ran ok: it is fast partly because it changes what training computes, which a few trial
    steps on one batch cannot judge; say so in words, with the measured curves when the trials recorded them."""
    found = asynchronous_leaders(result)
    if not found:
        return None
    if chosen is not None and SCHEDULES[chosen.candidate.schedule].asynchronous:
        c = chosen.candidate
        title = f"The chosen config is asynchronous ({c.schedule.value}): it trains on weights one step old"
        lead = f"The chosen config `{c.key}` runs **{c.schedule.value}**, an asynchronous schedule."
        adopt = "Before adopting it"
    else:
        c = found[0]
        title = f"Asynchronous {c.schedule.value} ran too: it trains on weights one step old"
        lead = (f"{len(found)} configuration{'s' if len(found) != 1 else ''} of the asynchronous schedule "
                f"**{c.schedule.value}** ran (the fastest: `{c.key}`); the chosen config is synchronous.")
        adopt = f"Before adopting a {c.schedule.value} config"
    figure = ""
    stale = next((curve for curve in loss_curves if curve.asynchronous), None)
    synchronous = next((curve for curve in loss_curves if not curve.asynchronous), None)
    if stale is not None:
        figure = (f" (figure *Loss per step*: over the {len(stale.losses)} steps of trial {stale.trial} its loss went "
                  f"from {stale.losses[0]:.4g} to {stale.losses[-1]:.4g}")
        if synchronous is not None:
            figure += (f"; the fastest synchronous config `{synchronous.candidate.key}`'s, over "
                       f"{len(synchronous.losses)} steps, from {synchronous.losses[0]:.4g} to "
                       f"{synchronous.losses[-1]:.4g}")
        figure += ")"
    text = (
        f"{lead} PipeDream-2BW updates the weights one step late: each step's gradient is computed on the weights "
        f"one version old, W(t+1) = W(t) - lr * grad f(W(t-1)), where a synchronous schedule uses grad f(W(t)). "
        f"Its loss per step therefore differs from synchronous training{figure}. A trial trains only a few steps "
        f"on one repeated batch: that cannot show whether training converges as well, or to as good a loss. "
        f"**{adopt}, train your own model with it** long enough to compare its loss with a synchronous schedule's "
        f"(same data, same learning rate); the staleness may call for a lower learning rate or a longer warm-up. "
        f"Exports to torchtitan, DeepSpeed and Megatron refuse it (none of them has an asynchronous schedule): run "
        f"it with `autotune.runtime.setup_pipeline` in your training script."
    )
    return ReportWarning(kind="asynchronous", title=title, text=text)


def oom_neighbours(chosen: Candidate, records: Sequence[TrialRecord]) -> list[TrialRecord]:
    """Trials that ran out of memory with the chosen config's schedule and layout and either the chosen config
    itself, a neighbouring B/M (at most 2x away) with the same split, or the same B/M with each stage boundary
    moved by at most 2 layers."""
    found = []
    for r in records:
        c = r.candidate
        if r.outcome != "oom" or c is None:
            continue
        if (c.schedule, c.pipeline_degree, c.data_parallel_degree, c.tensor_parallel_degree) != (
            chosen.schedule, chosen.pipeline_degree, chosen.data_parallel_degree, chosen.tensor_parallel_degree
        ) or c.n_stages != chosen.n_stages:
            continue
        near_m = abs(math.log2(c.n_microbatches / chosen.n_microbatches)) <= 1.0
        shift = max(abs(a - b) for a, b in zip(stage_bounds(c.layers_per_stage), stage_bounds(chosen.layers_per_stage)))
        same_split = c.layers_per_stage == chosen.layers_per_stage
        if (near_m and same_split) or (c.n_microbatches == chosen.n_microbatches and shift <= 2):
            found.append(r)
    return found




# --- commands ----------------------------------------------------------------------------------------------------


def reproduce_commands(
    result: SearchResult,
    setup: Mapping[str, Any],
    model: str,
    gpus: int | None,
    batch: int | None,
    device: str,
    limit: int | None,
    report_dir: str | None,
) -> tuple[tuple[str, str], ...]:
    """(what, command): repeat the search as a new study, continue this one, rebuild this report."""
    storage = mask_password(result.storage)
    masked = "***" in storage  # a search keeps its storage masked from the start
    args = ["autotune", "search", model]
    if gpus:
        args += ["--gpus", str(gpus)]
    if batch:
        args += ["--batch-size", str(batch)]
    args += ["--device", device]
    if limit is not None:
        args += ["--memory-limit", size_flag(limit)]
    if setup.get("n_trials"):
        args += ["--trials", str(setup["n_trials"])]
    if setup.get("seed") is not None:
        args += ["--seed", str(setup["seed"])]
    repeat = _join(args + ["--study-name", f"{result.study_name}-again"])
    resume = _join(args + ["--storage", storage, "--study-name", result.study_name, "--resume"])
    report = ["autotune", "report", "--storage", storage, "--study-name", result.study_name]
    if report_dir:
        report += ["--report-dir", report_dir]
    note = " (put the storage password back in place of ***)" if masked else ""
    return (
        ("Repeat the search as a new study (same sampler seed; measurements vary run to run)", repeat),
        (f"Continue this study with more trials{note}", resume),
        (f"Rebuild this report from the study{note}", _join(report)),
    )


def size_flag(nbytes: int) -> str:
    """A --memory-limit value that reads back to exactly nbytes: 40GiB, 512MiB, or plain bytes."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes % size == 0:
            return f"{nbytes // size}{unit}"
    return str(nbytes)


def _join(args: Sequence[str]) -> str:
    return " ".join(shlex.quote(a) for a in args)


def _runs(times: Sequence[float]) -> str:
    return ", ".join(f"{t:.1f}" for t in times)


def _outcome_counts(records: Sequence[TrialRecord]) -> str:
    counts: dict[str, int] = {}
    for r in records:
        counts[r.outcome] = counts.get(r.outcome, 0) + 1
    return ", ".join(f"{n} {k}" for k, n in sorted(counts.items(), key=lambda kv: -kv[1])) or "no trials"


# --- when the memory limit decided ------------------------------------------------------------------------------


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
    if chosen.tensor_parallel_degree > baseline.tensor_parallel_degree:
        changes.append(f"tensor parallelism over {chosen.tensor_parallel_degree} ranks (each holds 1/"
                       f"{chosen.tensor_parallel_degree} of the sharded projections and their state)")
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
