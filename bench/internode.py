"""The inter-node model against a link whose numbers are known: two torchrun "nodes" in network namespaces over a veth
pair shaped with tbf (bench/_netns.py), one CPU rank each.

At each --rates (Mbit/s; `none`: unshaped) it measures the link with a plain TCP stream, then runs (a) a fixed set of
trials across it from one node-0 process (the cluster's own probe first, then each trial through autotune.cluster),
and (b) the two-node `autotune search`. Each trial is compared with the simulator's prediction over the probed link
(LinkModel.for_profile(profile).with_probe(...), gpus_per_node 1: what the search itself predicts with), and the probe
with the shaping. Needs root and `ip netns`; without them it says so and exits 0. The namespaces are removed at the
end, on failure and on Ctrl-C / SIGTERM.

    python bench/internode.py --rates none 200 20 --search-trials 2 --steps 5
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
BATCH = 256

# (schedule, pp, dp, B/M per replica, layers per stage, checkpointing, wire dtype, dp mode): pp 2 across the link at
# several B/M and both wire dtypes, a V schedule (its two middle hand-offs cross), and dp 2 (the all-reduce crosses;
# sharded: FSDP2's all-gathers and reduce-scatters cross).
FIXED: list[tuple[str, int, int, int, tuple[int, ...], bool, str, str]] = [
    ("1F1B", 2, 1, 2, (6, 7), False, "float32", "replicate"),
    ("1F1B", 2, 1, 8, (6, 7), False, "float32", "replicate"),
    ("1F1B", 2, 1, 8, (6, 7), False, "bfloat16", "replicate"),
    ("GPipe", 2, 1, 4, (6, 7), True, "float32", "replicate"),
    ("VHalf", 2, 1, 4, (3, 3, 3, 4), False, "float32", "replicate"),
    ("1F1B", 1, 2, 1, (13,), False, "float32", "replicate"),
    ("1F1B", 1, 2, 1, (13,), False, "float32", "shard"),
]


def candidates() -> list[Any]:
    from autotune.candidate import Candidate
    from autotune.schedules import Schedule

    return [Candidate(schedule=Schedule(s), pipeline_degree=pp, data_parallel_degree=dp, global_batch_size=BATCH,
                      n_microbatches=m, layers_per_stage=split, activation_checkpointing=ckpt, wire_dtype=wire,
                      data_parallel_mode=mode)
            for s, pp, dp, m, split, ckpt, wire, mode in FIXED]


# --- inside a namespace, under torchrun ---------------------------------------------------------------------------


def _mbit(rate: str) -> float | None:
    return None if rate == "none" else float(rate)


def node_main(out: Path, steps: int, warmup: int, rates: list[str], tag: str, subnet: int, repeats: int,
              extra: Path | None = None) -> None:
    """One node of the fixed set: node 0 probes the link at every rate, then runs every trial across both nodes at
    every rate in turn (the rates of one trial back to back, so that a machine whose load drifts compares them at one
    load), and the same trial with both ranks on node 0 (over its loopback: what the unshaped link is measured
    against), `repeats` rounds of them, keeps each trial's median round and writes out; then, `repeats` rounds
    again, the candidates `extra` (JSON: rate -> candidate dicts, the searches' launched trials) at their own rate;
    node 1 serves its ranks until node 0 is done."""
    from _netns import NamespacePair

    from autotune.candidate import Candidate
    from autotune.cli.app import start_fork_server
    from autotune.cluster.env import detect, die_with_launcher
    from autotune.cluster.node import Cluster, serve, stop_on_sigterm
    from autotune.model_file import load_model_file
    from autotune.trial import TrialOptions, run_trial

    env = detect()
    die_with_launcher()
    stop_on_sigterm()
    if env.node != 0:
        start_fork_server()
        code = serve(env, 1, say=lambda text: print(text, file=sys.stderr))
        sys.stderr.flush()
        os._exit(code)  # as autotune's CLI: no interpreter teardown (the store threads abort in it)
    pair = NamespacePair(tag=tag, subnet=subnet)  # the driver's, shaped from here between trials
    cluster = Cluster(env, 1)
    cluster.join()
    start_fork_server()
    code, result = 1, {}
    try:
        probes = {}
        for rate in rates:
            pair.shape(_mbit(rate))
            probed = cluster.probe("cpu", timeout_s=120)
            probes[rate] = list(probed) if probed else None
        spec = load_model_file(MODEL)
        runs: dict[str, list[Any]] = {rate: [] for rate in rates}
        one_node: list[Any] = []
        profiles: list[dict[str, Any]] = []
        for c in candidates():
            profiles.append(fresh_profile())
            rounds: dict[str, list[Any]] = {rate: [] for rate in [*rates, "one node"]}
            for _ in range(repeats):
                for rate in rates:
                    pair.shape(_mbit(rate))
                    m = cluster(spec, c, TrialOptions(steps=steps, warmup=warmup, timeout_s=180))
                    print(f"{rate} {c.key}: {m.status} {m.step_time_ms}", file=sys.stderr)
                    rounds[rate].append(m)
                m = run_trial(spec, c, TrialOptions(steps=steps, warmup=warmup, timeout_s=180, device="cpu"))
                print(f"one node {c.key}: {m.status} {m.step_time_ms}", file=sys.stderr)
                rounds["one node"].append(m)
            for rate, kept_runs in [*((r, runs[r]) for r in rates), ("one node", one_node)]:
                kept_runs.append({**_median_round(rounds[rate]), "profile_index": len(profiles) - 1})
        result = {rate: {"probe": probes[rate], "runs": runs[rate]} for rate in rates}
        again = json.loads(extra.read_text()) if extra else {}
        for rate in rates:  # the searches' trials, measured again in rounds as the fixed set is
            todo = [Candidate.from_dict(d) for d in again.get(rate, [])]
            if not todo:
                continue
            pair.shape(_mbit(rate))
            profiles.append(fresh_profile())
            by_key: dict[str, list[Any]] = {c.key: [] for c in todo}
            for _ in range(repeats):
                for c in todo:
                    m = cluster(spec, c, TrialOptions(steps=steps, warmup=warmup, timeout_s=180))
                    print(f"{rate} search's {c.key}: {m.status} {m.step_time_ms}", file=sys.stderr)
                    by_key[c.key].append(m)
            result[rate]["search_runs"] = [{**_median_round(ms), "profile_index": len(profiles) - 1}
                                           for ms in by_key.values()]
        result["one node"] = {"runs": one_node}
        result["profiles"] = profiles
        code = 0
    finally:
        cluster.shutdown(code, "done" if code == 0 else "node 0 failed")
    out.write_text(json.dumps(result))
    sys.stderr.flush()
    os._exit(0)


def fresh_profile() -> dict[str, Any]:
    """The model profiled again, here and now (node 0, one thread): what a configuration's rounds are predicted
    from. This 2-core machine's speed drifts by 10-30 % over a run of the bench (one configuration's one-node rounds
    went 23.6 -> 17.4 ms in one run), so a profile taken at the start would measure that drift, not the model."""
    from autotune.tune import load_and_profile

    return load_and_profile(MODEL, BATCH, "cpu", gpus=2)[1].to_dict()


def _median_round(rounds: list[Any]) -> dict[str, Any]:
    """The median round of one trial's measurements (the lower middle of an even count), with every round's time."""
    ok = sorted((m for m in rounds if m.step_time_ms), key=lambda m: m.step_time_ms)
    kept = ok[(len(ok) - 1) // 2] if ok else rounds[0]
    return {**kept.to_dict(), "rounds_ms": [m.step_time_ms for m in rounds]}


def p2p_main(rank: int, address: str, port: int, out: Path) -> None:
    """Two plain gloo ranks (one per namespace): the one-way time of a message (best ping-pong / 2), the time of
    one message each way at once, and the time a receive takes when it is posted LATE_S after its send (0 if the
    bytes moved before it was posted)."""
    import datetime

    import torch
    import torch.distributed as dist

    from autotune.trial.probe import ping_pong

    dist.init_process_group("gloo", init_method=f"tcp://{address}:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=120))
    peer, result = 1 - rank, {}
    for size in P2P_BYTES:
        buf = torch.zeros(size // 4)
        times = []
        for _ in range(4):
            dist.barrier()
            t0 = time.perf_counter()
            ping_pong(buf, rank)
            times.append((time.perf_counter() - t0) / 2)
        other, both = torch.zeros(size // 4), []
        for _ in range(4):  # both ranks send one and receive one at once (1F1B's fused send + receive)
            dist.barrier()
            t0 = time.perf_counter()
            for work in (dist.isend(buf, peer), dist.irecv(other, peer)):
                work.wait()
            both.append(time.perf_counter() - t0)
        dist.barrier()
        if rank == 0:
            dist.send(buf, peer)
            late = None
        else:
            time.sleep(LATE_S)  # the sender has long posted its send
            t0 = time.perf_counter()
            dist.recv(buf, peer)
            late = time.perf_counter() - t0
        result[str(size)] = {"one_way_s": min(times[1:]), "late_receive_s": late, "exchange_s": min(both[1:])}
    flat, reduce_times = torch.zeros(ALLREDUCE_BYTES // 4), []
    for _ in range(3):  # the dp all-reduce's collective, one flat tensor as autotune.runtime does it
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_reduce(flat)
        reduce_times.append(time.perf_counter() - t0)
    result["allreduce"] = {"bytes": ALLREDUCE_BYTES, "seconds": min(reduce_times[1:])}
    # One FSDP2 unit's collectives as FSDP2 calls them over gloo: each rank's half of the unit gathered whole
    # (all_gather_into_tensor), the whole unit's gradients reduced and scattered into halves (reduce_scatter_tensor);
    # one unit, and the step's UNITS one after another as the sharded dp 2 of the fixed set runs them.
    whole, half = torch.zeros(UNIT_BYTES // 4), torch.zeros(UNIT_BYTES // 8)
    calls = {"all_gather": lambda: dist.all_gather_into_tensor(whole, half),
             "reduce_scatter": lambda: dist.reduce_scatter_tensor(half, whole)}
    for name, call in calls.items():
        one, every = [], []
        for _ in range(3):
            dist.barrier()
            t0 = time.perf_counter()
            call()
            one.append(time.perf_counter() - t0)
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(UNITS):
                call()
            every.append(time.perf_counter() - t0)
        result[name] = {"bytes": UNIT_BYTES, "units": UNITS, "seconds": min(one[1:]), "all_units_s": min(every[1:])}
    dist.barrier()
    dist.destroy_process_group()
    out.with_suffix(f".{rank}.json").write_text(json.dumps(result))


P2P_BYTES = (16 * 2**10, 32 * 2**10, 64 * 2**10, 128 * 2**10, 512 * 2**10)
"""The one-message table's sizes: 32, 64 and 128 KiB are the fixed set's hand-offs (m 8, 4, 2 at batch 256)."""
ALLREDUCE_BYTES = 2 * 2**20
UNIT_BYTES = (256 * 256 + 256) * 4
"""One FSDP2 unit of bench/models/mlp13.py: a Linear(256, 256)'s float32 parameters."""
UNITS = 13
LATE_S = 0.3


