"""Pure: the report's figures, drawn with matplotlib's Agg canvas from plain data into PNG bytes."""

from __future__ import annotations

import io
from collections.abc import Sequence
from dataclasses import dataclass

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.colors import to_rgb
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch
from matplotlib.ticker import MaxNLocator

from autotune.candidate import Candidate
from autotune.records import TrialRecord
from autotune.report.measures import Curve, LossCurve, RunMemory, StageBalance
from autotune.schedules import Schedule
from autotune.simulate import TimelineEvent

DPI = 100
WIDTH_IN = 11.0

_PALETTE = [
    "#1f77b4",
    "#ff7f0e",
    "#2ca02c",
    "#d62728",
    "#9467bd",
    "#8c564b",
    "#e377c2",
    "#7f7f7f",
    "#bcbd22",
    "#17becf",
]
SCHEDULE_COLOURS = {s: _PALETTE[i % len(_PALETTE)] for i, s in enumerate(Schedule)}
KIND_COLOURS = {"F": "#4c72b0", "B": "#55a868", "I": "#dd8452", "W": "#8172b2"}
KIND_NAMES = {"F": "F forward", "B": "B backward", "I": "I input-grad backward", "W": "W weight-grad backward"}
IDLE_COLOUR = "#e6e6e6"


@dataclass(frozen=True, kw_only=True)
class FigureImage:
    """One rendered figure."""

    name: str
    """File stem: figures/<name>.png."""
    title: str
    caption: str
    """What it shows and how to read it (inline Markdown)."""
    png: bytes
    width_px: int
    height_px: int

    @property
    def filename(self) -> str:
        return f"{self.name}.png"


@dataclass(frozen=True, kw_only=True)
class MeasuredPoint:
    """One real run, for the B/M figure."""

    schedule: Schedule
    n_microbatches: int
    data_parallel_degree: int
    throughput_samples_per_s: float


def _new(height_in: float) -> tuple[Figure, int, int]:
    figure = Figure(figsize=(WIDTH_IN, height_in), dpi=DPI)
    FigureCanvasAgg(figure)
    return figure, round(WIDTH_IN * DPI), round(height_in * DPI)


def _png(figure: Figure) -> bytes:
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=DPI, metadata={"Software": None})
    return buffer.getvalue()


def _image(name: str, title: str, caption: str, figure: Figure, width: int, height: int) -> FigureImage:
    return FigureImage(name=name, title=title, caption=caption, png=_png(figure), width_px=width, height_px=height)


# --- throughput vs B/M -------------------------------------------------------------------------------------------


