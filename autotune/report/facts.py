"""Pure: what a search's report says, as data: the choice, why it won, how it compares with the rule-of-thumb
default, what to watch out for, and the series the figures draw."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from autotune.candidate import Candidate, Measurement
from autotune.costs import Profile
from autotune.link_fit import LinkFit, with_fit
from autotune.records import SearchResult
from autotune.report.measures import (
    Curve,
    Gain,
    LossCurve,
    NodeLink,
    ParallelismBest,
    RunMemory,
    StageBalance,
    balance_of,
    bm_curves,
    compare_with_default,
    leader_memory,
    loss_curves,
    ms_per_sample,
    node_link,
    parallelism_comparison,
)
from autotune.report.reasons import ReportWarning, memory_choice_reason, reproduce_commands, warnings_for, why_chosen
from autotune.simulate import Estimate, LinkModel, Predictor


@dataclass(frozen=True, kw_only=True)
class ReportFacts:
    """Everything the report renders, computed once."""

    title: str
    """The report's heading: model, ranks, batch."""
    model: str
    """The model file as the search was given it."""
    gpus: int | None
    """Ranks of the search (None when nothing says)."""
    batch_size: int | None
    """Global batch size B of the search."""
    device: str
    """cpu or cuda."""
    memory_limit_bytes: int | None
    """The per-rank limit the search respected; None: none."""
    result: SearchResult
    """The search, every trial included."""
    chosen: Measurement | None
    """The best measurement (median over its runs); None when nothing ran ok."""
    chosen_runs: int
    """Runs behind the chosen config's median."""
    estimate: Estimate | None
    """The chosen config simulated, with its timeline."""
    default_estimate: Estimate | None
    """The rule-of-thumb default simulated."""
    gain: Gain | None
    """The chosen config against the default; None when there is no default or no choice."""
    balance: StageBalance | None
    """Per-rank compute of the chosen split and the uniform one; None with one rank per pipeline."""
    curves: tuple[Curve, ...]
    """Predicted throughput over B/M, one per schedule (and the chosen layout when dp > 1)."""
    recommended: tuple[int, int] | None
    """Recommended B/M range (within 5 % of the best predicted throughput)."""
    rivals: tuple[RunMemory, ...]
    """The chosen config first, then the next leaders, with measured memory."""
    why: tuple[str, ...]
    """Bullets: why this config won."""
    warnings: tuple[ReportWarning, ...]
    """What a practitioner must know, in order of appearance."""
    commands: tuple[tuple[str, str], ...]
    """(what it does, shell command)."""
    exports: tuple[tuple[str, str, str], ...]
    """(format, code language, text) for each export of the config file."""
    batchnorm_layers: tuple[str, ...]
    """Layers that are or contain a BatchNorm ('1 (BatchNorm1d)')."""
    parallelisms: tuple[ParallelismBest, ...] = ()
    """Pipeline or FSDP: the best measured run of each kind of parallelism the search asked about (measures.
    parallelism_comparison); empty when it asked about one kind."""
    loss_curves: tuple[LossCurve, ...] = ()
    """Loss per step of the fastest asynchronous (2BW) configuration and of the fastest synchronous one (measures.
    loss_curves); empty without a 2BW run that recorded its losses."""
    node_link: NodeLink | None = None
    """A multi-node search: its probed link beside the device default, and its predictions against its runs over
    nodes (measures.node_link); None on one node or without a probe."""
    link_fit: LinkFit | None = None
    """The compute slowdown the study's runs support (SearchResult.link_fit: as the search fitted it, and what the
    report's predictions use); None before enough candidates ran."""
    host_probe: tuple[float, float] | None = None
    idle_resume: tuple[tuple[tuple[float, float], ...], float] | None = None
    """The study link's charge for compute right after a rank's wait (LinkModel.idle_resume_ms, the profile's idle
    probe) and the probe's workload in ms; None where it charges none (CUDA, profiles without the probe)."""
    """The CPU stand-in's host probe (Profile.host_call_ms) and the factor it put on the per-action overhead of the
    study's link over the device default (LinkModel.for_profile); None on CUDA, without a probe, or at 1."""


