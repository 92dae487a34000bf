"""Would fitting the link's rank-side costs to a study's first runs predict the rest better? (Issue 24: "let the
search learn" the constants the simulator cannot know in advance.) One factor on LinkModel's per_action_overhead_ms,
message_overhead_ms and collective_wake_ms, chosen on a grid so that the predictions of k measured configurations come
closest to their measured step times (mean relative error), is tried on a calibration run's measurements
(bench/calibrate.py keeps each model's profile and every measured configuration): for k of them drawn at random, fit
on the k, compare the predictions of the others with the default link and with the fitted one (mean relative error,
Spearman), over --draws draws.

    python bench/link_fit.py --calibration bench/results/calibration.json bench/results/calibration_models.json

Nothing is measured here: it re-predicts the calibration's measurements, so it takes seconds. The search does not fit
(bench/results/link_fit.md says why: over six models the held-out error did not improve).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _results  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from collections.abc import Sequence  # noqa: E402
from dataclasses import dataclass, replace  # noqa: E402
from typing import Any  # noqa: E402

from autotune.candidate import Candidate  # noqa: E402
from autotune.costs import Profile  # noqa: E402
from autotune.simulate import LinkModel, Predictor  # noqa: E402

MIN_TRIALS = 5
"""Distinct measured candidates before a fit is tried: fewer pin nothing down."""
MAX_SCALE = 4.0
COARSE = tuple(i / 4 for i in range(int(MAX_SCALE * 4) + 1))
"""Factors tried first (0 to MAX_SCALE by 0.25); the best is refined by 0.05 around it."""
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


def mean_error(predict: Predictor, rows: list[tuple[Candidate, float]]) -> float:
    return statistics.fmean(abs(predict(c).step_time_ms - ms) / ms for c, ms in rows)


def spearman(a: list[float], b: list[float]) -> float:
    def ranks(xs: list[float]) -> list[int]:
        order = sorted(range(len(xs)), key=xs.__getitem__)
        out = [0] * len(xs)
        for rank, i in enumerate(order):
            out[i] = rank
        return out

    ra, rb, n = ranks(a), ranks(b), len(a)
    return 1 - 6 * sum((x - y) ** 2 for x, y in zip(ra, rb)) / (n * (n * n - 1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calibration", type=Path, nargs="+",
                        default=[ROOT / "bench" / "results" / "calibration.json"])
    parser.add_argument("--sizes", type=int, nargs="+", default=[MIN_TRIALS, 8, 12])
    parser.add_argument("--draws", type=int, default=20)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()

    rows_out, data = [], []
    sources = [(path, json.loads(path.read_text())) for path in args.calibration]
    for path, result in ((path, r) for path, saved in sources for r in saved["results"]):
        if not result.get("profile"):
            sys.exit(f"{path}: {result['recipe']} has no profile; rerun bench/calibrate.py")
        profile = Profile.from_dict(result["profile"])
        given = Predictor(profile=profile, link=LinkModel.for_device("cpu"))
        rows = [(Candidate.from_dict(r["candidate_dict"]), r["measured_ms"]) for r in result["rows"]
                if r.get("measured_ms")]
        hindsight = fit_link(given, rows)
        rng = random.Random(0)
        for k in args.sizes:
            draws = []
            for _ in range(args.draws):
                picked = rng.sample(range(len(rows)), k)
                train = [rows[i] for i in picked]
                test = [rows[i] for i in range(len(rows)) if i not in picked]
                fit = fit_link(given, train)
                fitted = Predictor(profile=profile, link=fit.link) if fit else given
                measured = [ms for _, ms in test]
                draws.append({"scale": fit.scale if fit else 1.0,
                              "error_given": mean_error(given, test), "error_fitted": mean_error(fitted, test),
                              "rho_given": spearman(measured, [given(c).step_time_ms for c, _ in test]),
                              "rho_fitted": spearman(measured, [fitted(c).step_time_ms for c, _ in test])})
            mean = {key: statistics.fmean(d[key] for d in draws) for key in draws[0]}
            scales = sorted(d["scale"] for d in draws)
            rows_out.append([result["recipe"], len(rows), k, f"{mean['error_given']:.1%}",
                             f"{mean['error_fitted']:.1%}", f"{mean['rho_given']:.3f}", f"{mean['rho_fitted']:.3f}",
                             f"{scales[0]:g} / {statistics.median(scales):g} / {scales[-1]:g}",
                             f"x{hindsight.scale:g}: {hindsight.error_before:.1%} -> {hindsight.error_after:.1%}"])
            data.append({"recipe": result["recipe"], "k": k, "draws": draws})
    header = ["recipe", "configs", "fitted on", "held-out error, default link", "fitted link", "Spearman, default",
              "fitted", "factor min / median / max", "fitted on all (hindsight)"]
    table = _results.markdown_table(header, rows_out)
    if args.no_write:
        print(table)
        return
    notes = ("From " + "; ".join(f"{p.name} ({saved.get('date', '?')}, `{saved.get('command', '?')}`)"
                                 for p, saved in sources) + f". Each row: {args.draws} random draws of k "
             "measured configurations, the factor fitted on them (kept only if it lowers their error by MIN_GAIN), the "
             "others predicted with and without it; means over the draws.")
    _results.write("link_fit", title="The link's rank-side costs fitted to a study's first runs",
                   device="cpu", tables={"held-out predictions": table}, data={"rows": data}, notes=notes)


if __name__ == "__main__":
    main()