def throughput_vs_microbatches(
    curves: Sequence[Curve],
    measured: Sequence[MeasuredPoint],
    *,
    chosen: tuple[int, float, str] | None,
    default: tuple[int, float, str] | None,
    recommended: tuple[int, int] | None,
) -> FigureImage:
    """Predicted curves (one per schedule), measured runs, the chosen and default points, the recommended range.

    chosen / default: (n_microbatches, samples/s, label)."""
    figure, width, height = _new(5.6)
    ax = figure.add_axes((0.07, 0.11, 0.66, 0.8))
    xs: set[int] = set()
    for curve in curves:
        colour = SCHEDULE_COLOURS[curve.schedule]
        ms = [m for m, _ in curve.points]
        xs.update(ms)
        dashed = curve.data_parallel_degree > 1
        label = f"{curve.schedule.value}" + (
            f" (pp{curve.pipeline_degree} x dp{curve.data_parallel_degree})" if dashed else ""
        )
        ax.plot(
            ms,
            [t for _, t in curve.points],
            color=colour,
            linestyle="--" if dashed else "-",
            linewidth=1.4,
            alpha=0.85,
            label=label,
        )
    for point in measured:
        xs.add(point.n_microbatches)
        ax.scatter(
            [point.n_microbatches],
            [point.throughput_samples_per_s],
            s=42,
            color=SCHEDULE_COLOURS[point.schedule],
            edgecolors="black",
            linewidths=0.7,
            marker="s" if point.data_parallel_degree > 1 else "o",
            zorder=4,
        )
    if recommended is not None:
        lo, hi = recommended
        ax.axvspan(lo * 2**-0.3, hi * 2**0.3, color="#2ca02c", alpha=0.12, zorder=0)
    if default is not None:
        xs.add(default[0])
        ax.scatter(
            [default[0]],
            [default[1]],
            s=190,
            facecolors="none",
            edgecolors="#444444",
            linewidths=1.8,
            marker="D",
            zorder=5,
        )
    if chosen is not None:
        xs.add(chosen[0])
        ax.scatter(
            [chosen[0]], [chosen[1]], s=330, color="gold", edgecolors="black", linewidths=1.2, marker="*", zorder=6
        )
        ax.annotate(
            f"chosen: {chosen[1]:.0f}/s",
            (chosen[0], chosen[1]),
            textcoords="offset points",
            xytext=(10, 8),
            fontsize=9,
            fontweight="bold",
        )
    if xs:
        ax.set_xscale("log", base=2)
        ticks = sorted(xs)
        ax.set_xticks(ticks)
        ax.set_xticklabels([str(t) for t in ticks], fontsize=8)
        ax.set_xlim(min(ticks) * 2**-0.5, max(ticks) * 2**0.5)
    ax.set_ylim(bottom=0)
    ax.set_xlabel("B/M: micro-batches per pipeline per step (log scale)")
    ax.set_ylabel("throughput (samples/s)")
    ax.set_title("Throughput vs B/M: simulator (lines) and measured runs (markers)")
    ax.grid(True, alpha=0.3)
    if ax.get_legend_handles_labels()[0]:  # no predicted curve (nothing to plot over B/M): no legend, no warning
        lines_legend = ax.legend(
            loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, title="predicted", title_fontsize=8,
            frameon=False,
        )
        ax.add_artist(lines_legend)
    keys = [
        Line2D([], [], marker="o", linestyle="", color="white", markeredgecolor="black", label="measured run (dp1)"),
        Line2D([], [], marker="s", linestyle="", color="white", markeredgecolor="black", label="measured run (dp>1)"),
        Line2D(
            [],
            [],
            marker="*",
            linestyle="",
            color="gold",
            markeredgecolor="black",
            markersize=14,
            label="chosen (median)",
        ),
        Line2D(
            [],
            [],
            marker="D",
            linestyle="",
            color="white",
            markeredgecolor="#444444",
            markersize=9,
            label="rule-of-thumb default",
        ),
        Patch(color="#2ca02c", alpha=0.25, label="recommended B/M"),
    ]
    ax.legend(handles=keys, loc="lower left", bbox_to_anchor=(1.01, 0.0), fontsize=8, frameon=False)
    caption = (
        "Lines: the simulator's predicted throughput for each schedule at each B/M with its balanced split, one "
        "pipeline over all ranks (a dashed line: the chosen schedule at the chosen pp x dp layout; B/M over the "
        "memory limit left out). Markers: real runs, coloured by schedule. The star is the chosen config "
        "(median of its runs), the diamond the rule-of-thumb "
        "default, the green band the recommended B/M range (within 5 % of the best prediction)."
    )
    return _image("throughput_vs_bm", "Throughput vs B/M", caption, figure, width, height)


# --- memory ------------------------------------------------------------------------------------------------------