def gather_facts(
    result: SearchResult,
    *,
    profile: Profile,
    memory_limit_bytes: int | None,
    setup: Mapping[str, Any] | None = None,
    model: str | None = None,
    batchnorm_layers: Sequence[str] = (),
    config_candidate: Candidate | None = None,
    config_path: str | None = None,
    exports: Sequence[tuple[str, str, str]] = (),
    report_dir: str | None = None,
) -> ReportFacts:
    """The report's content. setup is the study's setup (model, gpus, batch_size, device, n_trials, seed); missing
    values are taken from the candidates and the profile."""
    setup = dict(setup or {})
    chosen = result.best
    any_candidate = chosen.candidate if chosen else result.default or next(
        (r.candidate for r in result.records if r.candidate is not None), None
    )
    gpus = _int_or_none(setup.get("gpus")) or (any_candidate.world_size if any_candidate else None)
    batch = _int_or_none(setup.get("batch_size")) or (any_candidate.global_batch_size if any_candidate else None)
    model_name = str(setup.get("model") or model or profile.model or "the model")
    device = str(setup.get("device") or profile.device)
    limit = memory_limit_bytes if memory_limit_bytes is not None else _int_or_none(setup.get("memory_limit_bytes"))

    given = Predictor.of_setup(profile, setup, memory_limit_bytes=limit)  # the study's link, before any fit
    predict = with_fit(given, result.link_fit)
    estimate = predict(chosen.candidate, with_timeline=True) if chosen else None
    default_estimate = predict(result.default) if result.default else None
    gain = compare_with_default(result, chosen, estimate, default_estimate)
    balance = balance_of(profile, chosen.candidate) if chosen and chosen.candidate.pipeline_degree > 1 else None
    default_balance = (
        balance_of(profile, result.default) if result.default and result.default.pipeline_degree > 1 else None
    )
    curves, recommended = bm_curves(predict, gpus, batch, chosen.candidate if chosen else None)
    rivals = leader_memory(result, chosen)
    chosen_runs = len(result.leaders[0].step_times_ms) if chosen and result.leaders else 0
    losses = loss_curves(result)
    warnings = warnings_for(result, chosen, batchnorm_layers, config_candidate, config_path, losses)
    per_sample = (
        (ms_per_sample(profile, chosen.candidate), ms_per_sample(profile, result.default))
        if chosen and result.default else None
    )
    why = why_chosen(
        result, chosen, chosen_runs, estimate, default_estimate, gain, balance, default_balance, recommended, limit,
        per_sample,
    )
    if limit is not None and gpus:
        reason = memory_choice_reason(result, predict)
        if reason:  # the limit ruled out the usual choice: say so right after the speed and the gain
            why = (*why[:2], f"**Memory limit decided**: {reason}", *why[2:])
    commands = reproduce_commands(result, setup, model_name, gpus, batch, device, limit, report_dir)
    gpus_text = f" on {gpus} {device} rank(s)" if gpus else ""
    batch_text = f", global batch {batch}" if batch else ""
    return ReportFacts(
        title=f"autotune report: {_short_model(model_name)}{gpus_text}{batch_text}",
        model=model_name,
        gpus=gpus,
        batch_size=batch,
        device=device,
        memory_limit_bytes=limit,
        result=result,
        chosen=chosen,
        chosen_runs=chosen_runs,
        estimate=estimate,
        default_estimate=default_estimate,
        gain=gain,
        balance=balance,
        curves=curves,
        recommended=recommended,
        rivals=rivals,
        why=why,
        warnings=warnings,
        commands=commands,
        exports=tuple(exports),
        batchnorm_layers=tuple(batchnorm_layers),
        parallelisms=parallelism_comparison(result),
        loss_curves=losses,
        node_link=node_link(result, predict, device),
        link_fit=result.link_fit,
        host_probe=_host_probe(profile, given.link, device),  # the probe's factor, not the fit's
        idle_resume=(given.link.idle_resume_ms, given.link.idle_resume_window_ms) if given.link.idle_resume_ms
        else None,
    )


def _host_probe(profile: Profile, link: LinkModel, device: str) -> tuple[float, float] | None:
    """(the probe in ms, the study link's per-action overhead over the device default) where they differ."""
    default = LinkModel.for_device(device).per_action_overhead_ms
    if device != "cpu" or profile.host_call_ms <= 0 or not default:
        return None
    scale = link.per_action_overhead_ms / default
    return (profile.host_call_ms, scale) if abs(scale - 1.0) > 0.005 else None


def _int_or_none(value: Any) -> int | None:
    try:
        return int(value) if value is not None else None
    except (TypeError, ValueError):
        return None


def _short_model(model: str) -> str:
    return model.replace("\\", "/").rsplit("/", 1)[-1]