def p2p(pair: Any, folder: Path) -> dict[str, Any]:
    """p2p_main across the link as shaped now: per size, one-way and late-receive times (s)."""
    out = folder / "p2p"
    port = 29900 + os.getpid() % 90
    procs = [pair.popen(n, [sys.executable, str(Path(__file__).resolve()), "p2p", str(n), pair.addresses[0],
                            str(port), str(out)], stderr=subprocess.DEVNULL) for n in (0, 1)]
    for p in procs:
        if p.wait(timeout=300) != 0:
            raise RuntimeError(f"the p2p measurement failed (exit {p.returncode})")
    sent, received = (json.loads(out.with_suffix(f".{n}.json").read_text()) for n in (0, 1))
    collectives = {name: sent.pop(name) for name in ("allreduce", "all_gather", "reduce_scatter") if name in sent}
    return {**{size: {"one_way_s": sent[size]["one_way_s"], "late_receive_s": received[size]["late_receive_s"],
                      "exchange_s": sent[size]["exchange_s"]} for size in sent}, **collectives}


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


def predictor(profile: Any | None, probed: tuple[float, ...] | None) -> Any:
    from autotune.simulate import LinkModel, Predictor

    # the CPU defaults at this host's speed, as the search's own (None: the link's wire alone is wanted)
    link = LinkModel.for_profile(profile) if profile is not None else LinkModel.for_device("cpu")
    if probed is not None:  # (latency, bandwidth[, all-reduce bandwidth[, one machine]]): runs before the probe
        # timed the all-reduce have 2, before it read the boot ids 3 (this bench's two namespaces: one machine)
        link = link.with_probe(inter_latency_s=probed[0], inter_bandwidth_bytes_per_s=probed[1],
                               inter_allreduce_bandwidth_bytes_per_s=probed[2] if len(probed) > 2 else None,
                               nodes_share_host=bool(probed[3]) if len(probed) > 3 else True)
    return Predictor(profile=profile, link=link, gpus_per_node=1)


