"""Does fitting the link's rank-side costs to a study's first runs (autotune.link_fit) predict the rest better?
Read from a calibration run's measurements (bench/calibrate.py keeps each recipe's profile and every measured
configuration): for k of them drawn at random, fit on the k, compare the predictions of the others with the default
link and with the fitted one (mean relative error, Spearman), over --draws draws.

    python bench/link_fit.py --calibration bench/results/calibration.json

Nothing is measured here: it re-predicts the calibration's measurements, so it takes seconds.
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

from autotune.candidate import Candidate  # noqa: E402
from autotune.costs import Profile  # noqa: E402
from autotune.link_fit import MIN_TRIALS, fit_link  # noqa: E402
from autotune.simulate import LinkModel, Predictor  # noqa: E402


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
    parser.add_argument("--calibration", type=Path, default=ROOT / "bench" / "results" / "calibration.json")
    parser.add_argument("--sizes", type=int, nargs="+", default=[MIN_TRIALS, 8, 12])
    parser.add_argument("--draws", type=int, default=20)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()

    saved = json.loads(args.calibration.read_text())
    rows_out, data = [], []
    for result in saved["results"]:
        if not result.get("profile"):
            sys.exit(f"{args.calibration}: {result['recipe']} has no profile; rerun bench/calibrate.py")
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
    notes = (f"From {args.calibration.relative_to(ROOT) if args.calibration.is_relative_to(ROOT) else args.calibration}"
             f" ({saved.get('date', '?')}, {saved.get('command', '?')}). Each row: {args.draws} random draws of k "
             "measured configurations, the factor fitted on them (autotune.link_fit: MIN_TRIALS "
             f"{MIN_TRIALS}), the others predicted with and without it; means over the draws.")
    _results.write("link_fit", title="The link's rank-side costs fitted to a study's first runs",
                   device="cpu", tables={"held-out predictions": table}, data={"rows": data}, notes=notes)


if __name__ == "__main__":
    main()
