"""Gloo's device threads under SCHED_IDLE or not (AUTOTUNE_GLOO_LOOP_IDLE=1 / 0), the same configurations traced in
alternating rounds, so that the machine's drift falls on both alike: what the step, the waits and the compute do
either way.

autotune.devices.idle_gloo_device_threads (opt-in) puts gloo's tcp device threads under SCHED_IDLE: their busy-spin
while a post holds a pair's lock (pytorch/gloo#246, bench/gloo_cross.py) then never takes a core from a rank
thread, and the slow posts (~4 ms) go. But under SCHED_IDLE those threads also move a message's bytes only when a
core is free. Each round runs bench/action_trace.py once per setting (its own profile, its own trials), the order
of the two settings alternating round to round; per configuration and setting it reports the median over rounds of
the measured step, each rank's time waiting for messages, the stage modules' compute against the profile's, and the
posts over 1 ms.

    python bench/gloo_idle_ab.py --model recipes/mlp.py --configs VMin/1/2,1,1,6 DualPipeV/8/2,1,1,6 --rounds 4

Not a test: it compares two settings on a shared machine; run it with nothing else busy.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _results  # noqa: E402

TRACE = Path(__file__).resolve().parent / "action_trace.py"
SETTINGS = ("1", "0")


def trace(model: str, batch_size: int, configs: list[str], idle: str, repeats: int) -> list[dict[str, Any]]:
    """One bench/action_trace.py run with AUTOTUNE_GLOO_LOOP_IDLE=idle: its rows."""
    out = subprocess.run(
        [sys.executable, str(TRACE), "--model", model, "--batch-size", str(batch_size), "--repeats", str(repeats),
         "--no-write", "--configs", *configs],
        env={**os.environ, "AUTOTUNE_GLOO_LOOP_IDLE": idle}, capture_output=True, text=True, check=False)
    if out.returncode:
        raise SystemExit(f"bench/gloo_idle_ab.py: action_trace failed:\n{out.stderr[-2000:]}")
    return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--configs", nargs="+", required=True, help="SCHEDULE/M/SPLIT, as bench/action_trace.py")
    parser.add_argument("--rounds", type=int, default=4, help="rounds; each runs both settings, order alternating")
    parser.add_argument("--repeats", type=int, default=1, help="trials per configuration per run (action_trace)")
    parser.add_argument("--name", default="gloo_idle_ab")
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()

    started = time.time()
    runs: dict[str, list[list[dict[str, Any]]]] = {s: [] for s in SETTINGS}
    for r in range(args.rounds):
        for idle in SETTINGS if r % 2 == 0 else SETTINGS[::-1]:
            runs[idle].append(trace(args.model, args.batch_size, args.configs, idle, args.repeats))
            print(f"round {r + 1}, AUTOTUNE_GLOO_LOOP_IDLE={idle}: "
                  + ", ".join(f"{row['candidate']} {row['measured_ms']:.1f} ms" for row in runs[idle][-1]),
                  file=sys.stderr, flush=True)

    median = statistics.median
    table, data = [], []
    for i, text in enumerate(args.configs):
        for idle in SETTINGS:
            rows = [run[i] for run in runs[idle]]
            step = [row["measured_ms"] for row in rows]
            predicted = median([row["predicted_ms"] for row in rows])
            ranks = [[row["ranks"][k] for row in rows] for k in range(2)]
            wait = [median([x["wait_ms"] for x in rank]) for rank in ranks]
            ratio = [median([x["compute_ms"] / x["profile_compute_ms"] for x in rank if x["profile_compute_ms"]])
                     for rank in ranks]
            slow = [median([x["slow_posts"] for x in rank]) for rank in ranks]
            posts = [median([x["posts"] for x in rank]) for rank in ranks]
            table.append([rows[0]["candidate"] if idle == SETTINGS[0] else "", "idle" if idle == "1" else "default",
                          f"{median(step):.1f}", " / ".join(f"{x:.1f}" for x in step), f"{predicted:.1f}",
                          f"{(predicted - median(step)) / median(step):+.0%}",
                          " / ".join(f"{x:.1f}" for x in wait), " / ".join(f"{x:.2f}" for x in ratio),
                          " / ".join(f"{s:g} of {p:g}" for s, p in zip(slow, posts))])
            data.append({"config": text, "candidate": rows[0]["candidate"], "idle": idle == "1", "step_ms": step,
                         "predicted_ms": predicted, "wait_ms": wait, "compute_over_profile": ratio,
                         "slow_posts": slow, "posts": posts})
    command = "python bench/gloo_idle_ab.py " + " ".join(sys.argv[1:])
    tables = {f"{args.model}, B {args.batch_size}, 2 ranks ({args.rounds} rounds; medians; rank 0 / rank 1)":
              _results.markdown_table(
                  ["candidate", "gloo threads", "step ms", "rounds ms", "predicted ms", "error", "waiting ms",
                   "compute / profile", "posts over 1 ms"], table)}
    if args.no_write:
        _results.show(tables)
        return
    _results.write(args.name, title="Gloo's device threads under SCHED_IDLE or not, side by side", device="cpu",
                   tables=tables,
                   data={"command": command, "rows": data, "wall_s": time.time() - started},
                   notes=f"command: `{command}`\n\n" + __doc__.split("\n\n")[1])


if __name__ == "__main__":
    main()