def fixed_set(pair: Any, folder: Path, steps: int, warmup: int, rates: list[str], repeats: int,
              again: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """The fixed trials across the link, per rate: the probe's (latency s, bandwidth B/s) and every measurement, and
    the candidates of `again` (rate -> candidate dicts) measured again at their rate ("search_runs")."""
    out, extra = folder / "fixed.json", folder / "again.json"
    extra.write_text(json.dumps(again))
    run_nodes(pair, [str(Path(__file__).resolve()), "node", "--out", str(out), "--steps", str(steps),
                     "--warmup", str(warmup), "--tag", pair.tag, "--subnet", str(pair.subnet), "--repeats",
                     str(repeats), "--extra", str(extra), "--rates", *rates],
              folder, timeout_s=2400)
    return json.loads(out.read_text())


def search(pair: Any, folder: Path, trials: int, steps: int, warmup: int) -> dict[str, Any]:
    """The two-node search: its probe line, its choice, and every launched trial with the search's own prediction."""
    import optuna

    from autotune.candidate import Measurement
    from autotune.shared_study import load_records

    argv = ["-m", "autotune", "search", str(MODEL), "--gpus", "2", "--gpus-per-node", "1", "--device", "cpu",
            "--batch-size", str(BATCH), "--trials", str(trials), "--steps", str(steps), "--warmup", str(warmup),
            "--storage", f"sqlite:///{folder / 'study.db'}", "--study-name", "s", "--output",
            str(folder / "autotune.yaml"), "--report-dir", str(folder / "report"), "--json"]
    summary = json.loads(run_nodes(pair, argv, folder, timeout_s=900))
    log = (folder / "node0.log").read_text()
    probe_line = next((line for line in log.splitlines() if "inter-node link" in line), "")
    study = optuna.load_study(study_name="s", storage=f"sqlite:///{folder / 'study.db'}")
    records = load_records(study)[0]
    rows = []
    for r in records:
        if not r.launched or r.candidate is None:
            continue
        predicted = BATCH / r.predicted_throughput_samples_per_s * 1e3 if r.predicted_throughput_samples_per_s else None
        rows.append({"candidate": r.candidate.to_dict(), "status": r.outcome, "measured_ms": r.step_time_ms,
                     "search_predicted_ms": predicted})
    best = Measurement.from_dict(summary["best"]).candidate.key if summary.get("best") else None
    return {"probe_line": probe_line.strip(), "best": best, "rows": rows,
            "pruned": sum(1 for r in records if r.outcome == "pruned")}


def analyse(results: list[dict[str, Any]], profile: Any, profiles: list[dict[str, Any]] | None = None) -> None:
    """Predict every trial of results (in place) with the current simulator over the probe of its rate, and the
    one-node runs over the link inside a node: each from the profile taken right before its rounds (profiles, by
    the run's "profile_index"), else from `profile` (the one taken at the start; runs saved before 2026-11-28 09:23
    have no other)."""
    from autotune.candidate import Candidate, Measurement
    from autotune.costs import Profile
    from autotune.simulate import LinkModel, Predictor

    fresh = [Profile.from_dict(p) for p in profiles or []]
    made: dict[tuple[Any, ...], Any] = {}

    def predict(raw: dict[str, Any] | None, probe: tuple[float, ...] | None, *, one_node: bool = False) -> Any:
        """The predictor for a run (None: the start's profile), one per profile and link."""
        index = raw.get("profile_index") if raw is not None else None
        if index is None or index >= len(fresh):
            index = -1
        key = (index, None if one_node else probe, one_node)
        if key not in made:
            chosen = fresh[index] if index >= 0 else profile
            made[key] = (Predictor(profile=chosen, link=LinkModel.for_profile(chosen))  # both ranks on one node
                         if one_node else predictor(chosen, probe))
        return made[key]

    for e in results:
        probe = tuple(e["fixed"]["probe"]) if e["fixed"]["probe"] else None
        for raw in e["fixed"]["runs"]:
            m = Measurement.from_dict(raw)
            est = predict(raw, probe)(m.candidate)
            raw["predicted_ms"], raw["predicted_allreduce_ms"] = est.step_time_ms, est.allreduce_ms
        for row in e.get("search", {}).get("rows", []):  # the search's own one-shot runs: the start's profile
            row["predicted_ms"] = predict(None, probe)(Candidate.from_dict(row["candidate"])).step_time_ms
        for raw in e["fixed"].get("search_runs", []):
            raw["predicted_ms"] = predict(raw, probe)(Measurement.from_dict(raw).candidate).step_time_ms
        for raw in e.get("one_node", []):
            raw["predicted_ms"] = predict(raw, None, one_node=True)(Measurement.from_dict(raw).candidate).step_time_ms


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rates", nargs="+", default=["none", "200", "20"], help="tbf rates in Mbit/s; none: unshaped")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=1,
                        help="rounds of the fixed set; each trial's median round is compared (the spread is shown)")
    parser.add_argument("--search-trials", type=int, default=3, help="0: no search")
    parser.add_argument("--no-write", action="store_true", help="print, do not write bench/results")
    parser.add_argument("--name", default="internode", help="the results' file name in bench/results")
    parser.add_argument("--from-json", type=Path, help="predict a saved run's measurements again (no namespaces)")
    args = parser.parse_args()

    from autotune.costs import Profile

    if args.from_json:
        saved = json.loads(args.from_json.read_text())
        results = saved["results"]
        analyse(results, Profile.from_dict(saved["profile"]), saved.get("profiles"))
        report(results, saved["profile"], saved["run"], no_write=args.no_write, profiles=saved.get("profiles"),
               name=args.name)
        return

    from _netns import NamespacePair, unavailable

    why = unavailable()
    if why:
        print(f"bench/internode.py: {why}; nothing measured", file=sys.stderr)
        return

    def stop(signum: int, frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):  # SIGINT too: a background job inherits it ignored
        signal.signal(sig, stop)

    from autotune.tune import load_and_profile

    run: dict[str, Any] = {"command": "python " + " ".join([os.path.relpath(sys.argv[0])] + sys.argv[1:]),
                           "started": time.strftime("%H:%M UTC", time.gmtime()), "load_before": os.getloadavg(),
                           "steps": args.steps, "warmup": args.warmup, "search_trials": args.search_trials,
                           "repeats": args.repeats}
    _, profile = load_and_profile(MODEL, BATCH, "cpu", gpus=2)
    results = []
    with NamespacePair() as pair, tempfile.TemporaryDirectory(prefix="internode-") as tmp:
        for rate in args.rates:
            mbit = _mbit(rate)
            pair.shape(mbit)
            tcp = pair.transfer_rate(8 * 2**20 if (mbit or 1e9) >= 100 else 2 * 2**20)
            results.append({"rate_mbit": mbit, "tcp_bytes_per_s": tcp, "p2p": p2p(pair, Path(tmp))})
            print(f"rate {rate}: tcp {tcp * 8 / 1e6:.0f} Mbit/s", file=sys.stderr)
        again: dict[str, list[dict[str, Any]]] = {}
        for rate, entry in zip(args.rates, results):  # the searches first: their trials are measured again below
            if args.search_trials:
                pair.shape(_mbit(rate))
                folder = Path(tmp) / f"search-{rate}"
                folder.mkdir()
                entry["search"] = search(pair, folder, args.search_trials, args.steps, args.warmup)
                again[rate] = [r["candidate"] for r in entry["search"]["rows"] if r["status"] == "ok"]
                print(f"rate {rate}: search: {entry['search']['probe_line']} best {entry['search']['best']}",
                      file=sys.stderr)
        fixed = fixed_set(pair, Path(tmp), args.steps, args.warmup, args.rates, args.repeats, again)
        for rate, entry in zip(args.rates, results):
            entry["fixed"] = fixed[rate]
            if rate == "none":
                entry["one_node"] = fixed["one node"]["runs"]
            print(f"rate {rate}: probe {entry['fixed']['probe']}", file=sys.stderr)
    run["ended"] = time.strftime("%H:%M UTC", time.gmtime())
    run["uptime"] = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    raw = Path(tempfile.gettempdir()) / f"{args.name}-raw.json"  # the measurements, whatever the report does
    raw.write_text(json.dumps(_saved(results, profile.to_dict(), fixed.get("profiles"), run), default=str))
    analyse(results, profile, fixed.get("profiles"))
    report(results, profile.to_dict(), run, no_write=args.no_write, profiles=fixed.get("profiles"), name=args.name)


