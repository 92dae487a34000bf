"""Does `autotune check` pass on an unchanged model right after the search that wrote the config? (issue 13)

For each recipe: one `autotune search` on the CPU stand-in, then `autotune check CONFIG` exactly as the config's
header prints it, N times; the exit codes and the measured / recorded ratios. Target: exit 0 in at least 9 of 10.

    python bench/check_stability.py [--checks 10] [--trials 8]
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _results  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CASES = [("mlp", 64), ("gpt", 16), ("cnn", 16)]


def autotune(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "autotune", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=1800)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checks", type=int, default=10)
    parser.add_argument("--trials", type=int, default=8)
    args = parser.parse_args()
    rows = []
    for name, batch in CASES:
        with tempfile.TemporaryDirectory() as tmp:
            work = Path(tmp)
            search = autotune(["search", str(ROOT / "recipes" / f"{name}.py"), "--gpus", "2", "--device", "cpu",
                               "--batch-size", str(batch), "--trials", str(args.trials), "--output", "tuned.yaml"],
                              work)
            if search.returncode != 0:
                raise SystemExit(f"search of {name} failed: {search.stderr[-500:]}")
            header = next(line for line in (work / "tuned.yaml").read_text().splitlines()
                          if line.startswith("# Check it still holds: "))
            command = shlex.split(header.removeprefix("# Check it still holds: autotune "))
            codes, ratios = [], []
            for _ in range(args.checks):
                out = autotune([*command, "--json"], work)
                codes.append(out.returncode)
                ratios.append(json.loads(out.stdout).get("ratio"))
            passed = sum(code == 0 for code in codes)
            rows.append([name, batch, f"{passed} of {len(codes)}", " ".join(map(str, codes)),
                         " ".join(f"{r:.2f}" if r is not None else "-" for r in ratios)])
    _results.write(
        "check_stability", title="autotune check right after its search, unchanged model", device="cpu",
        tables={"exit codes of `autotune check CONFIG` as the header prints it": _results.markdown_table(
            ["recipe", "batch", "passed", "exit codes", "measured / recorded median"], rows)},
        data={"rows": rows},
        notes="A check passes while its median stays within --tolerance (5 %) of the slowest run the search recorded "
              "of the config (measured.runs_throughput_samples_per_s).",
    )


if __name__ == "__main__":
    main()
