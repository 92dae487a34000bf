"""Pure: the simulator's compute slowdown, or its rank-side costs, fitted to a study's own measurements.

The profile times each block alone, one process on the machine; inside a trial the same blocks run beside the other
ranks' processes, with micro-batches taking turns and activations piling up, and run slower (or, where the profile's
lone process paid for something the trial does not, faster) by an amount that depends on the model and the machine:
LinkModel.compute_slowdown, set once on the development machine (bench/results/action_trace_*.md: 1.12 x the
profile's compute on the CPU stand-in, over six models, but 0.95-1.0 x for a 2-block GPT). What each action, post and
collective costs the rank beside its compute (per_action_overhead_ms, message_overhead_ms, collective_wake_ms) is the
host's Python and dispatch speed, measured on that machine too. Once a study has measured a few candidates, both are
fitted to them, each alone: the slowdown whose predicted step times come closest to the measured ones (mean relative
error), searched on a grid and refined around its best, and one factor on the three rank-side costs the same way;
the one that fits closer is kept. Fitted on 8 configurations of each calibration model and predicting the other 16
(bench/results/link_fit_search.md, against link_fit_compute.md for the slowdown alone): on a 2-core VM whose profiles
ran 1.2-1.9 x slower than the development machine's, mean held-out error 8.2 % with the defaults, 7.6 % with the
slowdown fitted, 6.7 % with either (fitted on all 24, the factor is 1.55-3.25 on four of seven models); on the
development machine, where the defaults were measured, 6.1 / 6.3 / 6.3 % and 6.0 / 6.0 / 6.1 %: a fit there mostly
fits noise.
The wire (bandwidth, latency, a probe's inter-node figures) is left as it is, and only one term is fitted at a time:
that is what a handful of trials can pin down without fitting their noise.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from autotune.candidate import Candidate
from autotune.records import TrialRecord
from autotune.simulate import LinkModel, Predictor

MIN_TRIALS = 5
"""Distinct measured candidates before a fit is tried: fewer pin nothing down."""
LOWEST, HIGHEST = -0.5, 1.5
"""The slowdowns a fit may choose: from half the profile's compute to 2.5 times it."""
COARSE_STEP = 0.1
FINE_STEP = 0.01
"""The grid: LOWEST to HIGHEST by COARSE_STEP, then FINE_STEP within half a coarse step of the best."""
MAX_CANDIDATES = 16
"""The fastest measured candidates a fit uses: the ones pruning and ordering compare against, and a bound on the
fit's cost (each slowdown tried simulates every one)."""
MIN_GAIN = 0.02
"""A fit is kept only if it lowers the mean relative error by at least this much (absolute): else the link's own
slowdown stays."""
OVERHEAD_SCALES = tuple(k / 4 for k in range(1, 17))
OVERHEAD_FINE_STEP = 0.05
"""The factors a fit may put on the rank-side costs: 0.25 to 4 by 0.25, then by OVERHEAD_FINE_STEP within half a
step of the best."""


@dataclass(frozen=True, kw_only=True)
class LinkFit:
    """The compute slowdown, or the factor on the rank-side costs, that fits a study's measurements, and what it did
    to the predictions' error."""

    compute_slowdown: float
    """The fitted LinkModel.compute_slowdown (given_slowdown where no slowdown gained MIN_GAIN, or where the factor
    on the rank-side costs fitted closer)."""
    given_slowdown: float
    """The link's own, before the fit."""
    overhead_scale: float = 1.0
    """The factor fitted on the link's per-action, per-message and wake costs (scaled_overheads); 1 where the
    compute slowdown fitted closer, or neither gained MIN_GAIN."""
    trials: int
    """Distinct candidates measured ok that it was fitted to."""
    error_before: float
    """Mean |predicted - measured| / measured over them with the link as given."""
    error_after: float
    """The same with the fitted slowdown."""
    link: LinkModel
    """The fitted link."""

    @property
    def moved(self) -> bool:
        return self.compute_slowdown != self.given_slowdown or self.overhead_scale != 1.0

    def to_dict(self) -> dict[str, Any]:
        return {"compute_slowdown": self.compute_slowdown, "given_slowdown": self.given_slowdown,
                "overhead_scale": self.overhead_scale, "trials": self.trials, "error_before": self.error_before,
                "error_after": self.error_after}

    def describe(self) -> str:
        """What the fit changed, for a progress line and the report: "compute x1.30 the profile's (was x1.12)"."""
        if self.overhead_scale != 1.0:
            return f"per-action and per-message costs x{self.overhead_scale:.2f} the defaults'"
        return f"compute x{1 + self.compute_slowdown:.2f} the profile's (was x{1 + self.given_slowdown:.2f})"