def memory_per_rank(rivals: Sequence[RunMemory], limit: int | None) -> FigureImage:
    """Measured peak memory per global rank for the chosen config and the next leaders, against the limit; past
    MAX_ROWS ranks, per group of consecutive ranks (the fullest of each group), so a 1024-rank run stays legible."""
    figure, width, height = _new(4.9)
    ax = figure.add_axes((0.08, 0.25, 0.9, 0.67))
    top = max([max(r.peak_memory_bytes) for r in rivals] + ([limit] if limit else [1]))
    scale, unit = _byte_unit(top)
    n_ranks = max(len(r.peak_memory_bytes) for r in rivals) if rivals else 1
    groups = _rank_groups(n_ranks)
    bar = 0.8 / max(1, len(rivals))
    for i, rival in enumerate(rivals):
        peaks = [max(rival.peak_memory_bytes[r] for r in g if r < len(rival.peak_memory_bytes)) for g in groups
                 if g.start < len(rival.peak_memory_bytes)]
        xs = [g - 0.4 + bar * (i + 0.5) for g in range(len(peaks))]
        name = _short(rival.candidate.key)
        label = ("chosen: " if i == 0 else f"#{i + 1}: ") + f"{name} ({rival.step_time_ms:.1f} ms)"
        ax.bar(
            xs,
            [b / scale for b in peaks],
            width=bar * 0.92,
            label=label,
            color=_PALETTE[i % len(_PALETTE)],
            edgecolor="black" if i == 0 else "none",
            linewidth=1.2,
        )
    if limit:
        ax.axhline(
            limit / scale, color="#d62728", linestyle="--", linewidth=1.6, label=f"limit {limit / scale:.1f} {unit}"
        )
        ax.set_ylim(0, max(top, limit) / scale * 1.1)
    grouped = len(groups) < n_ranks
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels([f"{g.start}-{g.stop - 1}" if grouped else f"rank {g.start}" for g in groups],
                       rotation=90 if grouped else 0, fontsize=7 if grouped else None)
    ax.set_ylabel(f"peak memory ({unit})")
    ax.set_xlabel(f"global ranks (the fullest of each group of {len(groups[0])})" if grouped else "global rank")
    limit_text = "the limit" if limit else "no limit set"
    ax.set_title(f"Peak memory per rank, measured: chosen config and its nearest rivals vs {limit_text}")
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.13 - (0.08 if grouped else 0)), fontsize=8, frameon=False,
              ncol=2)
    caption = (
        "Measured peak memory of each rank (the highest over a config's runs) for the chosen config (outlined) and "
        "the next fastest ones, with their median step time; the dashed red line is the per-rank memory limit. On "
        "CPU the peak is the live tensor bytes the trial tracked, on CUDA the allocator's peak."
        + (f" {n_ranks} ranks are drawn in {len(groups)} groups of consecutive ranks, each bar the fullest rank of "
           f"its group." if grouped else "")
    )
    return _image("memory_per_rank", "Peak memory per rank", caption, figure, width, height)


MAX_ROWS = 32
"""Most ranks a figure draws one by one: past it, memory is drawn per group of ranks and the timeline shows a sample
of the pipeline ranks (first and last included)."""


def _short(key: str, most: int = 48) -> str:
    """A candidate key cut to fit a legend (a 64-stage split is hundreds of characters)."""
    return key if len(key) <= most else key[: most - 1] + "…"


def _split_text(split: Sequence[int]) -> str:
    """[3, 2, 2, 2, 3] as it reads, runs of a repeated count folded past 8 stages: [3, 2×3, 3]."""
    if len(split) <= 8:
        return str(list(split))
    runs: list[list[int]] = []
    for n in split:
        if runs and runs[-1][0] == n:
            runs[-1][1] += 1
        else:
            runs.append([n, 1])
    return "[" + ", ".join(f"{n}×{k}" if k > 1 else str(n) for n, k in runs) + "]"


