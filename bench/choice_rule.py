"""How a search's final choice rule fares against the side-by-side truth, over many searches of the same model.

1. Searches: autotune.tune with seeds 0..N-1 over the tuning bench's space (pp = gpus, dp = 1, no checkpointing,
   float32 between stages, --trials each), recording every run it launched: phase (seed, explore, remeasure, ...),
   candidate and median step time, in order.
2. Truth: the union of each search's choice, each search's three fastest candidates and (with --grid-json, a
   bench/tuning.py result) the grid's five fastest single runs, run in turn --rounds times (A B C A B C ...); medians.
3. Rules, each applied to every search's recorded runs (the runs do not depend on the rule: it only picks among
   them once the search is over), scored as truth's best / truth of the rule's pick:
   - all runs: the fastest median over every run of a candidate (autotune.records.leaders_of; autotune before
     2026-11-29);
   - re-run first: the same, among the leaders re-run side by side when two or more were (autotune.records.summarize,
     what autotune chooses now);
   - re-runs only: the fastest median of the side-by-side re-runs alone;
   - drift-corrected: log time = candidate + drift, the drift a running median (5 runs) of the residuals.

    python bench/choice_rule.py --model bench/models/skewed6.py --searches 8 --grid-json bench/results/tuning.json
    python bench/choice_rule.py --from-json bench/results/choice_rule.json   # re-score the recorded runs
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _results  # noqa: E402

from autotune.candidate import Candidate, Measurement  # noqa: E402
from autotune.records import TrialRecord, leaders_of, summarize  # noqa: E402
from autotune.schedules import Schedule  # noqa: E402

Run = tuple[str, str, float]
"""(phase, candidate key, median step ms) of one launched run, in run order."""


def medians(runs: list[Run], keep: Callable[[Run], bool] = lambda r: True) -> dict[str, float]:
    times: dict[str, list[float]] = {}
    for run in runs:
        if keep(run):
            times.setdefault(run[1], []).append(run[2])
    return {key: statistics.median(values) for key, values in times.items()}


def candidate_of(key: str, gpus: int, batch_size: int) -> Candidate:
    """A key of this bench's space (pp = gpus, dp = 1, no checkpointing, float32 wire): Schedule/mM/[a-b-...]."""
    schedule, m, split = key.split("/")
    return Candidate(schedule=Schedule(schedule), pipeline_degree=gpus, global_batch_size=batch_size,
                     n_microbatches=int(m[1:]), layers_per_stage=tuple(int(x) for x in split.strip("[]").split("-")))


def as_search(runs: list[Run], gpus: int, batch_size: int) -> tuple[list[TrialRecord], dict[str, list[Measurement]]]:
    """The recorded runs as autotune.records takes them: a record per run, the measurements by candidate key."""
    records, measured = [], {}
    for number, (phase, key, ms) in enumerate(runs):
        candidate = candidate_of(key, gpus, batch_size)
        records.append(TrialRecord(number=number, candidate=candidate, outcome="ok", reason="", step_time_ms=ms,
                                   phase=phase, launched=True))
        measured.setdefault(key, []).append(Measurement(candidate=candidate, status="ok", step_time_ms=ms))
    return records, measured


def all_runs(runs: list[Run], gpus: int, batch_size: int) -> str:
    return leaders_of(as_search(runs, gpus, batch_size)[1])[0].candidate.key


def rerun_first(runs: list[Run], gpus: int, batch_size: int) -> str:
    summary = summarize(*as_search(runs, gpus, batch_size))
    assert summary.best is not None
    return summary.best.candidate.key


def reruns_only(runs: list[Run], gpus: int, batch_size: int) -> str:
    m = medians(runs, lambda r: r[0] == "remeasure")
    return min(m, key=m.__getitem__) if len(m) >= 2 else all_runs(runs, gpus, batch_size)


def drift_corrected(runs: list[Run], gpus: int, batch_size: int, window: int = 2, rounds: int = 5) -> str:
    runs = [r for r in runs if r[0] != "default"]
    logs = [math.log(t) for _, _, t in runs]
    keys = [k for _, k, _ in runs]
    level = {k: statistics.median(lt for kk, lt in zip(keys, logs) if kk == k) for k in keys}
    for _ in range(rounds):
        residual = [lt - level[k] for k, lt in zip(keys, logs)]
        drift = [statistics.median(residual[max(0, i - window): i + window + 1]) for i in range(len(runs))]
        level = {k: statistics.median(lt - d for kk, lt, d in zip(keys, logs, drift) if kk == k) for k in keys}
    return min(level, key=level.__getitem__)


RULES: dict[str, Callable[[list[Run], int, int], str]] = {
    "all runs (before)": all_runs,
    "re-run first (autotune)": rerun_first,
    "re-runs only": reruns_only,
    "drift-corrected": drift_corrected,
}


