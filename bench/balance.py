"""Balanced vs uniform split: the planner's split against the uniform one at the same schedule and B/M, measured
side by side (alternating, medians) on models whose layer costs spread ~10x or more.

    python bench/balance.py --rounds 5
"""

from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _results  # noqa: E402

from autotune.candidate import uniform_split  # noqa: E402
from autotune.model_file import check_model, load_model_file  # noqa: E402
from autotune.plan import plan  # noqa: E402
from autotune.profiling import profile_model  # noqa: E402
from autotune.schedules import Schedule  # noqa: E402
from autotune.trial import TrialOptions, run_trial  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CASES = [("recipes/mlp.py", 256), ("bench/models/skewed6.py", 64)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    options = TrialOptions(steps=5, warmup=2, device=args.device)
    rows, data = [], []
    for model, batch in CASES:
        spec = load_model_file(ROOT / model)
        check_model(spec, batch)
        profile = profile_model(spec, batch_size=batch, device=args.device)
        planned = plan(profile, gpus=2, batch_size=batch, memory_limit_bytes=None, prune_within=None,
                       layouts=[(2, 1)])
        costs = [c.forward_ms + c.backward_ms for c in profile.layer_costs(batch)]
        spread = max(costs) / min(costs)
        for schedule in (Schedule.ONE_F_ONE_B, Schedule.GPIPE):
            for m in (4, 8):
                balanced = next(p.candidate for p in planned if p.candidate.schedule is schedule
                                and p.candidate.n_microbatches == m and not p.candidate.activation_checkpointing
                                and p.candidate.layers_per_stage != uniform_split(spec.n_layers, 2))
                uniform = replace(balanced, layers_per_stage=uniform_split(spec.n_layers, 2))
                times: dict[str, list[float]] = {"balanced": [], "uniform": []}
                for _ in range(args.rounds):
                    for name, c in (("balanced", balanced), ("uniform", uniform)):
                        measured = run_trial(spec, c, options)
                        if measured.status == "ok":
                            times[name].append(measured.step_time_ms)
                b, u = statistics.median(times["balanced"]), statistics.median(times["uniform"])
                rows.append([model, f"{spread:.0f}x", schedule.value, m, list(balanced.layers_per_stage),
                             list(uniform.layers_per_stage), b, u, u / b])
                data.append({"model": model, "schedule": schedule.value, "m": m, "balanced_ms": times["balanced"],
                             "uniform_ms": times["uniform"]})
    _results.write(
        "balance", title="Balanced vs uniform split", device=args.device,
        tables={f"2 ranks, median of {args.rounds} alternating runs each": _results.markdown_table(
            ["model", "layer cost spread", "schedule", "B/M", "planner's split", "uniform split",
             "balanced ms", "uniform ms", "speed-up"], rows)},
        data={"rows": data},
    )


if __name__ == "__main__":
    main()
