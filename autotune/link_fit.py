"""Pure: the link model's rank-side costs fitted to a study's own measurements.

What the profile cannot see in advance is what the runtime pays per action and per message on the machine the trials
run on (schedule bookkeeping, posting sends and receives, waking the communication threads): LinkModel's
per_action_overhead_ms, message_overhead_ms and collective_wake_ms, chosen once on the development machine. Once a
study has measured a few candidates, one factor on those three is fitted to them: the one whose predictions are
closest to the measured step times (mean relative error), searched on a grid. The wire (bandwidth, latency, a probe's
inter-node figures) and the profile's compute are left as they are: one factor is what a handful of trials can pin
down without fitting their noise.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from autotune.candidate import Candidate
from autotune.records import TrialRecord
from autotune.simulate import LinkModel, Predictor

MIN_TRIALS = 5
"""Distinct measured candidates before a fit is tried: fewer pin nothing down."""
MAX_SCALE = 4.0
COARSE = tuple(i / 4 for i in range(int(MAX_SCALE * 4) + 1))
"""Factors tried first (0 to MAX_SCALE by 0.25); the best is refined by 0.05 around it."""
MAX_CANDIDATES = 16
"""The fastest measured candidates a fit uses: the ones pruning and ordering compare against, and a bound on the
fit's cost (each factor tried simulates every one)."""
MIN_GAIN = 0.02
"""A fit is kept only if it lowers the mean relative error by at least this much (absolute): else 1.0 stays."""


@dataclass(frozen=True, kw_only=True)
class LinkFit:
    """The factor on the link's rank-side costs that fits a study's measurements, and what it did to the error."""

    scale: float
    """The factor on per_action_overhead_ms, message_overhead_ms and collective_wake_ms (1.0: as given)."""
    trials: int
    """Distinct candidates measured ok that it was fitted to."""
    error_before: float
    """Mean |predicted - measured| / measured over them with the link as given."""
    error_after: float
    """The same with the fitted link."""
    link: LinkModel
    """The fitted link."""

    def to_dict(self) -> dict[str, Any]:
        return {"scale": self.scale, "trials": self.trials, "error_before": self.error_before,
                "error_after": self.error_after}


def measured_steps(records: Iterable[TrialRecord]) -> list[tuple[Candidate, float]]:
    """(candidate, median step ms of its runs) of the launched ok records, the MAX_CANDIDATES fastest."""
    runs: dict[str, list[float]] = {}
    by_key: dict[str, Candidate] = {}
    for r in records:
        if r.launched and r.outcome == "ok" and r.candidate is not None and r.step_time_ms:
            runs.setdefault(r.candidate.key, []).append(r.step_time_ms)
            by_key[r.candidate.key] = r.candidate
    medians = sorted((statistics.median(times) / by_key[key].global_batch_size, key) for key, times in runs.items())
    return [(by_key[key], statistics.median(runs[key])) for _, key in medians[:MAX_CANDIDATES]]


def scaled(link: LinkModel, scale: float) -> LinkModel:
    """link with its rank-side costs times scale."""
    return replace(link, per_action_overhead_ms=link.per_action_overhead_ms * scale,
                   message_overhead_ms=link.message_overhead_ms * scale,
                   collective_wake_ms=link.collective_wake_ms * scale)


def fit_link(predict: Predictor, measured: Sequence[tuple[Candidate, float]]) -> LinkFit | None:
    """The fit of predict's link to measured (candidate, measured step ms) pairs, one per candidate; None with fewer
    than MIN_TRIALS of them. A factor that does not lower the error by MIN_GAIN is not kept (scale 1.0)."""
    pairs = [(c, ms) for c, ms in measured if ms > 0]
    if len(pairs) < MIN_TRIALS:
        return None
    errors: dict[float, float] = {}

    def error(scale: float) -> float:
        if scale not in errors:
            fitted = replace(predict, link=scaled(predict.link, scale))
            errors[scale] = sum(abs(fitted(c).step_time_ms - ms) / ms for c, ms in pairs) / len(pairs)
        return errors[scale]

    best = min(COARSE, key=lambda s: (error(s), abs(s - 1.0)))
    fine = [round(best + k * 0.05, 2) for k in range(-4, 5) if 0.0 <= best + k * 0.05 <= MAX_SCALE]
    best = min(fine, key=lambda s: (error(s), abs(s - 1.0)))
    before = error(1.0)
    if before - error(best) < MIN_GAIN:
        best = 1.0
    return LinkFit(scale=best, trials=len(pairs), error_before=before, error_after=error(best),
                   link=scaled(predict.link, best))
