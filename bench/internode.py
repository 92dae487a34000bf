"""The inter-node model against a link whose numbers are known: two torchrun "nodes" in network namespaces over a veth
pair shaped with tbf (bench/_netns.py), one CPU rank each.

At each --rates (Mbit/s; `none`: unshaped) it measures the link with a plain TCP stream, then runs (a) a fixed set of
trials across it from one node-0 process (the cluster's own probe first, then each trial through autotune.cluster),
and (b) the two-node `autotune search`. Each trial is compared with the simulator's prediction over the probed link
(LinkModel.for_device("cpu").with_probe(...), gpus_per_node 1: what the search itself predicts with), and the probe
with the shaping. Needs root and `ip netns`; without them it says so and exits 0. The namespaces are removed at the
end, on failure and on Ctrl-C / SIGTERM.

    python bench/internode.py --rates none 400 50 --search-trials 3
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "bench" / "models" / "mlp13.py"
TORCHRUN = Path(sys.executable).with_name("torchrun")
BATCH = 64

# (schedule, pp, dp, B/M per replica, layers per stage, checkpointing, wire dtype): pp 2 across the link at several
# B/M and both wire dtypes, a V schedule (its two middle hand-offs cross), and dp 2 (the all-reduce crosses).
FIXED: list[tuple[str, int, int, int, tuple[int, ...], bool, str]] = [
    ("1F1B", 2, 1, 2, (6, 7), False, "float32"),
    ("1F1B", 2, 1, 8, (6, 7), False, "float32"),
    ("1F1B", 2, 1, 8, (6, 7), False, "bfloat16"),
    ("GPipe", 2, 1, 4, (6, 7), True, "float32"),
    ("VHalf", 2, 1, 4, (3, 3, 3, 4), False, "float32"),
    ("1F1B", 1, 2, 1, (13,), False, "float32"),
]


def candidates() -> list[Any]:
    from autotune.candidate import Candidate
    from autotune.schedules import Schedule

    return [Candidate(schedule=Schedule(s), pipeline_degree=pp, data_parallel_degree=dp, global_batch_size=BATCH,
                      n_microbatches=m, layers_per_stage=split, activation_checkpointing=ckpt, wire_dtype=wire)
            for s, pp, dp, m, split, ckpt, wire in FIXED]


# --- inside a namespace, under torchrun ---------------------------------------------------------------------------


def node_main(out: Path, steps: int, warmup: int) -> None:
    """One node of the fixed set: node 0 probes the link, runs every trial across both nodes and writes out; node 1
    serves its ranks until node 0 is done."""
    from autotune.cli.app import start_fork_server
    from autotune.cluster.env import detect, die_with_launcher
    from autotune.cluster.node import Cluster, serve, stop_on_sigterm
    from autotune.model_file import load_model_file
    from autotune.trial import TrialOptions

    env = detect()
    die_with_launcher()
    stop_on_sigterm()
    if env.node != 0:
        start_fork_server()
        sys.exit(serve(env, 1, say=lambda text: print(text, file=sys.stderr)))
    cluster = Cluster(env, 1)
    cluster.join()
    start_fork_server()
    code, result = 1, {}
    try:
        probed = cluster.probe("cpu", timeout_s=120)
        spec = load_model_file(MODEL)
        runs = []
        for c in candidates():
            m = cluster(spec, c, TrialOptions(steps=steps, warmup=warmup, timeout_s=180))
            print(f"{c.key}: {m.status} {m.step_time_ms}", file=sys.stderr)
            runs.append(m.to_dict())
        result = {"probe": list(probed) if probed else None, "runs": runs}
        code = 0
    finally:
        cluster.shutdown(code, "done" if code == 0 else "node 0 failed")
    out.write_text(json.dumps(result))


# --- the driver (root namespace) ------------------------------------------------------------------------------------


def torchrun(pair: Any, node: int, port: int, argv: list[str], folder: Path) -> subprocess.Popen[str]:
    command = [str(TORCHRUN), "--nnodes", "2", "--nproc-per-node", "1", "--node-rank", str(node),
               "--master-addr", pair.addresses[0], "--master-port", str(port), "--monitor-interval", "0.5", *argv]
    log = open(folder / f"node{node}.log", "w")
    return pair.popen(node, command, env={"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}, stdout=subprocess.PIPE,
                      stderr=log, cwd=folder)


def run_nodes(pair: Any, argv: list[str], folder: Path, timeout_s: float) -> str:
    """Both nodes of one command; node 0's stdout. RuntimeError naming the log when either fails."""
    port = 29400 + os.getpid() % 500
    nodes = [torchrun(pair, n, port, argv, folder) for n in (0, 1)]
    try:
        out = nodes[0].communicate(timeout=timeout_s)[0]
        nodes[1].wait(timeout=60)
    finally:
        for p in nodes:
            if p.poll() is None:
                p.kill()
                p.wait()
    for n, p in enumerate(nodes):
        if p.returncode != 0:
            tail = (folder / f"node{n}.log").read_text()[-2000:]
            raise RuntimeError(f"node {n} exited {p.returncode}:\n{tail}")
    return out


