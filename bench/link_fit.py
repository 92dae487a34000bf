"""Does fitting the simulator to a study's first runs predict the rest better? (Issue 24: "let the search learn" the
constants the simulator cannot know in advance.) --fit search (the default) is the search's own fit
(autotune.link_fit): LinkModel.compute_slowdown chosen on a grid so that the predictions of k measured configurations
come closest to their measured step times (mean relative error), or one factor on per_action_overhead_ms,
message_overhead_ms and collective_wake_ms chosen the same way, whichever fits the k closer. --fit compute is the
slowdown alone (the search's fit until 2026-11-29), --fit overheads the factor alone. Each is tried on a calibration
run's measurements (bench/calibrate.py keeps each model's profile and every measured configuration): for k of them
drawn at random, fit on the k, compare the predictions of the others with the default link and with the fitted one
(mean relative error, Spearman), over --draws draws.

    python bench/link_fit.py --calibration bench/results/calibration.json bench/results/calibration_models.json
    python bench/link_fit.py --fit compute --name link_fit_compute --calibration ...
    python bench/link_fit.py --fit overheads --name link_fit_overheads --calibration ...

Nothing is measured here: it re-predicts the calibration's measurements, so it takes a minute or two.
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
from autotune.link_fit import fit_link, scaled_overheads  # noqa: E402
from autotune.simulate import LinkModel, Predictor  # noqa: E402

OVERHEAD_SCALES = tuple(i / 4 for i in range(17))
"""--fit overheads: the factors tried on the per-action, per-message and wake costs (0 to 4 by 0.25), refined by
0.05."""


@dataclass(frozen=True)
class CachedPredictor(Predictor):
    """A Predictor that remembers every (link, candidate) it simulated: the draws fit the same candidates over and
    over, and dataclasses.replace (how a fit swaps the link) keeps the class. One model at a time: _CACHE is
    cleared before the next (candidate keys repeat across models)."""

    def __call__(self, candidate: Candidate, *, with_timeline: bool = False) -> Any:
        key = (self.link, candidate.key, with_timeline)
        if key not in _CACHE:
            _CACHE[key] = super().__call__(candidate, with_timeline=with_timeline)
        return _CACHE[key]


_CACHE: dict[tuple, Any] = {}


@dataclass(frozen=True)
class Fit:
    value: float
    """--fit compute: the compute slowdown; overheads: the factor on the rank-side costs."""
    predict: Predictor


def fit_overheads(predict: Predictor, pairs: Sequence[tuple[Candidate, float]]) -> Fit:
    """The experiment of an earlier stop (commit 38858e2, taken out in 581aa78): one factor on the link's rank-side
    costs, kept where it lowers the mean relative error by 2 points."""
    def error(scale: float) -> float:
        fitted = replace(predict, link=scaled_overheads(predict.link, scale))
        return statistics.fmean(abs(fitted(c).step_time_ms - ms) / ms for c, ms in pairs)

    best = min(OVERHEAD_SCALES, key=lambda s: (error(s), abs(s - 1.0)))
    fine = [round(best + k * 0.05, 2) for k in range(-4, 5) if 0.0 <= best + k * 0.05 <= 4.0]
    best = min(fine, key=lambda s: (error(s), abs(s - 1.0)))
    if error(1.0) - error(best) < 0.02:
        best = 1.0
    return Fit(best, replace(predict, link=scaled_overheads(predict.link, best)))


def fit(kind: str, predict: Predictor, pairs: Sequence[tuple[Candidate, float]]) -> Fit:
    if kind == "overheads":
        return fit_overheads(predict, pairs)
    # search: the search's own fit (autotune.link_fit), the slowdown or the factor on the rank-side costs;
    # compute: the slowdown alone, as the search fitted before 2026-11-29
    found = fit_link(predict, pairs, overheads=kind == "search")
    assert found is not None, "fewer pairs than autotune.link_fit.MIN_TRIALS"
    return Fit(found.overhead_scale if kind == "search" else found.compute_slowdown, replace(predict, link=found.link))


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
    parser.add_argument("--sizes", type=int, nargs="+", default=[5, 8, 12])
    parser.add_argument("--fit", choices=["search", "compute", "overheads"], default="search",
                        help="search: the search's own fit (autotune.link_fit: the compute slowdown or one factor on "
                             "the per-action, per-message and wake costs, whichever fits the k closer; the table "
                             "shows the factor, 1 where the slowdown was kept); compute: the slowdown alone (the "
                             "search's fit before 2026-11-29); overheads: the factor alone")
    parser.add_argument("--draws", type=int, default=20)
    parser.add_argument("--no-write", action="store_true")
    parser.add_argument("--name", default="link_fit", help="results file name under bench/results")
    args = parser.parse_args()

    rows_out, data = [], []
    sources = [(path, json.loads(path.read_text())) for path in args.calibration]
    for path, result in ((path, r) for path, saved in sources for r in saved["results"]):
        if not result.get("profile"):
            sys.exit(f"{path}: {result['recipe']} has no profile; rerun bench/calibrate.py")
        profile = Profile.from_dict(result["profile"])
        _CACHE.clear()
        given = CachedPredictor(profile=profile, link=LinkModel.for_profile(profile))
        rows = [(Candidate.from_dict(r["candidate_dict"]), r["measured_ms"]) for r in result["rows"]
                if r.get("measured_ms")]
        hindsight = fit(args.fit, given, rows)
        measured_all = [ms for _, ms in rows]
        rng = random.Random(0)
        for k in args.sizes:
            draws = []
            for _ in range(args.draws):
                picked = rng.sample(range(len(rows)), k)
                train = [rows[i] for i in picked]
                test = [rows[i] for i in range(len(rows)) if i not in picked]
                found = fit(args.fit, given, train)
                fitted = found.predict
                measured = [ms for _, ms in test]
                draws.append({"value": found.value,
                              "error_given": mean_error(given, test), "error_fitted": mean_error(fitted, test),
                              "rho_given": spearman(measured, [given(c).step_time_ms for c, _ in test]),
                              "rho_fitted": spearman(measured, [fitted(c).step_time_ms for c, _ in test])})
            mean = {key: statistics.fmean(d[key] for d in draws) for key in draws[0]}
            values = sorted(d["value"] for d in draws)
            rows_out.append([result["recipe"], len(rows), k, f"{mean['error_given']:.1%}",
                             f"{mean['error_fitted']:.1%}", f"{mean['rho_given']:.3f}", f"{mean['rho_fitted']:.3f}",
                             f"{values[0]:g} / {statistics.median(values):g} / {values[-1]:g}",
                             f"{hindsight.value:g}: {mean_error(given, rows):.1%} -> "
                             f"{mean_error(hindsight.predict, rows):.1%}",
                             f"{spearman(measured_all, [given(c).step_time_ms for c, _ in rows]):.3f} -> "
                             f"{spearman(measured_all, [hindsight.predict(c).step_time_ms for c, _ in rows]):.3f}"])
            data.append({"recipe": result["recipe"], "fit": args.fit, "k": k, "draws": draws})
    what = {"compute": "compute slowdown", "overheads": "factor on the rank-side costs",
            "search": "factor on the rank-side costs (1: the slowdown fitted instead, or nothing)"}[args.fit]
    header = ["recipe", "configs", "fitted on", "held-out error, default link", "fitted link", "Spearman, default",
              "fitted", f"{what} min / median / max", "fitted on all (hindsight): value, error",
              "Spearman on all, default -> fitted"]
    table = _results.markdown_table(header, rows_out)
    if args.no_write:
        print(table)
        return
    notes = ("From " + "; ".join(f"{p.name} ({saved.get('date', '?')}, `{saved.get('command', '?')}`)"
                                 for p, saved in sources) + f". Each row: {args.draws} random draws of k "
             f"measured configurations, the {what} fitted on them (kept only if it lowers their error by 2 points), "
             "the others predicted with and without it; means over the draws.")
    title = {"compute": "The compute slowdown fitted to a study's first runs",
             "overheads": "The link's rank-side costs fitted to a study's first runs",
             "search": "The search's fit: the compute slowdown or the rank-side costs, whichever fits a study's "
                       "first runs closer"}[args.fit]
    _results.write(args.name, title=title,
                   device="cpu", tables={"held-out predictions": table}, data={"rows": data}, notes=notes)


if __name__ == "__main__":
    main()