HOW_TO_READ = """Two network namespaces joined by a veth pair, tbf on both ends (bench/_netns.py), one torchrun node
in each (GLOO_SOCKET_IFNAME = its veth), one CPU rank per node. The probe is the cluster's own (autotune.cluster
Cluster.probe); the TCP stream is a plain socket transfer, for what the shaped link carries (tbf counts headers, so
payload is ~95 % of the rate). Predictions: the simulator with LinkModel.for_profile(profile).with_probe(probe) and
gpus_per_node 1, as the search predicts, from a profile node 0 takes right before each configuration's rounds
(and before each rate's re-measured search trials): this machine's speed drifts over a run, and a profile taken
at the start would measure the drift; the search's own prediction (its own profile) is shown beside. The
searches run first; each trial they launched is then measured again in rounds at its rate, as the fixed set is, and
that median is compared (the search's own one-shot measurement is shown beside it). The fixed
trials run every rate of one configuration back to back (the machine's load drifts), so "what the link added"
(rate minus unshaped, same configuration) is the comparison of the inter-node terms least disturbed by the load;
the unshaped rows' errors are the compute side (profile vs trial on a loaded 2-core machine)."""


def _saved(results: list[dict[str, Any]], profile: dict[str, Any], profiles: list[dict[str, Any]] | None,
           run: dict[str, Any]) -> dict[str, Any]:
    """A run as saved (what --from-json reads)."""
    return {"results": results, "profile": profile, "profiles": profiles, "run": run}


