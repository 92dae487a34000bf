"""Profile stability: how far repeated profiles of one model agree, with and without reusing freed CPU memory.

Each profile runs in its own process (the malloc setting is process-wide), alternating the two settings, and the
table gives every profile's summed forward + backward time per micro-batch size and the spread (max / min - 1).

    python bench/profile_stability.py --model recipes/cnn.py --batch-size 64 --repeats 4
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _results  # noqa: E402

CHILD = """
import json, sys
import autotune.profiling as profile
if sys.argv[3] == "glibc defaults":
    profile.keep_freed_cpu_memory = lambda: False
from autotune.model_file import check_model, load_model_file
spec = load_model_file(sys.argv[1])
check_model(spec, int(sys.argv[2]))
p = profile.profile_model(spec, batch_size=int(sys.argv[2]), device="cpu")
totals = [sum(l.forward_ms[k] + l.backward_input_ms[k] + l.backward_weight_ms[k] for l in p.layers)
          for k in range(len(p.micro_batch_sizes))]
print(json.dumps({"sizes": list(p.micro_batch_sizes), "totals_ms": totals}))
"""

SETTINGS = ("glibc defaults", "freed memory reused")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="recipes/cnn.py")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=4)
    args = parser.parse_args()
    runs: dict[str, list[dict]] = {s: [] for s in SETTINGS}
    for _ in range(args.repeats):
        for setting in SETTINGS:
            out = subprocess.run([sys.executable, "-c", CHILD, args.model, str(args.batch_size), setting],
                                 check=True, capture_output=True, text=True).stdout
            runs[setting].append(json.loads(out.strip().splitlines()[-1]))
    sizes = runs[SETTINGS[0]][0]["sizes"]
    rows = []
    for setting in SETTINGS:
        for i, run in enumerate(runs[setting]):
            rows.append([setting, i + 1, *run["totals_ms"]])
        per_size = list(zip(*(run["totals_ms"] for run in runs[setting])))
        rows.append([setting, "spread", *[f"{max(v) / min(v) - 1:.0%}" for v in per_size]])
    _results.write(
        "profile_stability",
        title="Profile stability: repeated profiles of one model",
        device="cpu",
        tables={f"{args.model}: summed forward + backward ms per micro-batch size": _results.markdown_table(
            ["setting", "profile", *[f"M={m}" for m in sizes]], rows)},
        data={"model": args.model, "batch_size": args.batch_size, "sizes": sizes, "runs": runs},
    )


if __name__ == "__main__":
    main()
