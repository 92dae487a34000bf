"""Write a search's report: report.md with figures/*.png beside it, and one self-contained report.html."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from autotune.candidate import Candidate
from autotune.costs import Profile
from autotune.errors import AutotuneError, UsageError
from autotune.files import atomic_write_bytes, atomic_write_text
from autotune.records import SearchResult
from autotune.report.document import build_document
from autotune.report.facts import ReportFacts, gather_facts
from autotune.report.figures import (
    FigureImage,
    MeasuredPoint,
    loss_per_step,
    memory_per_rank,
    pipeline_timeline,
    search_history,
    stage_balance,
    throughput_vs_microbatches,
)
from autotune.report.html import render_html
from autotune.report.markdown import FIGURES_DIR, render_markdown

if TYPE_CHECKING:
    from autotune.model_file import ModelSpec

log = logging.getLogger(__name__)

FIGURE_NAMES = ("loss_per_step", "throughput_vs_bm", "timeline", "stage_balance", "memory_per_rank", "search_history")
"""Every figure a report may draw (loss_per_step only when an asynchronous configuration ran)."""
_EXPORTS = (("torchtitan", "toml"), ("deepspeed", "json"), ("megatron", "bash"))


def write_search_report(
    result: SearchResult,
    *,
    spec: ModelSpec | None,
    profile: Profile,
    config_path: Path | None,
    report_dir: Path,
    memory_limit_bytes: int | None,
    setup: Mapping[str, Any] | None = None,
) -> Path:
    """Write report_dir/report.md (+ figures/*.png) and report_dir/report.html; return report_dir.

    spec: the loaded model file, for the BatchNorm check (None when the file is not at hand). config_path: the tuned
    config written from this search; when it exists its exports are included. setup: the study's setup (model,
    gpus, batch_size, device, n_trials, seed) for the command that reproduces the search; default result.setup."""
    report_dir = Path(report_dir)
    config_candidate, exports = _config_exports(config_path)
    facts = gather_facts(
        result,
        profile=profile,
        memory_limit_bytes=memory_limit_bytes,
        setup=result.setup if setup is None else setup,
        model=str(spec.path) if spec is not None else None,
        batchnorm_layers=batchnorm_layers(spec, profile),
        config_candidate=config_candidate,
        config_path=str(config_path) if config_path is not None else None,
        exports=exports,
        report_dir=str(report_dir),
    )
    figures = draw_figures(facts)
    blocks = build_document(facts, figures)
    try:
        figures_dir = report_dir / FIGURES_DIR
        figures_dir.mkdir(parents=True, exist_ok=True)
        for figure in figures:
            atomic_write_bytes(figures_dir / figure.filename, figure.png)
        drawn = {figure.name for figure in figures}
        for name in FIGURE_NAMES:  # a figure an earlier report drew but this one cannot: do not leave it stale
            if name not in drawn:
                with contextlib.suppress(FileNotFoundError):
                    (figures_dir / f"{name}.png").unlink()
        atomic_write_text(report_dir / "report.md", render_markdown(blocks))
        atomic_write_text(report_dir / "report.html", render_html(blocks, title=facts.title))
    except OSError as exc:
        raise UsageError(
            f"{report_dir}: cannot write the report ({exc.strerror or exc}); pass --report-dir with a writable folder"
        ) from None
    return report_dir


def draw_figures(facts: ReportFacts) -> list[FigureImage]:
    """Every figure the facts allow, in reading order."""
    result = facts.result
    chosen = facts.chosen
    figures = []
    if facts.loss_curves:  # first: whether 2BW trains as the user needs decides before its speed matters
        figures.append(loss_per_step(facts.loss_curves))
    measured = [
        MeasuredPoint(schedule=r.candidate.schedule, n_microbatches=r.candidate.n_microbatches,
                      data_parallel_degree=r.candidate.data_parallel_degree,
                      throughput_samples_per_s=r.throughput_samples_per_s)
        for r in result.records
        if r.outcome == "ok" and r.launched and r.candidate is not None and r.throughput_samples_per_s
    ]
    if facts.curves or measured:
        default_point = None
        gain = facts.gain
        if gain is not None and gain.default_samples_per_s:
            default_point = (gain.default.n_microbatches, gain.default_samples_per_s, gain.default.key)
        figures.append(throughput_vs_microbatches(
            facts.curves, measured,
            chosen=(chosen.candidate.n_microbatches, chosen.throughput_samples_per_s or 0.0, chosen.candidate.key)
            if chosen else None,
            default=default_point,
            recommended=facts.recommended,
        ))
    if chosen is not None and facts.estimate is not None and facts.estimate.timeline:
        figures.append(pipeline_timeline(
            facts.estimate.timeline, pipeline_degree=chosen.candidate.pipeline_degree, candidate=chosen.candidate,
            bubble_fraction=facts.estimate.bubble_fraction, pipeline_time_ms=facts.estimate.pipeline_time_ms,
        ))
    if facts.balance is not None:
        figures.append(stage_balance(facts.balance))
    if facts.rivals:
        figures.append(memory_per_rank(facts.rivals, facts.memory_limit_bytes))
    if result.records:
        figures.append(search_history(result.records, chosen.candidate if chosen else None))
    return figures


def batchnorm_layers(spec: ModelSpec | None, profile: Profile) -> list[str]:
    """'3 (Sequential)' for each layer that is or contains a BatchNorm (the spec found them at any depth); without
    the model file, only the profile's top-level layer names can tell."""
    if spec is not None:
        return [f"{i} ({spec.layer_names[i]})" for i in spec.batchnorm_layers]
    return [f"{i} ({layer.name})" for i, layer in enumerate(profile.layers) if "BatchNorm" in layer.name]


def _config_exports(config_path: Path | None) -> tuple[Candidate | None, list[tuple[str, str, str]]]:
    """The config file's candidate and its exports, or nothing when there is no readable config."""
    if config_path is None or not Path(config_path).exists():
        return None, []
    from autotune.config_file import load_config
    from autotune.exports import export_config

    try:
        config = load_config(config_path)
    except AutotuneError as exc:
        log.warning("report without exports: %s", exc)
        return None, []
    exports: list[tuple[str, str, str]] = []
    for fmt, language in _EXPORTS:
        try:
            exports.append((fmt, language, export_config(config, fmt)))
        except AutotuneError as exc:
            exports.append((fmt, "", f"cannot export: {exc}"))
    return config.candidate, exports