def _as_mbit(bytes_per_s: float | None) -> str:
    return f"{bytes_per_s * 8 / 1e6:.0f}" if bytes_per_s else "-"


def report(results: list[dict[str, Any]], profile: dict[str, Any], run: dict[str, Any], *, no_write: bool,
           profiles: list[dict[str, Any]] | None = None, name: str = "internode") -> None:
    import _results

    from autotune.candidate import Candidate

    probe_rows, trial_rows, added_rows, p2p_rows, reduce_rows, one_node_rows = [], [], [], [], [], []
    shard_rows: list[list[Any]] = []
    unshaped: dict[str, dict[str, Any]] = {}
    for e in results:
        rate = "unshaped" if e["rate_mbit"] is None else f"{e['rate_mbit']:g}"
        probe = e["fixed"]["probe"]
        shaped = e["rate_mbit"] * 1e6 / 8 if e["rate_mbit"] else None
        probe_rows.append([rate, _as_mbit(e["tcp_bytes_per_s"]), _as_mbit(probe[1]) if probe else "failed",
                           _as_mbit(probe[2]) if probe and len(probe) > 2 else "-",
                           f"{probe[0] * 1e6:.0f}" if probe else "-",
                           f"{(probe[1] - shaped) / shaped:+.0%}" if probe and shaped else "-",
                           e.get("search", {}).get("probe_line", "").split("probed): ")[-1]])
        model = predictor(None, tuple(probe) if probe else None).link
        for size, t in e.get("p2p", {}).items():
            if size == "allreduce":
                reduce_rows.append([rate, t["bytes"], t["seconds"] * 1e3, model.allreduce_ms(t["bytes"], 2, 2)])
                continue
            if size in ("all_gather", "reduce_scatter"):
                modelled = (model.all_gather_ms if size == "all_gather" else model.reduce_scatter_ms)(t["bytes"], 2, 2)
                shard_rows.append([rate, size, t["bytes"], t["seconds"] * 1e3, t["all_units_s"] * 1e3 / t["units"],
                                   modelled, model.allreduce_ms(t["bytes"], 2, 2)])
                continue
            p2p_rows.append([rate, size, t["one_way_s"] * 1e3, int(size) / probe[1] * 1e3 if probe else "-",
                             t["exchange_s"] * 1e3, t["late_receive_s"] * 1e3])
        rows: list[tuple[Any, ...]] = [
            ("fixed", Candidate.from_dict(r).key, r["status"], r["step_time_ms"], r["predicted_ms"], None,
             r.get("rounds_ms")) for r in e["fixed"]["runs"]]
        for across, inside in zip(e["fixed"]["runs"], e.get("one_node", [])):  # the same trial on one node

            def cells(r: dict[str, Any]) -> list[Any]:
                measured, predicted = r["step_time_ms"], r["predicted_ms"]
                spread = " / ".join(f"{t:.3g}" if t else "-" for t in r.get("rounds_ms") or [])
                error = f"{(predicted - measured) / measured:+.0%}" if measured and predicted else "-"
                return [measured or "-", spread, predicted or "-", error]

            one_node_rows.append([Candidate.from_dict(across).key, *cells(across), *cells(inside)])
        for r in e["fixed"]["runs"]:  # what the link added over the same trial unshaped, measured and predicted
            key = Candidate.from_dict(r).key
            base = unshaped.get(key)
            if e["rate_mbit"] is None:
                unshaped[key] = r
            elif base and r["step_time_ms"] and base["step_time_ms"]:
                added_rows.append([rate, key, r["step_time_ms"] - base["step_time_ms"],
                                   r["predicted_ms"] - base["predicted_ms"]])
        again = {Candidate.from_dict(r).key: r for r in e["fixed"].get("search_runs", [])}
        for r in e.get("search", {}).get("rows", []):
            key = Candidate.from_dict(r["candidate"]).key
            if key in again:  # measured again in rounds after the search, as the fixed set is: that median compared
                a = again[key]
                rows.append(("search", key, a["status"], a["step_time_ms"], a["predicted_ms"], r["search_predicted_ms"],
                             a.get("rounds_ms"), r["measured_ms"]))
            else:
                rows.append(("search", key, r["status"], r["measured_ms"], r["predicted_ms"], r["search_predicted_ms"],
                             None, r["measured_ms"]))
        for where, key, status, measured, predicted, searched, rounds, *in_search in rows:
            error = f"{(predicted - measured) / measured:+.0%}" if measured and predicted else "-"
            spread = " / ".join(f"{t:.3g}" if t else "-" for t in rounds) if rounds and len(rounds) > 1 else "-"
            trial_rows.append([rate, where, key, status, measured or "-", spread, predicted or "-", error,
                               searched if searched else "-", in_search[0] if in_search and in_search[0] else "-"])
    tables = {
        "probe vs shaping": _results.markdown_table(
            ["tbf rate Mbit/s", "TCP stream Mbit/s", "probe Mbit/s", "probe's all-reduce Mbit/s", "probe latency us",
             "probe vs tbf",
             "the search's probe line"], probe_rows),
        "one message across the link (plain gloo send/recv, best of 3)": _results.markdown_table(
            ["tbf rate Mbit/s", "bytes", "one-way ms", "bytes / probed bandwidth ms", "one each way at once ms",
             "receive posted 300 ms after its send ms"], p2p_rows),
        "the dp all-reduce's collective across the link (gloo all_reduce of one flat tensor, 2 ranks)":
            _results.markdown_table(["tbf rate Mbit/s", "bytes", "measured ms", "LinkModel.allreduce_ms"],
                                    reduce_rows),
        "FSDP2's collectives of one unit across the link (gloo, 2 ranks; best of 2 after one)": _results.markdown_table(
            ["tbf rate Mbit/s", "collective", "unit bytes", "one ms", "each of 13 back to back ms",
             "LinkModel (probed)", "LinkModel.allreduce_ms of the unit"], shard_rows),
        "trials: predicted (probed link) vs measured step time": _results.markdown_table(
            ["tbf rate Mbit/s", "set", "candidate", "outcome", "measured ms", "rounds ms", "predicted ms", "error",
             "the search's own prediction ms", "the search's own measurement ms"], trial_rows),
        "unshaped: across the link and the same trial with both ranks on node 0": _results.markdown_table(
            ["candidate", "across: measured ms", "rounds ms", "predicted ms", "error", "one node: measured ms",
             "rounds ms", "predicted ms (one node)", "error"], one_node_rows),
        "what the link added: step time at the rate minus the same trial's unshaped": _results.markdown_table(
            ["tbf rate Mbit/s", "candidate", "measured ms", "predicted ms"], added_rows),
        "searches": _results.markdown_table(
            ["tbf rate Mbit/s", "chosen", "launched", "pruned on a prediction"],
            [["unshaped" if e["rate_mbit"] is None else f"{e['rate_mbit']:g}", e["search"]["best"],
              len(e["search"]["rows"]), e["search"]["pruned"]] for e in results if "search" in e]),
    }
    notes = (f"{HOW_TO_READ}\n\nMeasured by `{run.get('command', '?')}` from {run['started']} to "
             f"{run.get('ended', '?')}; load average before "
             f"{run['load_before'][0]:.2f}, `uptime` after: {run.get('uptime', '?')}. Steps {run['steps']}, "
             f"rounds {run.get('repeats', 1)}, warmup {run['warmup']}, search trials {run['search_trials']}, "
             f"batch {BATCH}, model bench/models/mlp13.py.")
    if no_write:
        _results.show(tables)
        print(notes)
        out = Path(tempfile.gettempdir()) / "internode-last.json"
        out.write_text(json.dumps(_saved(results, profile, profiles, run), default=str))
        print(f"(raw data: {out})")
        return
    _results.write(name, title="Inter-node model over a shaped link (two namespaces, tbf)", device="cpu",
                   tables=tables, data=_saved(results, profile, profiles, run),
                   notes=notes)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "p2p":
        p2p_main(int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), Path(sys.argv[5]))
    elif len(sys.argv) > 1 and sys.argv[1] == "node":
        node_args = argparse.ArgumentParser()
        node_args.add_argument("node")
        node_args.add_argument("--out", type=Path, required=True)
        node_args.add_argument("--steps", type=int, required=True)
        node_args.add_argument("--warmup", type=int, required=True)
        node_args.add_argument("--rates", nargs="+", required=True)
        node_args.add_argument("--tag", required=True)
        node_args.add_argument("--subnet", type=int, required=True)
        node_args.add_argument("--repeats", type=int, default=1)
        node_args.add_argument("--extra", type=Path)
        a = node_args.parse_args()
        node_main(a.out, a.steps, a.warmup, a.rates, a.tag, a.subnet, a.repeats, a.extra)
    else:
        try:
            main()
        except KeyboardInterrupt as stopped:
            print(f"bench/internode.py: interrupted ({stopped or 'Ctrl-C'}); the namespaces are removed",
                  file=sys.stderr)
            sys.exit(130)