def predictor(profile: Any, probed: tuple[float, float] | None) -> Any:
    from autotune.simulate import LinkModel, Predictor

    link = LinkModel.for_device("cpu")
    if probed is not None:
        link = link.with_probe(inter_latency_s=probed[0], inter_bandwidth_bytes_per_s=probed[1])
    return Predictor(profile=profile, link=link, gpus_per_node=1)


def fixed_set(pair: Any, profile: Any, folder: Path, steps: int, warmup: int) -> dict[str, Any]:
    from autotune.candidate import Measurement

    out = folder / "fixed.json"
    run_nodes(pair, [str(Path(__file__).resolve()), "node", "--out", str(out), "--steps", str(steps),
                     "--warmup", str(warmup)], folder, timeout_s=900)
    data = json.loads(out.read_text())
    probed = tuple(data["probe"]) if data["probe"] else None
    predict = predictor(profile, probed)
    rows = []
    for raw in data["runs"]:
        m = Measurement.from_dict(raw)
        est = predict(m.candidate)
        rows.append({"candidate": m.candidate.key, "status": m.status, "measured_ms": m.step_time_ms,
                     "step_times_ms": list(m.step_times_ms), "predicted_ms": est.step_time_ms,
                     "predicted_allreduce_ms": est.allreduce_ms,
                     "error": (est.step_time_ms - m.step_time_ms) / m.step_time_ms if m.step_time_ms else None})
    return {"probe": probed, "rows": rows}


def search(pair: Any, profile: Any, folder: Path, trials: int, steps: int, warmup: int) -> dict[str, Any]:
    import optuna

    from autotune.shared_study import load_records

    argv = ["-m", "autotune", "search", str(MODEL), "--gpus", "2", "--gpus-per-node", "1", "--device", "cpu",
            "--batch-size", str(BATCH), "--trials", str(trials), "--steps", str(steps), "--warmup", str(warmup),
            "--storage", f"sqlite:///{folder / 'study.db'}", "--study-name", "s", "--output",
            str(folder / "autotune.yaml"), "--report-dir", str(folder / "report"), "--json"]
    summary = json.loads(run_nodes(pair, argv, folder, timeout_s=900))
    log = (folder / "node0.log").read_text()
    probe_line = next((line for line in log.splitlines() if "inter-node link" in line), "")
    study = optuna.load_study(study_name="s", storage=f"sqlite:///{folder / 'study.db'}")
    rows = []
    for r in load_records(study)[0]:
        if not r.launched or r.candidate is None:
            continue
        predicted = BATCH / r.predicted_throughput_samples_per_s * 1e3 if r.predicted_throughput_samples_per_s else None
        rows.append({"candidate": r.candidate.key, "status": r.outcome, "measured_ms": r.step_time_ms,
                     "predicted_ms": predicted,
                     "error": (predicted - r.step_time_ms) / r.step_time_ms if predicted and r.step_time_ms else None})
    pruned = sum(1 for r in load_records(study)[0] if r.outcome == "pruned")
    return {"probe_line": probe_line.strip(), "best": summary["best"]["candidate"] if summary.get("best") else None,
            "rows": rows, "pruned": pruned}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rates", nargs="+", default=["none", "400", "50"], help="tbf rates in Mbit/s; none: unshaped")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--search-trials", type=int, default=3, help="0: no search")
    parser.add_argument("--no-write", action="store_true", help="print, do not write bench/results")
    args = parser.parse_args()

    from _netns import NamespacePair, unavailable

    why = unavailable()
    if why:
        print(f"bench/internode.py: {why}; nothing measured", file=sys.stderr)
        return

    def stop(signum: int, frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, stop)

    from autotune.tune import load_and_profile

    started = time.strftime("%H:%M UTC", time.gmtime())
    load_before = os.getloadavg()
    _, profile = load_and_profile(MODEL, BATCH, "cpu", gpus=2)
    results = []
    with NamespacePair() as pair, tempfile.TemporaryDirectory(prefix="internode-") as tmp:
        for rate in args.rates:
            mbit = None if rate == "none" else float(rate)
            pair.shape(mbit)
            tcp = pair.transfer_rate(8 * 2**20 if (mbit or 1e9) >= 100 else 2 * 2**20)
            folder = Path(tmp) / f"rate-{rate}"
            folder.mkdir()
            entry: dict[str, Any] = {"rate_mbit": mbit, "tcp_bytes_per_s": tcp,
                                     "fixed": fixed_set(pair, profile, folder, args.steps, args.warmup)}
            print(f"rate {rate}: tcp {tcp * 8 / 1e6:.0f} Mbit/s, probe {entry['fixed']['probe']}", file=sys.stderr)
            for row in entry["fixed"]["rows"]:
                print(f"  {row['candidate']}: measured {row['measured_ms']} predicted {row['predicted_ms']:.1f}",
                      file=sys.stderr)
            if args.search_trials:
                sfolder = folder / "search"
                sfolder.mkdir()
                entry["search"] = search(pair, profile, sfolder, args.search_trials, args.steps, args.warmup)
                print(f"  search: {entry['search']['probe_line']} best {entry['search']['best']}", file=sys.stderr)
            results.append(entry)
    report(results, args, started, load_before)


