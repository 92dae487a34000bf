"""Pure: the simulator's compute slowdown fitted to a study's own measurements.

The profile times each block alone, one process on the machine; inside a trial the same blocks run beside the other
ranks' processes, with micro-batches taking turns and activations piling up, and run slower (or, where the profile's
lone process paid for something the trial does not, faster) by an amount that depends on the model and the machine:
LinkModel.compute_slowdown, set once on the development machine (bench/results/action_trace_*.md: 1.12 x the
profile's compute on the CPU stand-in, over six models, but 0.95-1.0 x for a 2-block GPT). Once a study has measured
a few candidates, the slowdown is fitted to them: the one whose predicted step times come closest to the measured
ones (mean relative error), searched on a grid and refined around its best. The wire (bandwidth, latency, a probe's
inter-node figures) and the per-action and per-message costs are left as they are: fitted too, they made held-out
predictions worse (bench/results/link_fit.md), and one term is what a handful of trials can pin down without fitting
their noise.
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


@dataclass(frozen=True, kw_only=True)
class LinkFit:
    """The compute slowdown that fits a study's measurements, and what it did to the predictions' error."""

    compute_slowdown: float
    """The fitted LinkModel.compute_slowdown (given_slowdown where no slowdown gained MIN_GAIN)."""
    given_slowdown: float
    """The link's own, before the fit."""
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
        return self.compute_slowdown != self.given_slowdown

    def to_dict(self) -> dict[str, Any]:
        return {"compute_slowdown": self.compute_slowdown, "given_slowdown": self.given_slowdown,
                "trials": self.trials, "error_before": self.error_before, "error_after": self.error_after}


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


def fit_link(predict: Predictor, measured: Sequence[tuple[Candidate, float]]) -> LinkFit | None:
    """The fit of predict's compute slowdown to measured (candidate, measured step ms) pairs, one per candidate;
    None with fewer than MIN_TRIALS of them. A slowdown that does not lower the error by MIN_GAIN is not kept."""
    pairs = [(c, ms) for c, ms in measured if ms > 0]
    if len(pairs) < MIN_TRIALS:
        return None
    given = predict.link.compute_slowdown
    errors: dict[float, float] = {}

    def error(slowdown: float) -> float:
        slowdown = round(slowdown, 4)
        if slowdown not in errors:
            fitted = replace(predict, link=replace(predict.link, compute_slowdown=slowdown))
            errors[slowdown] = statistics.fmean(abs(fitted(c).step_time_ms - ms) / ms for c, ms in pairs)
        return errors[slowdown]

    def best_of(grid: Iterable[float]) -> float:
        return min(grid, key=lambda s: (error(s), abs(s - given)))

    n_coarse = round((HIGHEST - LOWEST) / COARSE_STEP)
    best = best_of(round(LOWEST + k * COARSE_STEP, 4) for k in range(n_coarse + 1))
    steps = round(COARSE_STEP / FINE_STEP / 2)
    best = best_of(s for s in (round(best + k * FINE_STEP, 4) for k in range(-steps, steps + 1))
                   if LOWEST <= s <= HIGHEST)
    before = error(given)
    if before - error(best) < MIN_GAIN:
        best = given
    return LinkFit(compute_slowdown=best, given_slowdown=given, trials=len(pairs), error_before=before,
                   error_after=error(best), link=replace(predict.link, compute_slowdown=best))


def with_fit(predict: Predictor, fit: LinkFit | None) -> Predictor:
    """predict with the fitted link (itself without a fit, or where the fit kept the link's own slowdown)."""
    return replace(predict, link=fit.link) if fit is not None and fit.moved else predict


def fitted_predictor(predict: Predictor, records: Iterable[TrialRecord]) -> tuple[Predictor, LinkFit | None]:
    """predict with its compute slowdown fitted to the records' runs (itself where they are too few, or no slowdown
    gains), and the fit: what load_search rebuilds from a stored study, as the search fitted it (the result carries
    the fit to the report), so the config's predicted block and the report agree."""
    fit = fit_link(predict, measured_steps(records))
    return with_fit(predict, fit), fit