def _rank_groups(n_ranks: int, most: int = MAX_ROWS) -> list[range]:
    """n_ranks split into at most `most` runs of consecutive ranks of one size (the last may be shorter)."""
    size = -(-n_ranks // most)
    return [range(start, min(start + size, n_ranks)) for start in range(0, n_ranks, size)]


def _sampled_ranks(n_ranks: int, most: int = MAX_ROWS) -> list[int]:
    """All ranks, or `most` of them evenly spaced, the first and the last included."""
    if n_ranks <= most:
        return list(range(n_ranks))
    return sorted({round(i * (n_ranks - 1) / (most - 1)) for i in range(most)})


def _byte_unit(top: float) -> tuple[float, str]:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if top >= size:
            return float(size), unit
    return 1.0, "B"


# --- timeline ----------------------------------------------------------------------------------------------------


def pipeline_timeline(
    timeline: Sequence[TimelineEvent],
    *,
    pipeline_degree: int,
    candidate: Candidate,
    bubble_fraction: float,
    pipeline_time_ms: float,
) -> FigureImage:
    """Each rank's simulated actions over one step: F, B (or I and W) blocks, idle gaps in grey, micro-batch
    numbers inside the blocks wide enough to hold them."""
    shown = _sampled_ranks(pipeline_degree)
    row = {rank: i for i, rank in enumerate(shown)}
    height_in = min(9.0, 1.9 + 0.55 * len(shown))
    figure, width, height = _new(height_in)
    ax = figure.add_axes((0.07, 0.7 / height_in, 0.73, 1 - 1.25 / height_in))
    end = max((e.end_ms for e in timeline), default=pipeline_time_ms) or 1.0
    axis_px = width * 0.73
    stages_per_rank: dict[int, list[int]] = {}
    for e in timeline:
        stages_per_rank.setdefault(e.rank, [])
        if e.stage not in stages_per_rank[e.rank]:
            stages_per_rank[e.rank].append(e.stage)
    for i in range(len(shown)):
        ax.broken_barh([(0, end)], (i - 0.4, 0.8), facecolors=IDLE_COLOUR, edgecolor="none", zorder=1)
    font = 7 if len(shown) <= 8 else 6
    blocks: dict[tuple[int, tuple[float, float, float]], list[tuple[float, float]]] = {}
    for e in timeline:  # one artist per row and colour, not per action
        if e.rank not in row:
            continue
        chunk = sorted(stages_per_rank[e.rank]).index(e.stage)
        colour = _lighter(KIND_COLOURS[e.kind], 0.45 * chunk)
        duration = e.end_ms - e.start_ms
        blocks.setdefault((row[e.rank], colour), []).append((e.start_ms, duration))
        if duration / end * axis_px >= 7 * len(str(e.microbatch)) + 3:
            ax.text(
                e.start_ms + duration / 2,
                row[e.rank],
                str(e.microbatch),
                ha="center",
                va="center",
                fontsize=font,
                color="white",
                zorder=3,
            )
    for (i, colour), spans in blocks.items():
        ax.broken_barh(spans, (i - 0.4, 0.8), facecolors=colour, edgecolor="white", linewidth=0.4, zorder=2)
    ax.set_ylim(len(shown) - 0.5, -0.5)
    ax.set_yticks(range(len(shown)))
    ax.set_yticklabels([f"rank {r}" for r in shown])
    ax.set_xlim(0, end)
    ax.set_xlabel("time within one step (ms, simulated)")
    ax.set_title(
        f"Pipeline timeline of the chosen config: {candidate.schedule.value}, B/M {candidate.n_microbatches}, "
        f"split {_split_text(candidate.layers_per_stage)}; idle {bubble_fraction:.0%}"
    )
    kinds = sorted({e.kind for e in timeline}, key="FBIW".index)
    handles = [Patch(color=KIND_COLOURS[k], label=KIND_NAMES[k]) for k in kinds]
    handles.append(Patch(color=IDLE_COLOUR, label="idle (bubble)"))
    if any(len(s) > 1 for s in stages_per_rank.values()):
        handles.append(Patch(color=_lighter(KIND_COLOURS["F"], 0.45), label="lighter: a later stage"))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    caption = (
        "The simulator's replay of the chosen schedule with profiled layer costs: one row per pipeline rank, one block "
        "per action, numbered by micro-batch where it fits. Grey is idle time (the bubble). After the pipeline each "
        "rank still all-reduces gradients (dp > 1) and steps its optimizer, not drawn here."
        + (f" {len(shown)} of the {pipeline_degree} pipeline ranks are drawn, evenly spaced, the first and the last "
           f"included." if len(shown) < pipeline_degree else "")
    )
    return _image("timeline", "Pipeline timeline", caption, figure, width, height)


def _lighter(colour: str, amount: float) -> tuple[float, float, float]:
    r, g, b = to_rgb(colour)
    return (r + (1 - r) * amount, g + (1 - g) * amount, b + (1 - b) * amount)


# --- stage balance -----------------------------------------------------------------------------------------------


def stage_balance(balance: StageBalance) -> FigureImage:
    """Per-rank compute per micro-batch, uniform split beside the chosen one, each bar stacked by stage."""
    figure, width, height = _new(4.6)
    ax = figure.add_axes((0.08, 0.12, 0.64, 0.78))
    n_ranks = len(balance.chosen_ms)
    for offset, (name, per_rank, split, colour) in enumerate(
        (
            ("uniform", balance.uniform_ms, balance.uniform_split, "#9aa5b1"),
            ("chosen", balance.chosen_ms, balance.chosen_split, "#ff9f1c"),
        )
    ):
        for rank, stages in enumerate(per_rank):
            x = rank + (offset - 0.5) * 0.38
            bottom = 0.0
            for k, ms in enumerate(stages):
                ax.bar(
                    [x],
                    [ms],
                    bottom=bottom,
                    width=0.36,
                    color=_lighter(colour, 0.35 * k),
                    edgecolor="black",
                    linewidth=0.6,
                    label=f"{name} split {list(split)}" if rank == 0 and k == 0 else None,
                )
                bottom += ms
            ax.text(x, bottom, f"{bottom:.2f}", ha="center", va="bottom", fontsize=8)
    for per_rank, colour in ((balance.uniform_ms, "#9aa5b1"), (balance.chosen_ms, "#ff9f1c")):
        mean = sum(sum(r) for r in per_rank) / n_ranks
        ax.axhline(mean, color=colour, linestyle=":", linewidth=1.2)
    ax.set_xticks(range(n_ranks))
    ax.set_xticklabels([f"rank {r}" for r in range(n_ranks)])
    ax.set_ylabel(f"compute per micro-batch of {balance.micro_batch_size} (ms)")
    ax.set_xlabel("pipeline rank (stacked segments: the stages a rank holds)")
    ax.set_title(
        f"Stage balance: slowest rank {StageBalance.imbalance(balance.uniform_ms):.0%} above the mean (uniform) vs "
        f"{StageBalance.imbalance(balance.chosen_ms):.0%} (chosen)"
    )
    ax.grid(True, axis="y", alpha=0.3)
    handles, _ = ax.get_legend_handles_labels()
    handles.append(Line2D([], [], color="black", linestyle=":", label="mean rank"))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    caption = (
        "Forward + backward time (+ recompute with activation checkpointing) of each pipeline rank for one "
        "micro-batch, from the per-layer profile, summed over the stages the rank holds: the uniform split beside the "
        "chosen one. The slowest rank sets the pipeline's pace; dotted lines are the mean rank."
    )
    return _image("stage_balance", "Stage balance", caption, figure, width, height)


# --- loss per step -----------------------------------------------------------------------------------------------


def loss_per_step(curves: Sequence[LossCurve]) -> FigureImage:
    """The fastest asynchronous (2BW) configuration's loss per trained step beside the fastest synchronous one's,
    on one axis: how its stale gradients change what the trial's steps computed."""
    figure, width, height = _new(4.6)
    ax = figure.add_axes((0.08, 0.27, 0.9, 0.63))
    for curve in curves:
        c = curve.candidate
        kind = "asynchronous" if curve.asynchronous else "synchronous"
        ax.plot(range(1, len(curve.losses) + 1), curve.losses, marker="o", markersize=4,
                linestyle="--" if curve.asynchronous else "-", color=SCHEDULE_COLOURS[c.schedule],
                label=f"{kind}, trial {curve.trial}: {_short(c.key, 80)}")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("step trained (warm-up steps first)")
    ax.set_ylabel("loss (mean over the step's micro-batches)")
    stale = next(curve for curve in curves if curve.asynchronous).candidate.schedule.value
    ax.set_title(f"Loss per step: the fastest {stale} config"
                 + (" and the fastest synchronous one" if len(curves) > 1 else ""))
    ax.grid(True, alpha=0.3)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.15), fontsize=8, frameon=False)
    caption = (
        "Every trial trains the same batch from the same initial weights, warm-up steps and timed steps alike; each "
        "point is one step's loss, the mean over its micro-batches (and replicas). Synchronous schedules follow one "
        f"curve (up to float rounding). {stale} computes each step's gradient on the weights one version old "
        "(W(t+1) = W(t) - lr * grad f(W(t-1))): its first two steps train the same weights and its curve departs "
        "from the synchronous one. A few steps on one repeated batch say nothing about convergence on real data: "
        "see the warning above."
        + (f" The {stale} trial trains more steps: its warm-up ends with a window as long as its timed one."
           if len({len(curve.losses) for curve in curves}) > 1 else "")
    )
    return _image("loss_per_step", "Loss per step", caption, figure, width, height)


