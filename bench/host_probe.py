"""The host probe (Profile.host_call_ms) over time: one probe against the lowest of a profile's, and what it moves.

Part 1, over fresh processes (one thread each, as a profile runs): each profiles a model (its HostProbe's samples:
the first probe, the lowest that profile_model keeps, the median, the highest), then probes back to back for
--seconds (--every S sleeps S between them: the thread then wakes cold, as a pipeline rank after a wait) with two
witnesses beside each probe: a pure-Python loop and a small MLP's forward and backward, so a slow phase of the host
shows on all three or on the probe alone.

Part 2 (--repredict FILE ...): saved calibrations (bench/calibrate.py --profiles N, whose profiles_taken hold each
profile's probe) predicted again with each model's probe as saved (the median of its profiles') and as the lowest of
them, step-time MAPE side by side: what one probe taken in a slow phase did to the predictions.

    python bench/host_probe.py --processes 6 --seconds 8 --repredict bench/results/calibration_epyc_moments.json
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _results  # noqa: E402

CHILD = """
import json, statistics, sys, time
import torch
import torch.nn as nn
from autotune import profiling
from autotune.model_file import load_model_file

samples = []
class Kept(profiling.HostProbe):
    def __init__(self, clock=None):
        super().__init__(clock)
        samples.append(self.samples)
profiling.HostProbe = Kept
spec = load_model_file(sys.argv[1])
profile = profiling.profile_model(spec, batch_size=int(sys.argv[2]), device="cpu")
torch.set_num_threads(1)
probe = profiling.HostProbe()
mlp = nn.Sequential(*[nn.Linear(256, 256) for _ in range(4)])
x = torch.randn(64, 256)

def mlp_ms():
    start = time.perf_counter(); mlp(x).sum().backward(); return (time.perf_counter() - start) * 1e3

def loop_ms():
    start = time.perf_counter(); total = 0
    for i in range(20000):
        total += i
    return (time.perf_counter() - start) * 1e3

series = []
start = time.perf_counter()
while time.perf_counter() - start < float(sys.argv[3]):
    series.append([probe.sample(), statistics.median(loop_ms() for _ in range(3)),
                   statistics.median(mlp_ms() for _ in range(5))])
    if float(sys.argv[4]) > 0:
        time.sleep(float(sys.argv[4]))
print(json.dumps({"kept": profile.host_call_ms, "profile_samples": samples[0], "series": series}))
"""


def run_processes(model: str, batch_size: int, processes: int, seconds: float, every: float) -> list[dict]:
    runs = []
    for _ in range(processes):
        out = subprocess.run([sys.executable, "-c", CHILD, model, str(batch_size), str(seconds), str(every)],
                             check=True, capture_output=True, text=True).stdout
        runs.append(json.loads(out.strip().splitlines()[-1]))
    return runs


def repredict(path: Path) -> list[list]:
    """Each model of a saved calibration: MAPE from its saved profile and with the lowest of its profiles' probes."""
    import calibrate

    from autotune.costs import Profile

    rows = []
    for r in json.loads(path.read_text())["results"]:
        taken = [p.get("host_call_ms", 0.0) for p in r.get("profiles_taken") or []]
        if not taken or not all(taken):
            continue
        lowest = dict(r["profile"], host_call_ms=min(taken))
        saved, low = (calibrate.predicted(r["recipe"], r["batch_size"], Profile.from_dict(profile),
                                          copy.deepcopy(r["rows"]), r["pass_to_pass_spearman"], r["wall_s"])
                      for profile in (r["profile"], lowest))
        families = [max(calibrate.step_error_by_schedule(x["rows"]).values()) for x in (saved, low)]
        rows.append([path.name, r["recipe"], " / ".join(f"{t * 1e3:.1f}" for t in taken),
                     r["profile"]["host_call_ms"] * 1e3, min(taken) * 1e3, f"{saved['mape']:.1%}", f"{low['mape']:.1%}",
                     f"{families[0]:.0%}", f"{families[1]:.0%}"])
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="bench/models/mlp13.py")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--processes", type=int, default=6)
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--every", type=float, default=0.0)
    parser.add_argument("--repredict", type=Path, nargs="*", default=[])
    parser.add_argument("--name", default="calibration_host_probe")
    args = parser.parse_args()
    runs = run_processes(args.model, args.batch_size, args.processes, args.seconds, args.every)
    us = 1e3
    per_process = []
    for i, run in enumerate(runs, 1):
        samples = run["profile_samples"]
        probes, loops, mlps = zip(*run["series"])
        per_process.append([i, samples[0] * us, run["kept"] * us, statistics.median(samples) * us, max(samples) * us,
                            len(probes), min(probes) * us, statistics.median(probes) * us, max(probes) * us,
                            min(loops), statistics.median(loops), max(loops), min(mlps), statistics.median(mlps),
                            max(mlps)])
    tables = {
        f"fresh processes: {args.model} profiled, then probes for {args.seconds} s"
        + (f", {args.every} s of sleep between them" if args.every else " back to back"):
            _results.markdown_table(
                ["process", "profile: first probe us", "kept (lowest) us", "median us", "highest us", "probes after",
                 "lowest us", "median us", "highest us", "Python loop ms: lowest", "median", "highest",
                 "MLP step ms: lowest", "median", "highest"], per_process)}
    repredicted = [row for path in args.repredict for row in repredict(path)]
    if repredicted:
        tables["saved calibrations predicted again: the probe as saved and the lowest of the profiles'"] = (
            _results.markdown_table(
                ["file", "model", "its profiles' probes us", "saved us", "lowest us", "MAPE as saved",
                 "MAPE from the lowest", "worst family as saved", "worst family from the lowest"], repredicted))
    notes = """One probe is the median of HOST_CALL_REPEATS one-element AdamW steps (a few ms). A profile (autotune's
HostProbe) takes one before its walk, one after each block and one after each of the optimizer and idle probes, and
keeps the lowest: this host goes through phases of seconds where the probe, the Python loop and the MLP's step all
run slower, and the per-action costs the simulator puts on every prediction scale with the probe
(LinkModel.for_profile)."""
    _results.write(args.name, title="The host probe over time, and what a slow one moves", device="cpu",
                   tables=tables, data={"runs": runs, "repredicted": repredicted}, notes=notes)


if __name__ == "__main__":
    main()