def scaled_overheads(link: LinkModel, scale: float) -> LinkModel:
    """link with its rank-side costs (per action, per message, the collectives' wake, DistributedDataParallel's
    forward) times scale."""
    return replace(link, per_action_overhead_ms=link.per_action_overhead_ms * scale,
                   message_overhead_ms=link.message_overhead_ms * scale,
                   collective_wake_ms=link.collective_wake_ms * scale,
                   replica_forward_overhead_ms=link.replica_forward_overhead_ms * scale)


def measured_steps(records: Iterable[TrialRecord]) -> list[tuple[Candidate, float]]:
    """(candidate, median step ms of its runs) of the launched ok records, the MAX_CANDIDATES fastest per sample."""
    runs: dict[str, list[float]] = {}
    by_key: dict[str, Candidate] = {}
    for r in records:
        if r.launched and r.outcome == "ok" and r.candidate is not None and r.step_time_ms:
            runs.setdefault(r.candidate.key, []).append(r.step_time_ms)
            by_key[r.candidate.key] = r.candidate
    medians = sorted((statistics.median(times) / by_key[key].global_batch_size, key) for key, times in runs.items())
    return [(by_key[key], statistics.median(runs[key])) for _, key in medians[:MAX_CANDIDATES]]


def fit_link(predict: Predictor, measured: Sequence[tuple[Candidate, float]], *, overheads: bool = True
             ) -> LinkFit | None:
    """The fit of predict's compute slowdown, or of one factor on its rank-side costs, to measured (candidate,
    measured step ms) pairs, one per candidate, whichever comes closer (overheads=False: the slowdown alone); None
    with fewer than MIN_TRIALS of them. A fit that does not lower the error by MIN_GAIN is not kept."""
    pairs = [(c, ms) for c, ms in measured if ms > 0]
    if len(pairs) < MIN_TRIALS:
        return None
    given = predict.link.compute_slowdown
    errors: dict[tuple[float, float], float] = {}

    def error(slowdown: float, scale: float = 1.0) -> float:
        key = (round(slowdown, 4), round(scale, 4))
        if key not in errors:
            link = scaled_overheads(replace(predict.link, compute_slowdown=key[0]), key[1])
            fitted = replace(predict, link=link)
            errors[key] = statistics.fmean(abs(fitted(c).step_time_ms - ms) / ms for c, ms in pairs)
        return errors[key]

    def best_of(grid: Iterable[float], term: Callable[[float], float], origin: float) -> float:
        return min(grid, key=lambda x: (term(x), abs(x - origin)))

    def scale_error(x: float) -> float:
        return error(given, x)

    n_coarse = round((HIGHEST - LOWEST) / COARSE_STEP)
    best = best_of((round(LOWEST + k * COARSE_STEP, 4) for k in range(n_coarse + 1)), error, given)
    steps = round(COARSE_STEP / FINE_STEP / 2)
    best = best_of((s for s in (round(best + k * FINE_STEP, 4) for k in range(-steps, steps + 1))
                    if LOWEST <= s <= HIGHEST), error, given)
    scale = 1.0
    if overheads:
        scale = best_of(OVERHEAD_SCALES, scale_error, 1.0)
        half = round(OVERHEAD_SCALES[0] / OVERHEAD_FINE_STEP / 2)
        scale = best_of((x for x in (round(scale + k * OVERHEAD_FINE_STEP, 4) for k in range(-half, half + 1))
                         if OVERHEAD_SCALES[0] <= x <= OVERHEAD_SCALES[-1]), scale_error, 1.0)
    before = error(given)
    if before - error(best) < MIN_GAIN:
        best = given
    if before - error(given, scale) < MIN_GAIN or error(given, scale) >= error(best):
        scale = 1.0
    else:
        best = given
    return LinkFit(compute_slowdown=best, given_slowdown=given, overhead_scale=scale, trials=len(pairs),
                   error_before=before, error_after=error(best, scale),
                   link=scaled_overheads(replace(predict.link, compute_slowdown=best), scale))


def with_fit(predict: Predictor, fit: LinkFit | None) -> Predictor:
    """predict with the fitted link (itself without a fit, or where the fit kept the link's own slowdown)."""
    return replace(predict, link=fit.link) if fit is not None and fit.moved else predict


def fitted_predictor(predict: Predictor, records: Iterable[TrialRecord]) -> tuple[Predictor, LinkFit | None]:
    """predict with its compute slowdown or rank-side costs fitted to the records' runs (itself where they are too
    few, or no fit gains), and the fit: what load_search rebuilds from a stored study, as the search fitted it (the
    result carries the fit to the report), so the config's predicted block and the report agree."""
    fit = fit_link(predict, measured_steps(records))
    return with_fit(predict, fit), fit