# --- search history ----------------------------------------------------------------------------------------------


def is_repeat(record: TrialRecord) -> bool:
    """A trial that asked for a configuration already measured and was not launched again (stored as "duplicate";
    a live search reports it as ok with launched=False)."""
    return record.outcome == "duplicate" or (record.outcome == "ok" and not record.launched)


_OUTCOME_STYLE = {  # outcome: (marker, colour, legend label)
    "pruned": ("x", "#9e9e9e", "pruned before launch (at its prediction)"),
    "oom": ("v", "#d62728", "out of memory"),
    "error": ("X", "black", "error"),
    "timeout": ("s", "#ff7f0e", "timeout"),
    "interrupted": ("D", "#9467bd", "interrupted"),
}


def _throughputs(records: Sequence[TrialRecord]) -> list[float]:
    return [r.throughput_samples_per_s or 0.0 for r in records]


def search_history(records: Sequence[TrialRecord], chosen: Candidate | None) -> FigureImage:
    """Each trial's throughput in order, failures and pruned trials marked distinctly, and the best so far."""
    figure, width, height = _new(4.8)
    ax = figure.add_axes((0.07, 0.12, 0.64, 0.78))
    measured = [r for r in records if r.outcome == "ok" and r.launched and r.throughput_samples_per_s]
    top = max(
        [r.throughput_samples_per_s or 0.0 for r in measured]
        + [r.predicted_throughput_samples_per_s or 0.0 for r in records]
        + [1.0]
    )
    floor = -0.04 * top
    if measured:
        ax.scatter(
            [r.number for r in measured],
            _throughputs(measured),
            s=36,
            color="#1f77b4",
            edgecolors="black",
            linewidths=0.5,
            zorder=4,
            label="ran ok (measured)",
        )
    repeats = [r for r in records if is_repeat(r) and r.throughput_samples_per_s]
    if repeats:
        ax.scatter(
            [r.number for r in repeats],
            _throughputs(repeats),
            s=36,
            facecolors="none",
            edgecolors="#1f77b4",
            linewidths=1.0,
            zorder=3,
            label="repeat of a measured config (not launched)",
        )
    for outcome, (marker, colour, label) in _OUTCOME_STYLE.items():
        group = [r for r in records if r.outcome == outcome]
        if group:
            ys = (
                [r.predicted_throughput_samples_per_s or floor for r in group]
                if outcome == "pruned"
                else [floor for _ in group]
            )
            ax.scatter(
                [r.number for r in group],
                ys,
                s=44,
                marker=marker,
                color=colour,
                zorder=5,
                label=label + ("" if outcome == "pruned" else " (at the bottom)"),
            )
    if chosen is not None:
        mine = [r for r in measured if r.candidate == chosen]
        if mine:
            ax.scatter(
                [r.number for r in mine],
                _throughputs(mine),
                s=260,
                marker="*",
                color="gold",
                edgecolors="black",
                linewidths=0.9,
                zorder=6,
                label="a run of the chosen config",
            )
    if measured:
        xs, ys, best = [], [], 0.0
        for r in records:
            if r.outcome == "ok" and r.launched and r.throughput_samples_per_s:
                best = max(best, r.throughput_samples_per_s)
            if best > 0:
                xs.append(r.number)
                ys.append(best)
        ax.step(xs, ys, where="post", color="#2ca02c", linewidth=1.6, label="best single run so far", zorder=2)
    default = next((r for r in records if r.phase == "default"), None)
    if default is not None:
        y = default.throughput_samples_per_s or floor
        ax.annotate("default", (default.number, y), textcoords="offset points", xytext=(6, -12), fontsize=8)
    ax.axhline(0, color="black", linewidth=0.6)
    ax.set_ylim(floor * 2, top * 1.12)
    ax.set_xlim(-0.8, max([r.number for r in records], default=0) + 0.8)
    ax.set_xlabel("trial number")
    ax.set_ylabel("throughput (samples/s)")
    counts = {
        k: sum(1 for r in records if r.outcome == k and not is_repeat(r))
        for k in ("ok", "pruned", "oom", "error", "timeout")
    }
    repeats_n = sum(1 for r in records if is_repeat(r))
    counts["repeat" if repeats_n == 1 else "repeats"] = repeats_n
    ax.set_title("Search history: " + ", ".join(f"{n} {k}" for k, n in counts.items() if n))
    ax.grid(True, alpha=0.3)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    caption = (
        "Every trial in the order the study asked it. Filled dots are real runs, hollow ones repeats the search did "
        "not launch again; grey crosses are candidates pruned by the simulator, drawn at their predicted throughput; "
        "out-of-memory, error and timeout trials sit below zero. The green line is the best single run so far; the "
        "final choice is the best *median* among the leaders re-run side by side."
    )
    return _image("search_history", "Search history", caption, figure, width, height)
