"""Block-by-block profiles against the whole-model profiles they replaced (issue 29): the same recipes profiled by
this checkout (each block materialised and measured on its own, identical blocks once) and by an older autotune
(given as a source folder: it built and trained the whole model), twice each, interleaved, one process per profile.
Differences between the two versions are read against each version's own run-to-run differences (the noise).

    git archive fafcb52 autotune | tar -x -C /tmp/old-src
    python bench/profile_equivalence.py --old /tmp/old-src

Per recipe and quantity: the median over layers and micro-batch sizes of |a / b - 1| (times: forward, input-grad,
weight-grad; bytes: saved activations and outputs), and |a / b - 1| of the whole-model sums (the optimizer step's time
and state, the summed fwd + bwd per micro-batch size, median over sizes); for these the table gives the sign of
new / old - 1 (positive: the block-by-block profile measures longer).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _results  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
RECIPES = {"mlp": 64, "gpt": 16, "cnn": 32, "hf_llama": 16}
"""recipe -> batch size profiled."""
PER_LAYER = ("forward_ms", "backward_input_ms", "backward_weight_ms", "saved_bytes", "output_bytes")


def profile(source: Path, recipe: str, batch: int, out: Path) -> dict:
    subprocess.run([sys.executable, "-m", "autotune", "profile", str(ROOT / "recipes" / f"{recipe}.py"),
                    "--batch-size", str(batch), "--device", "cpu", "-o", str(out)],
                   check=True, capture_output=True, cwd=source, env={**os.environ, "PYTHONPATH": str(source)})
    return json.loads(out.read_text())


def _rel(a: float, b: float) -> float:
    return abs(_signed(a, b))


def _signed(a: float, b: float) -> float:
    return a / b - 1 if b else (0.0 if a == b else float("inf"))


def differences(a: dict, b: dict) -> dict[str, float]:
    """Median relative differences of two profiles of one model, per quantity (see the module docstring)."""
    sizes = range(len(a["micro_batch_sizes"]))
    out = {}
    for key in PER_LAYER:
        out[key] = statistics.median(_rel(la[key][k], lb[key][k]) for la, lb in zip(a["layers"], b["layers"])
                                     for k in sizes)

    def total(p: dict, k: int) -> float:
        return sum(layer[q][k] for layer in p["layers"] for q in PER_LAYER[:3])

    out["whole fwd+bwd"] = statistics.median(_signed(total(a, k), total(b, k)) for k in sizes)
    out["optimizer_step_ms"] = _signed(a["optimizer_step_ms"], b["optimizer_step_ms"])
    out["optimizer_state_bytes"] = _signed(a["optimizer_state_bytes"], b["optimizer_state_bytes"])
    return out


def totals(p: dict) -> list[float]:
    """Summed forward + input-grad + weight-grad ms over the layers, per micro-batch size."""
    sizes = range(len(p["micro_batch_sizes"]))
    return [sum(layer[q][k] for layer in p["layers"] for q in PER_LAYER[:3]) for k in sizes]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--old", type=Path, required=True, help="source folder of the older autotune")
    parser.add_argument("--recipes", nargs="*", default=list(RECIPES))
    args = parser.parse_args()
    rows, data, sum_rows = [], {}, []
    with tempfile.TemporaryDirectory() as tmp:
        for recipe in args.recipes:
            batch = RECIPES[recipe]
            runs: dict[str, list[dict]] = {"new": [], "old": []}
            for i in range(2):
                for name, source in (("new", ROOT), ("old", args.old.resolve())):
                    runs[name].append(profile(source, recipe, batch, Path(tmp) / f"{recipe}-{name}-{i}.json"))
            versus = differences(runs["new"][0], runs["old"][0])
            second = differences(runs["new"][1], runs["old"][1])
            noise_new = differences(runs["new"][0], runs["new"][1])
            noise_old = differences(runs["old"][0], runs["old"][1])
            data[recipe] = {"batch": batch, "new_vs_old": [versus, second], "new_vs_new": noise_new,
                            "old_vs_old": noise_old}
            for k, size in enumerate(runs["new"][0]["micro_batch_sizes"]):
                new = [totals(r)[k] for r in runs["new"]]
                old = [totals(r)[k] for r in runs["old"]]
                sum_rows.append([recipe, size, *(round(x, 3) for x in new), *(round(x, 3) for x in old),
                                 f"{100 * (statistics.mean(new) / statistics.mean(old) - 1):+.1f}%"])
            for key in versus:
                between = max((versus[key], second[key]), key=abs)
                noise = max(abs(noise_new[key]), abs(noise_old[key]))
                verdict = "same" if between == 0 else (
                    "within noise" if abs(between) <= noise * 1.5 + 0.02 else "differs")
                signed = "+" if key not in PER_LAYER and between > 0 else ""
                rows.append([recipe, key, f"{signed}{100 * between:.1f}%", f"{100 * abs(noise_new[key]):.1f}%",
                             f"{100 * abs(noise_old[key]):.1f}%", verdict])
                print(rows[-1], flush=True)
    _results.write(
        "profile_equivalence",
        title="Block-by-block profiles against whole-model profiles (issue 29)",
        device="cpu",
        tables={"median relative difference": _results.markdown_table(
            ["recipe", "quantity", "new vs old (worse of 2 pairs)", "new vs new", "old vs old", "verdict"], rows),
            "summed fwd + bwd ms of all layers, per micro-batch size": _results.markdown_table(
                ["recipe", "micro-batch", "new 1", "new 2", "old 1", "old 2", "new / old - 1 (means)"], sum_rows)},
        data=data | {"sums": sum_rows},
        notes=("new: this checkout (blocks made real a window at a time and timed in place in one pass through the "
               "window; of identical blocks four in a row measured, the rest copied; the optimizer stepped per "
               "block). old: the source given with --old (the whole model built and trained at every size). "
               "'within noise': the difference between versions is at most 1.5 x the larger run-to-run difference "
               "of either version, plus 2 points. Bytes are exact. Times: run on the 2-core machine with nothing "
               "else running (a busy machine makes the run-to-run columns large and the verdicts meaningless). The "
               "per-layer medians are dominated by layers of tens of microseconds; the summed table weighs layers "
               "by their time."),
    )


if __name__ == "__main__":
    main()
