"""Simulator fidelity: predicted vs measured step time and peak memory over a grid of real trials per recipe.

For each recipe: profile, plan every candidate (no pruning), pick --configs spread over schedules, B/M and splits,
run each as a real trial (2 ranks), --passes times interleaved (medians), and compare with the simulator.

    python bench/calibrate.py --recipes mlp gpt cnn --configs 24 --passes 2
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _results  # noqa: E402

from autotune.model_file import check_model, load_model_file  # noqa: E402
from autotune.plan import plan  # noqa: E402
from autotune.profiling import profile_model  # noqa: E402
from autotune.simulate import LinkModel, simulate  # noqa: E402
from autotune.trial import TrialOptions, run_trial  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def spearman(xs: list[float], ys: list[float]) -> float:
    def ranks(values: list[float]) -> list[float]:
        order = sorted(range(len(values)), key=values.__getitem__)
        result = [0.0] * len(values)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
                j += 1
            for k in range(i, j + 1):
                result[order[k]] = (i + j) / 2
            i = j + 1
        return result

    rx, ry = ranks(xs), ranks(ys)
    mx, my = statistics.fmean(rx), statistics.fmean(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    return cov / (sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry)) ** 0.5


def pick(planned: list, n: int) -> list:
    """n candidates spread over the ranking, every schedule represented, no repeats."""
    by_schedule: dict = {}
    for p in planned:
        by_schedule.setdefault(p.candidate.schedule, []).append(p)
    chosen: dict = {}
    for entries in by_schedule.values():  # the best and a middling one of each schedule
        for p in (entries[0], entries[len(entries) // 2]):
            chosen.setdefault(p.candidate.key, p)
    stride = max(1, len(planned) // n)
    for p in planned[::stride]:
        if len(chosen) >= n:
            break
        chosen.setdefault(p.candidate.key, p)
    return list(chosen.values())[:n]


def calibrate(recipe: str, *, batch_size: int, n_configs: int, passes: int, device: str) -> dict:
    spec = load_model_file(ROOT / "recipes" / f"{recipe}.py")
    check_model(spec, batch_size)
    profile = profile_model(spec, batch_size=batch_size, device=device)
    planned = plan(profile, gpus=2, batch_size=batch_size, memory_limit_bytes=None, prune_within=None)
    planned = [p for p in planned if p.candidate.data_parallel_degree == 1 and p.candidate.n_microbatches <= 64]
    configs = pick(planned, n_configs)
    options = TrialOptions(steps=5, warmup=2, device=device)
    measured: dict[str, list] = {p.candidate.key: [] for p in configs}
    started = time.time()
    for _ in range(passes):
        for p in configs:
            m = run_trial(spec, p.candidate, options)
            if m.status == "ok":
                measured[p.candidate.key].append(m)
    rows = []
    for p in configs:
        runs = measured[p.candidate.key]
        if not runs:
            continue
        step = statistics.median(m.step_time_ms for m in runs)
        est = simulate(profile, p.candidate, with_timeline=False)
        peak_meas = max(max(m.peak_memory_bytes) for m in runs)
        rows.append({"candidate": p.candidate.key, "measured_ms": step,
                     "runs_ms": [m.step_time_ms for m in runs], "predicted_ms": est.step_time_ms,
                     "error": (est.step_time_ms - step) / step, "measured_peak": peak_meas,
                     "predicted_peak": max(est.peak_memory_bytes),
                     "peak_error": (max(est.peak_memory_bytes) - peak_meas) / peak_meas})
    # How far the measurements agree with themselves: the ranking of one pass against another's, averaged over pairs.
    # The simulator's Spearman is judged against this ceiling.
    complete = [p.candidate.key for p in configs if len(measured[p.candidate.key]) == passes]
    pairs = list(itertools.combinations(range(passes), 2))
    retest = statistics.fmean(
        spearman([measured[k][i].step_time_ms for k in complete], [measured[k][j].step_time_ms for k in complete])
        for i, j in pairs
    ) if pairs and len(complete) > 2 else float("nan")
    mape = statistics.fmean(abs(r["error"]) for r in rows)
    rho = spearman([r["measured_ms"] for r in rows], [r["predicted_ms"] for r in rows])
    peak_err = statistics.fmean(abs(r["peak_error"]) for r in rows)
    return {"recipe": recipe, "batch_size": batch_size, "configs": len(rows), "mape": mape, "spearman": rho,
            "pass_to_pass_spearman": retest,
            "peak_memory_mape": peak_err, "wall_s": time.time() - started, "rows": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipes", nargs="+", default=["mlp", "gpt", "cnn"])
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--configs", type=int, default=24)
    parser.add_argument("--passes", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    results = [calibrate(r, batch_size=args.batch_size, n_configs=args.configs, passes=args.passes,
                         device=args.device) for r in args.recipes]
    summary = [[r["recipe"], r["configs"], r["mape"], r["spearman"], r["pass_to_pass_spearman"], r["peak_memory_mape"],
                "met" if r["mape"] <= 0.2 and r["spearman"] >= 0.8 else "missed",
                "met" if r["mape"] <= 0.1 and r["spearman"] >= 0.9 else "missed"] for r in results]
    tables = {"summary (2 ranks)": _results.markdown_table(
        ["recipe", "configs", "step-time MAPE", "Spearman", "pass-to-pass Spearman", "peak-memory MAPE",
         "target 20 % / 0.8", "goal 10 % / 0.9"],
        summary)}
    for r in results:
        tables[f"{r['recipe']}: every configuration"] = _results.markdown_table(
            ["candidate", "measured ms", "predicted ms", "error", "measured peak B", "predicted peak B"],
            [[x["candidate"], x["measured_ms"], x["predicted_ms"], f"{x['error']:+.0%}", x["measured_peak"],
              x["predicted_peak"]] for x in r["rows"]])
    link = dataclasses.asdict(LinkModel.for_device(args.device))
    tables["link model (the simulator's defaults for this device)"] = _results.markdown_table(
        ["field", "value"], [[k, v] for k, v in link.items()])
    _results.write("calibration", title="Simulator calibration: predicted vs measured", device=args.device,
                   tables=tables, data={"results": results, "link": link})


if __name__ == "__main__":
    main()
