"""Pure: the report as a list of blocks (headings, paragraphs, tables, figures, code), rendered to Markdown and HTML
by markdown.py and html.py so both say the same thing."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import autotune
from autotune.candidate import Measurement
from autotune.link_fit import LinkFit
from autotune.records import TrialRecord
from autotune.report.facts import ReportFacts
from autotune.report.figures import FigureImage, is_repeat
from autotune.report.measures import NodeLink, describe_gain, percent
from autotune.schedules import SCHEDULES
from autotune.simulate import HOST_CALL_REFERENCE_MS, Estimate
from autotune.tuned_config import mask_password
from autotune.units import format_bytes, format_rate

Align = Literal["left", "right"]


@dataclass(frozen=True)
class Heading:
    level: int
    text: str


@dataclass(frozen=True)
class Paragraph:
    text: str
    """Inline Markdown: `code`, **bold**, *italic*."""


@dataclass(frozen=True)
class Bullets:
    items: tuple[str, ...]


@dataclass(frozen=True)
class Table:
    header: tuple[str, ...]
    rows: tuple[tuple[str, ...], ...]
    align: tuple[Align, ...]
    highlight: tuple[int, ...] = ()
    """Row indices to emphasise (the chosen config's trials)."""


@dataclass(frozen=True)
class Code:
    text: str
    language: str = ""


@dataclass(frozen=True)
class Image:
    figure: FigureImage


@dataclass(frozen=True)
class Callout:
    title: str
    text: str


Block = Heading | Paragraph | Bullets | Table | Code | Image | Callout


def build_document(facts: ReportFacts, figures: Sequence[FigureImage]) -> list[Block]:
    """The report, top to bottom: the answer first, then why, warnings, figures, every trial, how to reproduce."""
    blocks: list[Block] = [Heading(1, facts.title)]
    blocks += _summary(facts)
    if facts.warnings:
        blocks.append(Heading(2, "Warnings"))
        blocks += [Callout(w.title, w.text) for w in facts.warnings]
    if facts.why:
        blocks += [Heading(2, "Why this configuration"), Bullets(facts.why)]
    if facts.parallelisms:
        blocks += [Heading(2, "Pipeline or FSDP?"), *_parallelisms(facts)]
    if facts.node_link is not None:
        blocks += [Heading(2, "Link between nodes"), *_node_link(facts.node_link, facts.device)]
    if facts.result.workers:
        blocks += [Heading(2, "Workers"), *_workers(facts)]
    if figures:
        blocks.append(Heading(2, "Figures"))
        for figure in figures:
            blocks += [Heading(3, figure.title), Image(figure), Paragraph(figure.caption)]
    blocks += [Heading(2, "Every trial"), *_trials(facts)]
    blocks += [Heading(2, "Reproduce")]
    for what, command in facts.commands:
        blocks += [Paragraph(what + ":"), Code(command, "bash")]
    if facts.exports:
        blocks += [
            Heading(2, "Use the config in another trainer"),
            Paragraph("The same settings exported with `autotune export CONFIG --format ...`; comments in each name "
                      "what the target cannot express."),
        ]
        for fmt, language, text in facts.exports:
            blocks += [Heading(3, fmt), Code(text.rstrip("\n"), language)]
    blocks.append(Paragraph(_footer(facts)))
    return blocks


def _summary(facts: ReportFacts) -> list[Block]:
    chosen = facts.chosen
    if chosen is None:
        return [Paragraph("**No configuration was chosen**: no trial of this search ran successfully. The warnings "
                          "and the trial table below say why each one failed.")]
    c = chosen.candidate
    layout = (f"pp x dp x tp = {c.pipeline_degree} x {c.data_parallel_degree} x {c.tensor_parallel_degree}: "
              f"{c.pipeline_degree} pipeline rank(s) x {c.data_parallel_degree} data-parallel replica(s)")
    if c.tensor_parallel_degree > 1:
        layout += f", each stage tensor-parallel over {c.tensor_parallel_degree} ranks"
    extras = [x for x in ("activation checkpointing" if c.activation_checkpointing else "",
                          "bfloat16 between stages" if c.wire_dtype == "bfloat16" else "",
                          ("replicas sharded with FSDP2" + (", resharded after each forward"
                                                            if c.reshard_after_forward else ""))
                          if c.sharded else "",
                          "bf16 compute over fp32 master weights" if c.precision == "bf16" else "") if x]
    text = (
        f"**Chosen configuration: `{c.key}`** — schedule **{c.schedule.value}**, {layout}, **B/M = "
        f"{c.n_microbatches}** micro-batches of {c.micro_batch_size} samples, layers per stage "
        f"**{list(c.layers_per_stage)}**" + (", " + ", ".join(extras) if extras else "") + ". "
        f"It ran at **{chosen.throughput_samples_per_s or 0:.0f} samples/s** ({chosen.step_time_ms or 0:.1f} ms per "
        f"step, median of {facts.chosen_runs} run{'s' if facts.chosen_runs != 1 else ''})"
    )
    gain = facts.gain
    if gain is not None and gain.ratio is not None and gain.default != c:
        text += (f", **{describe_gain(gain)} over the rule-of-thumb default** `{gain.default.key}` "
                 f"({gain.default_samples_per_s:.0f} samples/s)")
    elif gain is not None and gain.default == c:
        text += "; it *is* the rule-of-thumb default: nothing the search tried beat it"
    elif gain is not None:
        text += f"; the rule-of-thumb default `{gain.default.key}` could not run ({gain.note})"
    text += "."
    if SCHEDULES[c.schedule].asynchronous:  # its speed is not the whole story: say so beside it
        text += (f" **It is asynchronous**: {c.schedule.value} trains each step on weights one step old, so its "
                 f"training differs from a synchronous schedule's; read the first warning below before adopting it.")
    blocks: list[Block] = [Paragraph(text)]
    if facts.estimate is not None:
        blocks.append(_glance(facts, chosen, facts.estimate))
    return blocks


def _glance(facts: ReportFacts, chosen: Measurement, estimate: Estimate) -> Table:
    c = chosen.candidate
    gain = facts.gain
    d = gain.default if gain else None
    de = facts.default_estimate
    default_measured = gain.default_samples_per_s if gain and gain.basis == "measured" else None
    limit = f" (limit {format_bytes(facts.memory_limit_bytes)})" if facts.memory_limit_bytes else ""

    def peak(values: Sequence[int], source: str) -> str:
        return f"{format_bytes(max(values))} {source}{limit}" if values else "-"

    default_runs = [r.peak_memory_bytes for r in facts.result.records
                    if d is not None and r.candidate == d and r.launched and r.peak_memory_bytes]
    if default_runs:
        default_peak = peak([max(run) for run in default_runs], "measured")
    else:
        default_peak = peak(de.peak_memory_bytes, "predicted") if de else "-"

    rows = [
        ("configuration", f"`{c.key}`", f"`{d.key}`" if d else "-"),
        ("schedule", c.schedule.value, d.schedule.value if d else "-"),
        ("pp x dp x tp", f"{c.pipeline_degree} x {c.data_parallel_degree} x {c.tensor_parallel_degree}",
         f"{d.pipeline_degree} x {d.data_parallel_degree} x {d.tensor_parallel_degree}" if d else "-"),
        ("B/M (micro-batch size)", f"{c.n_microbatches} ({c.micro_batch_size})",
         f"{d.n_microbatches} ({d.micro_batch_size})" if d else "-"),
        ("layers per stage", str(list(c.layers_per_stage)), str(list(d.layers_per_stage)) if d else "-"),
        ("throughput, measured", f"**{chosen.throughput_samples_per_s or 0:.0f} samples/s**",
         f"{default_measured:.0f} samples/s" if default_measured else "not measured" if d else "-"),
        ("throughput, predicted", f"{estimate.throughput_samples_per_s:.0f} samples/s",
         f"{de.throughput_samples_per_s:.0f} samples/s" if de else "-"),
        ("gain over the default", describe_gain(gain) if gain else "-", ""),
        ("bubble, predicted", f"{estimate.bubble_fraction:.0%}", f"{de.bubble_fraction:.0%}" if de else "-"),
        ("peak memory, fullest rank", peak(chosen.peak_memory_bytes, "measured"), default_peak),
    ]
    return Table(("", "chosen", "rule-of-thumb default"), tuple(rows), ("left", "left", "left"))


_STATUS = {"ok": "ok", "oom": "**oom**", "error": "**error**", "timeout": "**timeout**", "pruned": "pruned",
           "interrupted": "**interrupted**", "duplicate": "repeat"}


def _parallelisms(facts: ReportFacts) -> list[Block]:
    """The best measured run of each kind of parallelism the search tried, side by side, and the answer."""
    rows: list[tuple[str, ...]] = []
    highlight: list[int] = []
    measured = [p for p in facts.parallelisms if p.best is not None]
    fastest = max(measured, key=lambda p: p.best.throughput_samples_per_s or 0.0) if measured else None
    for p in facts.parallelisms:
        failed = ", ".join(f"{n} {outcome}" for outcome, n in sorted(p.failed.items())) or "-"
        if p.best is None:
            rows.append((p.parallelism, "- (none ran)", "-", "-", "-", str(p.ok), failed, str(p.pruned)))
            continue
        b = p.best
        if facts.chosen is not None and b.candidate == facts.chosen.candidate:
            highlight.append(len(rows))
        relative = ("fastest" if p is fastest else
                    f"{b.throughput_samples_per_s / fastest.best.throughput_samples_per_s:.2f}x"
                    if fastest and fastest.best.throughput_samples_per_s else "-")
        rows.append((
            p.parallelism, f"`{b.candidate.key}`", f"{b.throughput_samples_per_s or 0:.0f}", relative,
            format_bytes(max(b.peak_memory_bytes)) if b.peak_memory_bytes else "-", str(p.ok), failed, str(p.pruned),
        ))
    blocks: list[Block] = [Table(
        ("parallelism", "best measured", "samples/s", "vs fastest", "peak memory", "ran ok", "failed", "pruned"),
        tuple(rows), ("left", "left", "right", "right", "right", "right", "left", "right"), tuple(highlight),
    )]
    if fastest is not None:
        others = [p for p in measured if p is not fastest]
        text = f"Measured here, **{fastest.parallelism}** was fastest"
        if others:
            runner = max(others, key=lambda p: p.best.throughput_samples_per_s or 0.0)
            ratio = (fastest.best.throughput_samples_per_s or 0) / (runner.best.throughput_samples_per_s or 1)
            text += f", {ratio:.2f}x the best {runner.parallelism} run"
        unmeasured = [p.parallelism for p in facts.parallelisms if p.best is None]
        if unmeasured:
            text += f"; {', '.join(unmeasured)} did not run (failed or pruned, counts above)"
        blocks.append(Paragraph(text + ". Each row is that kind's fastest configuration by its median over runs; "
                                "peak memory is the highest rank's."))
    return blocks


def _node_link(nodes: NodeLink, device: str) -> list[Block]:
    """The probed link beside the default the planner would otherwise assume, and whether the predictions it fed
    held for the configurations that crossed nodes."""
    link, default = nodes.link, nodes.default
    ranks = f"{nodes.gpus_per_node} rank{'s' if nodes.gpus_per_node != 1 else ''}"
    intro = (f"The search ran over nodes of {ranks} and probed the link between them before planning: the "
             f"simulator charged every send and collective that crosses nodes at the *between nodes* figures (from "
             f"the probe, never faster than inside a node). Without the probe the planner assumes the {device} "
             f"default everywhere, between nodes too.")
    if link.nodes_share_host:
        intro += (" The probe found both nodes on one machine (one kernel's boot id: launches, network namespaces "
                  "or containers on one host), so their ranks share its cores, and two of them posting to each "
                  "other at once is charged as inside a node.")
    table = Table(
        ("", "between nodes (probed)", "inside a node (this search)", f"{device} default"),
        (("latency", _latency(link.inter_node_latency_s or link.latency_s), _latency(link.latency_s),
          _latency(default.latency_s)),
         ("bandwidth", format_rate(link.inter_node_bandwidth_bytes_per_s or link.bandwidth_bytes_per_s),
          format_rate(link.bandwidth_bytes_per_s), format_rate(default.bandwidth_bytes_per_s)))
        + ((("collectives' bandwidth (the probe's all-reduce)",
             format_rate(link.inter_node_allreduce_bandwidth_bytes_per_s), "as above", "as above"),)
           if link.inter_node_allreduce_bandwidth_bytes_per_s else ()),
        ("left", "right", "right", "right"),
    )
    worst, middle = nodes.worst, nodes.median_error
    if worst is None or middle is None:
        verdict = (f"No configuration over more than one node (more than {ranks}) was measured, so how far the "
                   f"predictions over nodes were from real runs is unknown.")
    else:
        runs = len(nodes.errors)
        verdict = (f"Over the {runs} measured run{'s' if runs != 1 else ''} of configurations spanning nodes, the "
                   f"predicted step time was off by **{percent(middle, signed=True)}** (median; + predicted slower "
                   f"than measured). The worst: `{worst.candidate.key}` (trial #{worst.trial}), predicted "
                   f"{worst.predicted_ms:.1f} ms against {worst.measured_ms:.1f} ms measured, "
                   f"**{percent(worst.error, signed=True)}**.")
    return [Paragraph(intro), table, Paragraph(verdict)]


def _latency(seconds: float) -> str:
    return f"{seconds * 1e6:.0f} us" if seconds < 1e-3 else f"{seconds * 1e3:.2f} ms"


def _workers(facts: ReportFacts) -> list[Block]:
    """A study several searches shared: which runs chose the config, and what each worker measured on its own
    hardware (its medians are of its own runs only: machines are not mixed)."""
    result = facts.result
    if result.chosen_by is not None:
        trials = [r.number for r in result.records
                  if r.launched and r.phase == "remeasure" and r.worker == result.chosen_by]
        shown = ", ".join(f"#{n}" for n in trials[:12]) + (", ..." if len(trials) > 12 else "")
        basis = (f"The configuration was chosen by worker **{result.chosen_by}**'s side-by-side re-runs of the "
                 f"leaders (trials {shown}), taken close together on its own hardware; the other workers' runs "
                 f"found the leaders but did not decide.")
    else:
        basis = ("The configuration was chosen by the median over **every run of the study, every worker's "
                 "together**: their hardware may differ. `autotune report --worker NAME` reports the choice one "
                 "worker's search made from its own side-by-side re-runs.")
    rows, highlight = [], []
    for w in result.workers:
        fastest = w.leaders[0] if w.leaders else None
        if w.worker == result.chosen_by:
            highlight.append(len(rows))
        rows.append((
            w.worker,
            w.host or "-",
            str(w.launched),
            str(w.ok),
            str(w.remeasured),
            f"`{fastest.candidate.key}`" if fastest else "-",
            f"{fastest.step_time_ms:.1f} ({len(fastest.step_times_ms)})" if fastest else "-",
            f"`{w.choice.key}`" if w.choice else "- (fewer than 2 leaders re-run)",
        ))
    intro = (f"{len(result.workers)} searches (workers) launched runs in this study. Per worker, from its own runs "
             f"only: its fastest configuration and that configuration's median step time (and its run count), and "
             f"what its side-by-side re-runs of the leaders chose.")
    header = ("worker", "host", "launched", "ok", "side-by-side re-runs", "its fastest", "step ms (runs)",
              "its side-by-side choice")
    align: tuple[Align, ...] = ("left", "left", "right", "right", "right", "left", "right", "left")
    return [Paragraph(basis), Paragraph(intro), Table(header, tuple(rows), align, tuple(highlight))]


def _trials(facts: ReportFacts) -> list[Block]:
    result = facts.result
    chosen = facts.chosen.candidate if facts.chosen else None
    # A person reads one row per configuration and outcome: trials that asked again for a configuration already in
    # the table without running it (a repeat, or the same pruning) are folded into that first row.
    rows: list[list[str]] = []
    highlight: list[int] = []
    first: dict[tuple[str, str], int] = {}
    folded: dict[int, list[int]] = {}
    for r in result.records:
        kind = "repeat" if is_repeat(r) else r.outcome
        key = (r.candidate.key if r.candidate else f"invalid: {r.reason}", kind)
        if kind in ("repeat", "pruned") and key in first:
            folded.setdefault(first[key], []).append(r.number)
            continue
        if kind == "repeat":  # a repeat of a configuration measured in a row of its own
            measured = (key[0], "ok")
            if measured in first:
                folded.setdefault(first[measured], []).append(r.number)
                continue
        first.setdefault(key, len(rows))
        if chosen is not None and r.candidate == chosen:
            highlight.append(len(rows))
        row = list(_trial_row(r))
        if result.workers:
            row.insert(2, r.worker or "-")
        rows.append(row)
    for row, numbers in folded.items():
        shown = ", ".join(f"#{n}" for n in numbers[:8]) + (", ..." if len(numbers) > 8 else "")
        rows[row][4 if result.workers else 3] += f" (+{len(numbers)} asked again, not launched: {shown})"
    n_folded = sum(len(numbers) for numbers in folded.values())
    launched = sum(1 for r in result.records if r.launched)
    intro = (
        f"{len(result.records)} trials: {launched} launched as real runs, the rest pruned by the simulator or "
        f"repeats of a configuration already measured. *phase*: default (the rule of thumb), seed (the planner's "
        f"best), explore (Optuna's sampler), remeasure (leaders re-run side by side), incumbent (the existing config), "
        f"rank-order (the planner's best over nodes, in both rank orders), parallelism (the planner's best of a kind "
        f"of parallelism the other seeds lack)."
        + (f" {n_folded} trials that asked again for a configuration already listed, without running it, are folded "
           f"into its row; the study in `{mask_password(result.storage)}` keeps every trial." if n_folded else "")
        + (" Rows of the chosen configuration are marked ★." if chosen is not None else "")
        + _host(facts.host_probe)
        + _idle(facts.idle_resume)
        + _fitted(facts.link_fit)
    )
    header: tuple[str, ...] = ("#", "phase", "configuration", "status", "samples/s", "step ms", "peak memory",
                               "predicted samples/s", "reason")
    align: tuple[Align, ...] = ("right", "left", "left", "left", "right", "right", "right", "right", "left")
    if result.workers:  # which search ran each trial
        header, align = (*header[:2], "worker", *header[2:]), (*align[:2], "left", *align[2:])
    return [Paragraph(intro), Table(header, tuple(tuple(row) for row in rows), align, tuple(highlight))]


def _host(probe: tuple[float, float] | None) -> str:
    """The report's sentence on the host probe's factor on the CPU per-action cost (LinkModel.for_profile)."""
    if probe is None:
        return ""
    probe_ms, scale = probe
    return (f" The profile timed this host's Python and dispatch at {probe_ms * 1e3:.0f} us a call "
            f"({HOST_CALL_REFERENCE_MS * 1e3:.1f} on the machine the CPU stand-in's costs were measured on), so the "
            f"simulator took each action's runtime overhead and each send's or receive's post {scale:.2f} x their "
            f"defaults.")


def _idle(idle: tuple[tuple[tuple[float, float], ...], float] | None) -> str:
    """The report's sentence on what the simulator charges an action for its rank's wait before it
    (LinkModel.idle_resume_ms)."""
    if idle is None:
        return ""
    points, window_ms = idle
    gap_ms, extra_ms = points[-1]
    return (f" The profile found this host's compute slower right after a wait: a {window_ms:.1f} ms forward and "
            f"backward took {extra_ms:.2f} ms more after {gap_ms:g} ms idle, so the simulator charged each action "
            f"for its rank's wait before it.")


def _fitted(fit: LinkFit | None) -> str:
    """What fitting the simulator's compute slowdown or rank-side costs to the runs did to the predictions
    (autotune.link_fit)."""
    if fit is None:
        return ""
    if not fit.moved:
        return (f" Fitted to the {fit.trials} fastest measured configurations, the simulator's compute stayed as it "
                f"was ({1 + fit.given_slowdown:.2f} x the profile's; mean step-time error of their predictions "
                f"{fit.error_before:.0%}).")
    if fit.overhead_scale != 1.0:
        return (f" The search fitted the simulator's per-action and per-message costs to the {fit.trials} fastest "
                f"measured configurations: {fit.overhead_scale:.2f} x the defaults' (the compute stayed "
                f"{1 + fit.given_slowdown:.2f} x the profile's); the mean error of their predicted step times moved "
                f"from {fit.error_before:.0%} to {fit.error_after:.0%}, and the trials asked after the fit, like this "
                f"report's predictions, use it.")
    return (f" The search fitted the simulator's compute to the {fit.trials} fastest measured configurations: "
            f"{1 + fit.compute_slowdown:.2f} x the profile's, for {1 + fit.given_slowdown:.2f}; the mean error of "
            f"their predicted step times moved from {fit.error_before:.0%} to {fit.error_after:.0%}, and the trials "
            f"asked after the fit, like this report's predictions, use it.")


def _trial_row(r: TrialRecord) -> tuple[str, ...]:
    status = _STATUS.get(r.outcome, r.outcome)
    if is_repeat(r):
        status = "repeat (not launched)"
    reason = r.reason.replace("\n", " ")
    if len(reason) > 160:
        reason = reason[:157] + "..."
    return (
        str(r.number),
        r.phase,
        f"`{r.candidate.key}`" if r.candidate else "(invalid)",
        status,
        f"{r.throughput_samples_per_s:.0f}" if r.throughput_samples_per_s else "",
        f"{r.step_time_ms:.1f}" if r.step_time_ms else "",
        format_bytes(max(r.peak_memory_bytes)) if r.peak_memory_bytes else "",
        f"{r.predicted_throughput_samples_per_s:.0f}" if r.predicted_throughput_samples_per_s else "",
        reason,
    )


def _footer(facts: ReportFacts) -> str:
    result = facts.result
    return (
        f"*Study `{result.study_name}` in `{mask_password(result.storage)}`: {len(result.records)} trials, "
        f"{result.launched} launched, {result.feasible} ok, {result.wall_time_s:.0f} s of trial time. Report "
        f"written by autotune {autotune.__version__}. Measurements are real multi-process runs on {facts.device}; "
        f"predictions come from the simulator and a one-device profile.*"
    )