def _mbit(bytes_per_s: float | None) -> str:
    return f"{bytes_per_s * 8 / 1e6:.0f}" if bytes_per_s else "-"


def report(results: list[dict[str, Any]], args: argparse.Namespace, started: str, load_before: tuple) -> None:
    import _results

    uptime = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    probe_rows, trial_rows = [], []
    for e in results:
        rate = "unshaped" if e["rate_mbit"] is None else f"{e['rate_mbit']:g}"
        probe = e["fixed"]["probe"]
        shaped = e["rate_mbit"] * 1e6 / 8 if e["rate_mbit"] else None
        probe_rows.append([rate, _mbit(e["tcp_bytes_per_s"]), _mbit(probe[1]) if probe else "failed",
                           f"{probe[0] * 1e6:.0f}" if probe else "-",
                           f"{(probe[1] - shaped) / shaped:+.0%}" if probe and shaped else "-",
                           e.get("search", {}).get("probe_line", "").split("probed): ")[-1]])
        for where in ("fixed", "search"):
            for row in e.get(where, {}).get("rows", []):
                trial_rows.append([rate, where, row["candidate"], row["status"],
                                   row["measured_ms"] if row["measured_ms"] else "-",
                                   row["predicted_ms"] if row["predicted_ms"] else "-",
                                   f"{row['error']:+.0%}" if row["error"] is not None else "-"])
    tables = {
        "probe vs shaping": _results.markdown_table(
            ["tbf rate Mbit/s", "TCP stream Mbit/s", "probe Mbit/s", "probe latency us", "probe vs tbf",
             "the search's probe line"], probe_rows),
        "trials: predicted (probed link) vs measured step time": _results.markdown_table(
            ["tbf rate Mbit/s", "set", "candidate", "outcome", "measured ms", "predicted ms", "error"], trial_rows),
    }
    notes = (f"Run from {started} to {time.strftime('%H:%M UTC', time.gmtime())}; load average before "
             f"{load_before[0]:.2f}, `uptime` after: {uptime}. Steps {args.steps}, warmup {args.warmup}, "
             f"search trials {args.search_trials}, batch {BATCH}, model bench/models/mlp13.py.")
    if args.no_write:
        print(json.dumps(results, indent=1, default=str))
        print("\n\n".join(tables.values()))
        print(notes)
        return
    _results.write("internode", title="Inter-node model over a shaped link (two namespaces, tbf)", device="cpu",
                   tables=tables, data={"results": results, "steps": args.steps, "warmup": args.warmup,
                                        "uptime": uptime}, notes=notes)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "node":
        node_args = argparse.ArgumentParser()
        node_args.add_argument("node")
        node_args.add_argument("--out", type=Path, required=True)
        node_args.add_argument("--steps", type=int, required=True)
        node_args.add_argument("--warmup", type=int, required=True)
        a = node_args.parse_args()
        node_main(a.out, a.steps, a.warmup)
    else:
        main()
