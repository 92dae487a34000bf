"""A saved calibration's measurements predicted again with other checkpointing ratios: each model's profile in the
calibration JSON gets the checkpoint_forward_ratio and checkpoint_recompute_ratio of another profile of the same
model and batch size (say, one taken by an older commit), everything else kept; then

    python bench/calibrate.py --from-json OUT --name NAME

predicts the same measurements with them. How bench/results/calibration_ckpt.md compares the window-as-one-stage
ratios (autotune.profiling._sample_stage_checkpoint) with one block's, on the same trials:

    git worktree add /tmp/before 05594a1
    (cd /tmp/before && for m in recipes/mlp.py ...; do autotune profile $m --batch-size 64 --device cpu \
        -o /tmp/old64_$(basename $m .py).json; done)       # with /tmp/before's autotune on PYTHONPATH
    python bench/checkpoint_ratios_ab.py bench/results/calibration_ckpt.json /tmp/old64_{stem}.json --out X.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

RATIOS = ("checkpoint_forward_ratio", "checkpoint_recompute_ratio")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("calibration", type=Path, help="a calibration JSON (bench/results/*.json)")
    parser.add_argument("profiles", help="path of each model's other profile, {stem} for the model file's stem")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    whole = json.loads(args.calibration.read_text())
    for result in whole["results"]:
        stem = Path(result["recipe"]).stem
        other = json.loads(Path(args.profiles.format(stem=stem)).read_text())
        if other["micro_batch_sizes"] != result["profile"]["micro_batch_sizes"]:
            raise SystemExit(f"{stem}: the other profile's micro-batch sizes {other['micro_batch_sizes']} are not "
                             f"the calibration's {result['profile']['micro_batch_sizes']}: profile at its batch size")
        for key in RATIOS:
            print(f"{stem} {key}: {[round(x, 2) for x in result['profile'][key]]} -> "
                  f"{[round(x, 2) for x in other[key]]}")
            result["profile"][key] = other[key]
    args.out.write_text(json.dumps(whole))


if __name__ == "__main__":
    main()
