"""Simulator fidelity: predicted vs measured step time and peak memory over a grid of real trials per recipe.

For each recipe: profile, plan every candidate (no pruning), pick --configs spread over schedules, B/M and splits,
run each as a real trial (2 ranks), --passes times interleaved (medians), and compare with the simulator.

    python bench/calibrate.py --recipes mlp gpt cnn --configs 24 --passes 2

--memory-only: peak memory alone (deterministic on the CPU stand-in: its tracker counts live tensor bytes), one
pass of one step per configuration, step times not reported; --models adds model files (bench/models/*.py) to the
recipes. Exits 1 when any configuration's predicted peak is off by more than --peak-tolerance (default 5 %).
--data-parallel calibrates pp 1 x dp 2 instead (both ranks one replica each, DistributedDataParallel or FSDP2):
what the pipeline candidates leave out, the data-parallel collectives.
The step-time run exits 1 when a model misses issue 24's goals (MAPE <= 10 %, every schedule family <= 15 %,
Spearman at or above the measurements' own pass-to-pass Spearman), after writing its results with a per-schedule
table. --from-json FILE predicts a saved run's measurements again with the simulator as it is now (nothing is run).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _results  # noqa: E402

from autotune.candidate import Candidate  # noqa: E402
from autotune.costs import Profile  # noqa: E402
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


def pick(planned: list, n: int, *, data_parallel: bool = False) -> list:
    """n candidates spread over the ranking, no repeats: the best and a middling one of each schedule (data_parallel:
    of each way of holding the replicas, replicate or shard, and its slowest too), then the ranking at a stride."""
    groups: dict = {}
    for p in planned:
        c = p.candidate
        key = (c.data_parallel_mode, c.reshard_after_forward) if data_parallel else c.schedule
        groups.setdefault(key, []).append(p)
    chosen: dict = {}
    for entries in groups.values():
        ends = [entries[0], entries[len(entries) // 2]] + ([entries[-1]] if data_parallel else [])
        for p in ends:
            chosen.setdefault(p.candidate.key, p)
    stride = max(1, len(planned) // n)
    for p in planned[::stride]:
        if len(chosen) >= n:
            break
        chosen.setdefault(p.candidate.key, p)
    return list(chosen.values())[:n]


def calibrate(recipe: str, *, batch_size: int, n_configs: int, passes: int, device: str,
              memory_only: bool = False, data_parallel: bool = False, precision: str = "fp32",
              checkpointed: bool = False) -> dict:
    path = Path(recipe) if recipe.endswith(".py") else ROOT / "recipes" / f"{recipe}.py"
    spec = load_model_file(path)
    check_model(spec, batch_size)
    profile = profile_model(spec, batch_size=batch_size, device=device, precision=precision)
    planned = plan(profile, gpus=2, batch_size=batch_size, memory_limit_bytes=None, prune_within=None)
    dp = 2 if data_parallel else 1
    planned = [p for p in planned if p.candidate.data_parallel_degree == dp and p.candidate.n_microbatches <= 64]
    configs = [p.candidate for p in pick(planned, n_configs, data_parallel=data_parallel)]
    if checkpointed:  # the planner checkpoints only its fastest few: the same spread, each checkpointed
        configs = list({c.key: c for c in (dataclasses.replace(c, activation_checkpointing=True)
                                           for c in configs)}.values())
    options = TrialOptions(steps=1 if memory_only else 5, warmup=2, device=device)
    measured: dict[str, list] = {c.key: [] for c in configs}
    started = time.time()
    for _ in range(passes):
        for c in configs:
            m = run_trial(spec, c, options)
            if m.status == "ok":
                measured[c.key].append(m)
    rows = []
    for c in configs:
        runs = measured[c.key]
        if not runs:
            continue
        rows.append({"candidate": c.key, "candidate_dict": c.to_dict(),
                     "measured_ms": statistics.median(m.step_time_ms for m in runs),
                     "runs_ms": [m.step_time_ms for m in runs],
                     "measured_peak": max(max(m.peak_memory_bytes) for m in runs)})
    # How far the measurements agree with themselves: the ranking of one pass against another's, averaged over pairs.
    # The simulator's Spearman is judged against this ceiling.
    complete = [c.key for c in configs if len(measured[c.key]) == passes]
    pairs = list(itertools.combinations(range(passes), 2))
    retest = statistics.fmean(
        spearman([measured[k][i].step_time_ms for k in complete], [measured[k][j].step_time_ms for k in complete])
        for i, j in pairs
    ) if pairs and len(complete) > 2 else float("nan")
    return predicted(recipe, batch_size, profile, rows, retest, time.time() - started)


def predicted(recipe: str, batch_size: int, profile: Profile, rows: list[dict], retest: float, wall_s: float) -> dict:
    """A model's calibration result: its measured rows predicted by the simulator as it is now, and their errors."""
    for r in rows:
        est = simulate(profile, Candidate.from_dict(r["candidate_dict"]), with_timeline=False)
        peak = max(est.peak_memory_bytes)
        r.update(predicted_ms=est.step_time_ms, error=(est.step_time_ms - r["measured_ms"]) / r["measured_ms"],
                 predicted_peak=peak, peak_error=(peak - r["measured_peak"]) / r["measured_peak"])
    mape = statistics.fmean(abs(r["error"]) for r in rows)
    rho = spearman([r["measured_ms"] for r in rows], [r["predicted_ms"] for r in rows])
    peak_err = statistics.fmean(abs(r["peak_error"]) for r in rows)
    by_schedule: dict[str, list[float]] = {}
    for r in rows:
        by_schedule.setdefault(r["candidate"].split("/")[0], []).append(r["peak_error"])
    return {"recipe": recipe, "batch_size": batch_size,
            "peak_error_by_schedule": {k: [min(v), max(v)] for k, v in by_schedule.items()},
            "profile": profile.to_dict(), "configs": len(rows), "mape": mape, "spearman": rho,
            "pass_to_pass_spearman": retest,
            "peak_memory_mape": peak_err, "wall_s": wall_s, "rows": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipes", nargs="*", default=["mlp", "gpt", "cnn"], help="none: only --models")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--configs", type=int, default=24)
    parser.add_argument("--passes", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--models", nargs="*", default=[], help="model files to calibrate besides the recipes")
    parser.add_argument("--memory-only", action="store_true", help="peak memory only: one pass of one step")
    parser.add_argument("--data-parallel", action="store_true",
                        help="pp 1 x dp 2 candidates (replicate and FSDP2 shard) instead of pipelines")
    parser.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    parser.add_argument("--checkpointed", action="store_true",
                        help="run each picked configuration with activation checkpointing (the planner's own "
                             "checkpointed ones are only its fastest few)")
    parser.add_argument("--peak-tolerance", type=float, default=0.05)
    parser.add_argument("--name", default="calibration", help="results file name under bench/results/")
    parser.add_argument("--from-json", type=Path,
                        help="predict a saved calibration's measurements again with the simulator as it is now "
                             "(nothing measured); write under --name")
    args = parser.parse_args()
    if args.memory_only:
        args.passes = 1
    if args.from_json:
        saved = json.loads(args.from_json.read_text())["results"]
        results = [predicted(r["recipe"], r["batch_size"], Profile.from_dict(r["profile"]), r["rows"],
                             r["pass_to_pass_spearman"], r["wall_s"]) for r in saved]
    else:
        results = [calibrate(r, batch_size=args.batch_size, n_configs=args.configs, passes=args.passes,
                             device=args.device, memory_only=args.memory_only, data_parallel=args.data_parallel,
                             precision=args.precision, checkpointed=args.checkpointed)
                   for r in [*args.recipes, *args.models]]
    if args.memory_only:
        memory_only_report(results, args)
        return
    families = {r["recipe"]: step_error_by_schedule(r["rows"]) for r in results}
    misses = {r["recipe"]: step_time_misses(r, families[r["recipe"]]) for r in results}
    summary = [[r["recipe"], r["configs"], r["mape"], r["spearman"], r["pass_to_pass_spearman"], r["peak_memory_mape"],
                max(families[r["recipe"]].values()), "met" if not misses[r["recipe"]] else "missed"] for r in results]
    tables = {"summary (2 ranks)": _results.markdown_table(
        ["recipe", "configs", "step-time MAPE", "Spearman", "pass-to-pass Spearman", "peak-memory MAPE",
         "worst family's MAPE",
         f"MAPE <= {MAPE_GOAL:.0%}, every family <= {FAMILY_GOAL:.0%}, Spearman >= pass-to-pass"],
        summary)}
    schedules = sorted({k for f in families.values() for k in f})
    tables["step-time MAPE by schedule"] = _results.markdown_table(
        ["recipe", *schedules],
        [[name, *(f"{f[k]:.0%}" if k in f else "" for k in schedules)] for name, f in families.items()])
    for r in results:
        tables[f"{r['recipe']}: every configuration"] = _results.markdown_table(
            ["candidate", "measured ms", "predicted ms", "error", "measured peak B", "predicted peak B"],
            [[x["candidate"], x["measured_ms"], x["predicted_ms"], f"{x['error']:+.0%}", x["measured_peak"],
              x["predicted_peak"]] for x in r["rows"]])
    link = dataclasses.asdict(LinkModel.for_device(args.device))
    tables["link model (the simulator's defaults for this device)"] = _results.markdown_table(
        ["field", "value"], [[k, v] for k, v in link.items()])
    _results.write(args.name, title="Simulator calibration: predicted vs measured", device=args.device,
                   tables=tables, data={"results": results, "link": link})
    missed = [(name, why) for name, whys in misses.items() for why in whys]
    if missed:
        print(f"{len(missed)} step-time goal(s) missed:", file=sys.stderr)
        for name, why in missed:
            print(f"  {name}: {why}", file=sys.stderr)
        raise SystemExit(1)


MAPE_GOAL = 0.10
FAMILY_GOAL = 0.15
"""Issue 24's step-time goals: a model's MAPE, and each schedule family's."""


def step_error_by_schedule(rows: list[dict]) -> dict[str, float]:
    """Mean |relative step-time error| per schedule family."""
    by_schedule: dict[str, list[float]] = {}
    for x in rows:
        by_schedule.setdefault(x["candidate"].split("/")[0], []).append(abs(x["error"]))
    return {k: statistics.fmean(v) for k, v in sorted(by_schedule.items())}


def step_time_misses(result: dict, families: dict[str, float]) -> list[str]:
    """What of the step-time goals a model missed, one line each (empty: all met)."""
    whys = []
    if result["mape"] > MAPE_GOAL:
        whys.append(f"step-time MAPE {result['mape']:.1%} > {MAPE_GOAL:.0%}")
    whys += [f"{k} {v:.0%} > {FAMILY_GOAL:.0%}" for k, v in families.items() if v > FAMILY_GOAL]
    retest = result.get("pass_to_pass_spearman")
    if retest is not None and result["spearman"] < retest:
        whys.append(f"Spearman {result['spearman']:.2f} below the measurements' own {retest:.2f}")
    return whys


def memory_only_report(results: list[dict], args: argparse.Namespace) -> None:
    tolerance = args.peak_tolerance
    missed = [(r["recipe"], x["candidate"], x["peak_error"]) for r in results for x in r["rows"]
              if abs(x["peak_error"]) > tolerance]
    summary = [[r["recipe"], r["configs"], r["peak_memory_mape"], min(x["peak_error"] for x in r["rows"]),
                max(x["peak_error"] for x in r["rows"]),
                "met" if all(abs(x["peak_error"]) <= tolerance for x in r["rows"]) else "missed"] for r in results]
    tables = {"summary (2 ranks, peak memory only)": _results.markdown_table(
        ["model", "configs", "peak-memory MAPE", "worst under", "worst over", f"every config within {tolerance:.0%}"],
        summary)}
    schedules = sorted({k for r in results for k in r["peak_error_by_schedule"]})
    tables["peak error by schedule (min .. max over configurations)"] = _results.markdown_table(
        ["model", *schedules],
        [[r["recipe"], *(("{:+.1%} .. {:+.1%}".format(*r["peak_error_by_schedule"][k])
                          if k in r["peak_error_by_schedule"] else "") for k in schedules)] for r in results])
    for r in results:
        tables[f"{r['recipe']}: every configuration"] = _results.markdown_table(
            ["candidate", "measured peak B", "predicted peak B", "error"],
            [[x["candidate"], x["measured_peak"], x["predicted_peak"], f"{x['peak_error']:+.1%}"] for x in r["rows"]])
    _results.write(args.name, title="Simulator calibration: predicted vs measured peak memory", device=args.device,
                   tables=tables, data={"results": results})
    if missed:
        print(f"{len(missed)} configuration(s) off by more than {tolerance:.0%}:", file=sys.stderr)
        for model, key, err in missed:
            print(f"  {model} {key}: {err:+.1%}", file=sys.stderr)
        raise SystemExit(1)


if __name__ == "__main__":
    main()
