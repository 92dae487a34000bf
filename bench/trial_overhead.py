"""Trial overhead: a trial's wall time minus the time of its measured steps, and where it goes.

Two views: the `autotune trial` command as a user runs it (a fresh process: Python, torch import, model check, fork
server start), and a trial inside a search (the fork server is warm). Median of --repeats runs each.

    python bench/trial_overhead.py --repeats 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _results  # noqa: E402

from autotune.candidate import Candidate, uniform_split  # noqa: E402
from autotune.model_file import load_model_file  # noqa: E402
from autotune.schedules import Schedule  # noqa: E402
from autotune.trial import TrialOptions, run_trial  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PHASES = ("start", "setup", "warmup", "steps", "teardown")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--recipe", default="mlp")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    model = ROOT / "recipes" / f"{args.recipe}.py"
    cmd = [sys.executable, "-m", "autotune.cli", "trial", str(model), "--gpus", "2", "--device", args.device,
           "--batch-size", "32", "--microbatches", "4", "--schedule", "1F1B", "--json"]

    cold = []
    for _ in range(args.repeats):
        started = time.perf_counter()
        out = subprocess.run(cmd, capture_output=True, text=True, check=True)
        wall = time.perf_counter() - started
        data = json.loads(out.stdout)
        cold.append({"wall_s": wall, "trial_wall_s": data["wall_time_s"], **data["phases_s"]})

    spec = load_model_file(model)
    candidate = Candidate(schedule=Schedule.ONE_F_ONE_B, pipeline_degree=2, global_batch_size=32, n_microbatches=4,
                          layers_per_stage=uniform_split(spec.n_layers, 2))
    run_trial(spec, candidate, TrialOptions(steps=1, warmup=1, device=args.device))  # start the fork server
    warm = []
    for _ in range(args.repeats):
        m = run_trial(spec, candidate, TrialOptions(device=args.device))
        warm.append({"wall_s": m.wall_time_s, "trial_wall_s": m.wall_time_s, **m.phases_s})

    def med(runs: list[dict], key: str) -> float:
        return statistics.median(r.get(key, 0.0) for r in runs)

    rows = []
    for name, runs in (("`autotune trial` command (cold)", cold), ("trial inside a search (warm fork server)", warm)):
        overhead = med(runs, "wall_s") - med(runs, "steps")
        rows.append([name, med(runs, "wall_s"), med(runs, "steps"), overhead,
                     med(runs, "wall_s") - med(runs, "trial_wall_s"), *(med(runs, p) for p in PHASES if p != "steps"),
                     "met" if overhead <= 6 else "missed", "met" if overhead <= 1 else "missed"])
    header = ["view", "wall s", "measured steps s", "overhead s", "before launch s (CLI: python, torch, model check)",
              "rank start s", "setup s", "warm-up s", "teardown s", "target <= 6 s", "goal <= 1 s"]
    _results.write(
        "trial_overhead", title="Trial overhead", device=args.device,
        tables={f"median of {args.repeats} runs, recipes/{args.recipe}.py, 2 ranks, B=32, B/M=4, 1F1B, "
                "5 measured + 2 warm-up steps": _results.markdown_table(header, rows)},
        data={"cold": cold, "warm": warm},
        notes="Overhead = wall time - measured steps. Rank start: fork from the fork server until the rank runs "
              "(the first trial of a process pays the fork server's torch import here). Setup: process group, "
              "model build, stages. Warm-up: the unmeasured steps (the last one also measures memory, with a "
              "Python-level tracker on CPU).",
    )


if __name__ == "__main__":
    main()