def record(args: argparse.Namespace) -> dict:
    from autotune.model_file import load_model_file
    from autotune.trial import TrialOptions, run_trial
    from autotune.tune import TuneRequest, tune

    spec = load_model_file(args.model)
    options = TrialOptions(steps=5, warmup=2, device=args.device)
    searches, candidates = [], {}
    for seed in range(args.searches):
        outcome = tune(TuneRequest(
            model=Path(args.model), gpus=args.gpus, batch_size=args.batch_size, device=args.device,
            trials=args.trials, seed=seed, steps=options.steps, warmup=options.warmup,
            storage=f"sqlite:///{tempfile.mkdtemp()}/bench.db", study_name="bench", output=None, report_dir=None,
            layouts=((args.gpus, 1),), checkpointing=(False,), wire_dtypes=("float32",),
        ))
        result = outcome.result
        for r in result.records:
            if r.launched and r.candidate is not None:
                candidates[r.candidate.key] = r.candidate
        runs = [(r.phase, r.candidate.key, r.step_time_ms) for r in result.records
                if r.launched and r.outcome == "ok" and r.candidate is not None]
        searches.append({"seed": seed, "choice": result.best.candidate.key if result.best else None, "runs": runs})
        print(f"search {seed}: {searches[-1]['choice']}", flush=True)
    keys: set[str] = set()
    for s in searches:
        keys.add(s["choice"])
        m = medians(s["runs"])
        keys.update(sorted(m, key=m.__getitem__)[:3])
    if args.grid_json:
        grid = json.loads(Path(args.grid_json).read_text())["grid"]
        ok = sorted((g for g in grid if g["status"] == "ok"), key=lambda g: g["step_time_ms"])[:5]
        for g in ok:
            candidates.setdefault(g["candidate"], candidate_of(g["candidate"], args.gpus, args.batch_size))
            keys.add(g["candidate"])
    times: dict[str, list[float]] = {key: [] for key in sorted(k for k in keys if k in candidates)}
    for _ in range(args.rounds):
        for key in times:
            m = run_trial(spec, candidates[key], options)
            if m.status == "ok" and m.step_time_ms:
                times[key].append(m.step_time_ms)
    return {"model": args.model, "gpus": args.gpus, "batch_size": args.batch_size, "searches": searches,
            "times": times}


def truth_of(model: dict) -> dict[str, float]:
    return {k: statistics.median(v) for k, v in model["times"].items() if v}


def picks_of(model: dict) -> list[dict[str, str]]:
    """Per search, each rule's pick (runs recorded before the shape was stored were 2 GPUs, batch 64)."""
    shape = model.get("gpus", 2), model.get("batch_size", 64)
    return [{name: rule(s["runs"], *shape) for name, rule in RULES.items()} for s in model["searches"]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", action="append", help="model file (repeat for several)")
    parser.add_argument("--gpus", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--trials", type=int, default=12)
    parser.add_argument("--searches", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--grid-json", help="a bench/tuning.py result of the same model: its grid's fastest join")
    parser.add_argument("--from-json", help="re-score the runs recorded in a results file of this bench")
    parser.add_argument("--name", default="choice_rule")
    args = parser.parse_args()
    recorded = ""
    if args.from_json:
        loaded = json.loads(Path(args.from_json).read_text())
        models, recorded = loaded["models"], loaded.get("recorded", "")
    elif args.model:
        models = []
        for model in args.model:
            args.model = model
            models.append(record(args))
    else:
        parser.error("give --model or --from-json")

    rows, per_search = [], []
    totals = {name: [0, 0] for name in RULES}
    for model in models:
        truth, picks = truth_of(model), picks_of(model)
        best = min(truth, key=truth.__getitem__)
        for name in RULES:
            qualities = [truth[best] / truth[p[name]] if p[name] in truth else None for p in picks]
            met = sum(1 for q in qualities if q is not None and q >= 0.99)
            totals[name][0] += met
            totals[name][1] += len(qualities)
            rows.append([model["model"], name, f"{met} / {len(qualities)}",
                         min((q for q in qualities if q is not None), default=None)])
        for s, p in zip(model["searches"], picks):
            per_search.append([model["model"], s["seed"], p["all runs (before)"], p["re-run first (autotune)"],
                               " ".join(f"{run[1]} {run[2]:.1f}" for run in s["runs"] if run[0] == "remeasure")])
        rows.append([model["model"], "truth's best", best, truth[best]])
    rows += [["all models", name, f"{met} / {n}", None] for name, (met, n) in totals.items()]
    _results.write(
        args.name,
        title="The search's choice rule against the side-by-side truth",
        device=args.device,
        tables={
            "searches within 1 % of the truth's best, per rule (worst quality)": _results.markdown_table(
                ["model", "rule", "within 1 %", "worst"], rows),
            "each search": _results.markdown_table(
                ["model", "seed", "all runs (before)", "re-run first (autotune)", "its side-by-side re-runs (ms)"],
                per_search),
            "truth (medians of the rounds, ms)": _results.markdown_table(
                ["model", "candidate", "median ms", "runs"],
                [[m["model"], k, statistics.median(v), " ".join(f"{x:.2f}" for x in v)]
                 for m in models for k, v in sorted(m["times"].items(), key=lambda kv: statistics.median(kv[1]))]),
        },
        data={"models": models, "totals": totals, "recorded": recorded},
        notes=recorded,
    )


if __name__ == "__main__":
    main()
