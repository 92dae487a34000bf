"""The profile's side of a calibration's errors, over the saved calibrations: nothing is measured.

A calibration with --profiles N profiles each model in N fresh processes minutes apart and predicts from their merge
(calibrate.median_profile). Per model run this bench predicts every measured configuration again (the simulator as
it is now):
- from each profile alone, and reports how far those predictions lie from each other (calibrate.profile_floor: the
  mean over pairs of profiles of one's predictions' MAPE against the other's) and from the measurements;
- from the merge with its host probe as the median of the profiles' and as the lowest (the merge's rule since
  2026-12-07), the step-time MAPE and whether the goal was met each way.

    python bench/profile_floor.py                      # every bench/results/calibration*.json with several profiles
    python bench/profile_floor.py bench/results/calibration_2245.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import _results  # noqa: E402
import calibrate  # noqa: E402

from autotune.costs import Profile  # noqa: E402


def model_runs(path: Path) -> list[dict]:
    """The model runs of a saved calibration that kept several profiles, each with a probe (none of one predicted
    again from another's measurements, --from-json: those are the other's runs)."""
    whole = json.loads(path.read_text())
    if "measured_by" in whole:
        return []
    return [r for r in whole.get("results", [])
            if len(r.get("profiles_taken") or []) > 1 and all("host_call_ms" in p for p in r["profiles_taken"])]


def judged(run: dict, profile: Profile) -> dict:
    result = calibrate.predicted(run["recipe"], run["batch_size"], profile, [dict(x) for x in run["rows"]],
                                 run["pass_to_pass_spearman"], run["wall_s"], run.get("profiles"))
    families = calibrate.step_error_by_schedule(result["rows"])
    return {"mape": result["mape"], "met": not calibrate.step_time_misses(result, families)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("calibrations", nargs="*", type=Path,
                        default=sorted(_results.RESULTS.glob("calibration*.json")))
    parser.add_argument("--name", default="profile_floor", help="results file name under bench/results/")
    args = parser.parse_args()
    rows, data = [], []
    for path in args.calibrations:
        for run in model_runs(path):
            taken = run["profiles_taken"]
            floor = calibrate.profile_floor(run["rows"], taken)
            merged = calibrate.median_profile(taken)
            probes = [p["host_call_ms"] for p in taken]
            median = judged(run, Profile.from_dict({**merged, "host_call_ms": statistics.median_low(probes)}))
            lowest = judged(run, Profile.from_dict(merged))
            entry = {"calibration": path.stem, "model": run["recipe"], "probes_us": [p * 1e3 for p in probes],
                     "profile_floor": floor, "median_probe": median, "lowest_probe": lowest}
            data.append(entry)
            rows.append([path.stem, Path(run["recipe"]).stem, " / ".join(f"{p * 1e3:.0f}" for p in probes),
                         f"{floor['between']:.1%}", " / ".join(f"{m:.0%}" for m in floor["each_mape"]),
                         f"{median['mape']:.1%}{' met' if median['met'] else ''}",
                         f"{lowest['mape']:.1%}{' met' if lowest['met'] else ''}"])
    if not data:
        raise SystemExit("no saved calibration with several profiles among those given: run bench/calibrate.py "
                         "with --profiles 2 or more first")
    summary = [[how, len(data), f"{statistics.fmean(e[how]['mape'] for e in data):.2%}",
                sum(e[how]["met"] for e in data)] for how in ("median_probe", "lowest_probe")]
    floors = [e["profile_floor"]["between"] for e in data]
    summary_floor = [[len(floors), f"{min(floors):.1%}", f"{statistics.median(floors):.1%}", f"{max(floors):.1%}",
                      sum(f > calibrate.MAPE_GOAL / 2 for f in floors)]]
    tables = {
        "the merge's host probe: the profiles' median against their lowest (step-time MAPE, goal met)":
            _results.markdown_table(["probe", "model runs", "mean MAPE", "goal met"], summary),
        "the profiles against each other (mean over pairs of one's predictions' MAPE against the other's)":
            _results.markdown_table(["model runs", "least", "median", "most",
                                     f"over half the MAPE goal ({calibrate.MAPE_GOAL / 2:.0%})"], summary_floor),
        "every model run": _results.markdown_table(
            ["calibration", "model", "probes us", "profiles against each other", "each profile's own MAPE",
             "merge, median probe", "merge, lowest probe"], rows),
    }
    _results.show(tables)
    _results.write(args.name, title="The profile's side of the calibrations' errors (saved runs, predicted again)",
                   device="cpu", tables=tables, data={"runs": data})


if __name__ == "__main__":
    main()
