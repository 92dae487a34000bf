"""Where a CPU rank's core goes beside its own thread: gloo's device thread, woken for every message, and what each
wake of a thread on a computing core costs that computation.

Two-rank trials on the CPU stand-in run their stages' compute slower than the profile timed it alone (traced by
bench/action_trace.py: 1.3-1.9 x on the 13-layer MLP at 16 samples a micro-batch, 2026-12-06 and -07), and a
one-rank trial of the same model does not. Ruled out elsewhere: two busy one-thread processes side by side, the
caches (a stage timed after 8 MB was touched: within 7 %, a /tmp script). What a rank process has that the profile
has not: gloo's threads.

Part 0 (the host): one and two busy processes spinning for --host-seconds: the steal time /proc/stat counts per CPU
over it, and the share of each spinning loop's time lost in gaps over 0.5 ms (a CPU quota's throttling, or a host
that deschedules the vCPU, shows there).

Part 1 (trials): each --configs SCHEDULE/M/SPLIT of --model runs once short (its step time) and once long enough to
sample --seconds of steady steps; over that window, from /proc (each thread's stat and status), per rank and step:
the rank's own thread's CPU, its voluntary and involuntary context switches (an involuntary one: another thread took
its core), and gloo's device thread's (gloo_tcp_loop) CPU and wakes (its voluntary switches); per message event
(each send or receive a rank takes part in: 2 x M x the stage boundaries that cross ranks), gloo's CPU and wakes.

Part 2 (wakes, needs 2 cores): a one-thread MLP's forward and backward timed on core 0 while a thread of another
process, pinned to core 0 and blocked on a pipe, is woken from core 1 --wake-rates times a second: the compute's
slowdown, the woken thread's own CPU per wake, and what each wake cost the compute (its loss over the wakes),
in alternating rounds.

Part 3 (--rounds-against-trials N): does the wake's cost at one moment tell how far that moment's trials run from
their prediction? Each round: the wake probe (2000 wakes a second against none, 1.5 s each), a fresh profile, each
--configs as one trial predicted from that profile; the correlation over rounds of the probe with the errors.

    python bench/rank_threads.py --model bench/models/mlp13.py --batch-size 128 \\
        --configs GPipe/1/7,6 1F1B/8/7,6 VHalf/8/4,3,3,3 DualPipeV/16/4,3,3,3 Interleaved1F1B/8/1,3,5,4

Not a test: it measures the machine as it is; run it with nothing else busy.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _results  # noqa: E402
from action_trace import parse_config  # noqa: E402

GLOO_THREAD = "gloo_tcp_loop"
LEAD_S = 6.0
"""Seconds a long trial runs before the window opens (rank start-up and warm-up)."""


def thread_counters() -> dict[tuple[int, int], dict[str, Any]]:
    """Every thread of every rank process (a fork-server child with a gloo thread): CPU ticks and context switches."""
    out: dict[tuple[int, int], dict[str, Any]] = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if b"forkserver" not in (proc / "cmdline").read_bytes():
                continue
            threads = {}
            for task in (proc / "task").iterdir():
                stat = (task / "stat").read_text()
                name = stat[stat.index("(") + 1:stat.rindex(")")]
                fields = stat[stat.rindex(")") + 2:].split()
                status = dict(line.split(":", 1) for line in (task / "status").read_text().splitlines() if ":" in line)
                threads[int(task.name)] = {"name": name, "ticks": int(fields[11]) + int(fields[12]),
                                           "voluntary": int(status["voluntary_ctxt_switches"]),
                                           "involuntary": int(status["nonvoluntary_ctxt_switches"])}
        except (OSError, ValueError, KeyError):
            continue
        if any(t["name"] == GLOO_THREAD for t in threads.values()):
            for tid, counters in threads.items():
                out[(int(proc.name), tid)] = counters
    return out


def message_events(candidate) -> int:
    """Sends and receives one rank takes part in per step: each crossing stage boundary carries an activation and a
    gradient per micro-batch, one rank sending and the other receiving each."""
    from autotune.schedules import stage_ranks

    ranks = stage_ranks(candidate.schedule, candidate.pipeline_degree, len(candidate.layers_per_stage))
    crossing = sum(1 for a, b in zip(ranks, ranks[1:]) if a != b)
    return 2 * candidate.n_microbatches * crossing


def sample_trial(spec, candidate, seconds: float) -> dict[str, Any]:
    from autotune.trial import TrialOptions, run_trial

    short = run_trial(spec, candidate, TrialOptions(steps=5, warmup=2, device="cpu"))
    if short.status != "ok":
        raise SystemExit(f"{candidate.key}: the short trial ended {short.status}: {short.error}")
    steps = int((LEAD_S + seconds + 3.0) * 1000 / short.step_time_ms) + 1
    window: dict[str, Any] = {}

    def watch() -> None:
        time.sleep(LEAD_S)
        before, start = thread_counters(), time.perf_counter()
        time.sleep(seconds)
        window.update(before=before, after=thread_counters(), wall_s=time.perf_counter() - start)

    watcher = threading.Thread(target=watch)
    watcher.start()
    long = run_trial(spec, candidate, TrialOptions(steps=steps, warmup=2, device="cpu",
                                                   timeout_s=LEAD_S + seconds + 120))
    watcher.join()
    if long.status != "ok":
        raise SystemExit(f"{candidate.key}: the long trial ended {long.status}: {long.error}")
    tick_ms = 1000 / os.sysconf("SC_CLK_TCK")
    per_step = window["wall_s"] * 1000 / long.step_time_ms
    events = message_events(candidate)
    ranks = []
    for (pid, tid), after in window["after"].items():
        before = window["before"].get((pid, tid))
        if before is None or tid != pid:
            continue
        gloo = [(key, counters) for key, counters in window["after"].items()
                if key[0] == pid and counters["name"] == GLOO_THREAD and key in window["before"]]

        def delta(key, counters, field):
            return (counters[field] - window["before"][key][field]) / per_step

        gloo_ms = sum(delta(k, c, "ticks") for k, c in gloo) * tick_ms
        gloo_wakes = sum(delta(k, c, "voluntary") for k, c in gloo)
        ranks.append({"main_ms": (after["ticks"] - before["ticks"]) * tick_ms / per_step,
                      "main_voluntary": (after["voluntary"] - before["voluntary"]) / per_step,
                      "main_involuntary": (after["involuntary"] - before["involuntary"]) / per_step,
                      "gloo_ms": gloo_ms, "gloo_wakes": gloo_wakes,
                      "gloo_us_per_event": gloo_ms * 1000 / events if events else None,
                      "gloo_wakes_per_event": gloo_wakes / events if events else None})
    ranks.sort(key=lambda r: -r["main_ms"])
    return {"candidate": candidate.key, "step_ms": long.step_time_ms, "steps_sampled": per_step,
            "message_events": events, "ranks": ranks}


# --- part 0: the host ---------------------------------------------------------------------------------------------

def _cpu_times() -> dict[str, list[int]]:
    with open("/proc/stat") as stat:
        rows = [line.split() for line in stat]
    return {f[0]: [int(x) for x in f[1:9]] for f in rows if f[0].startswith("cpu") and f[0] != "cpu"}


def _spin(seconds: float, queue) -> None:
    lost, end, last = 0.0, time.perf_counter() + seconds, time.perf_counter()
    while last < end:
        now = time.perf_counter()
        if now - last > 0.0005:
            lost += now - last
        last = now
    queue.put(lost / seconds)


def host_checks(seconds: float) -> list[dict[str, Any]]:
    context = multiprocessing.get_context("fork")
    rows = []
    for busy in (1, 2):
        queue = context.Queue()
        spinners = [context.Process(target=_spin, args=(seconds, queue)) for _ in range(busy)]
        before = _cpu_times()
        for p in spinners:
            p.start()
        lost = [queue.get() for _ in spinners]
        for p in spinners:
            p.join()
        after = _cpu_times()
        steal = {cpu: (after[cpu][7] - before[cpu][7]) / max(1, sum(after[cpu]) - sum(before[cpu])) for cpu in after}
        rows.append({"busy": busy, "steal": steal, "lost": lost})
    return rows


# --- part 2: a wake on a computing core -------------------------------------------------------------------------

def _compute(seconds: float, queue) -> None:
    os.sched_setaffinity(0, {0})
    step = _timed_step()
    queue.put("ready")
    times, end = [], time.time() + seconds
    while time.time() < end:
        times.append(step())
    queue.put(statistics.median(times))


def _timed_step():
    """The fixed workload, one thread, warmed up: 7 Linear(256) + GELU blocks' forward and backward at 16 samples;
    returns a function that runs it once and says its ms."""
    import torch
    from torch import nn

    torch.set_num_threads(1)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(256, 256), nn.GELU()) for _ in range(7)])
    x = torch.randn(16, 256)
    for _ in range(50):
        model(x).sum().backward()

    def step() -> float:
        start = time.perf_counter()
        model(x).sum().backward()
        return (time.perf_counter() - start) * 1e3

    return step


def _windows(seconds: float, window_s: float, queue) -> None:
    step = _timed_step()
    medians, end = [], time.perf_counter() + seconds
    while time.perf_counter() < end:
        times, close = [], time.perf_counter() + window_s
        while time.perf_counter() < close:
            times.append(step())
        medians.append(statistics.median(times))
    queue.put(medians)


def host_spread(seconds: float = 6.0, window_s: float = 0.5) -> dict[str, Any]:
    """How steadily this machine computes now: part 2's one-thread step, no wakes, in a fresh process for `seconds`;
    the median of each `window_s`, and their lowest, median, highest and highest / lowest. A calibration's errors on
    a host whose windows spread 1.5 x measure the host as much as the simulator (bench/results/rank_threads.md)."""
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    process = context.Process(target=_windows, args=(seconds, window_s, queue))
    process.start()
    medians = queue.get()
    process.join()
    return {"time": time.strftime("%H:%M:%S"), "windows_ms": medians, "lowest_ms": min(medians),
            "median_ms": statistics.median(medians), "highest_ms": max(medians),
            "spread": max(medians) / min(medians)}


def spread_table(spreads: dict[str, dict[str, Any]]) -> str:
    return _results.markdown_table(
        ["when", "time", "lowest ms", "median ms", "highest ms", "highest / lowest"],
        [[when, h["time"], h["lowest_ms"], h["median_ms"], h["highest_ms"], h["spread"]]
         for when, h in spreads.items()])


def _woken(read_fd: int, core: int, queue) -> None:
    os.sched_setaffinity(0, {core})
    wakes, cpu = 0, time.process_time()
    while os.read(read_fd, 1) == b"w":
        wakes += 1
    queue.put((wakes, time.process_time() - cpu))


def _waker(write_fd: int, rate: float, seconds: float) -> None:
    """From core 1: a byte into the pipe `rate` times a second (0: spins as busy, writing nothing)."""
    os.sched_setaffinity(0, {1})
    end, due = time.time() + seconds, time.perf_counter()
    while time.time() < end:
        if rate:
            due += 1.0 / rate
            while time.perf_counter() < due and time.time() < end:
                pass
            os.write(write_fd, b"w")
    os.write(write_fd, b"x")


def wake_round(rate: float, seconds: float, woken_core: int = 0) -> dict[str, Any]:
    context = multiprocessing.get_context("fork")
    queue, woken_queue = context.Queue(), context.Queue()
    compute = context.Process(target=_compute, args=(seconds + 0.5, queue))
    compute.start()
    queue.get()
    read_fd, write_fd = os.pipe()
    woken = context.Process(target=_woken, args=(read_fd, woken_core, woken_queue))
    waker = context.Process(target=_waker, args=(write_fd, rate, seconds))
    woken.start()
    waker.start()
    step_ms = queue.get()
    wakes, cpu_s = woken_queue.get()
    for process in (compute, woken, waker):
        process.join()
    os.close(read_fd)
    os.close(write_fd)
    return {"rate": rate, "step_ms": step_ms, "wakes_per_s": wakes / seconds,
            "woken_us_per_wake": cpu_s * 1e6 / wakes if wakes else None}


def wake_costs(rates: list[float], rounds: int, seconds: float) -> list[dict[str, Any]]:
    """Per rate, woken on the compute's core (0); and the highest rate woken on the waker's core (1) instead, the
    control: the same wakes, none of them on the computing core."""
    settings = [(0.0, 0)] + [(r, 0) for r in rates] + [(max(rates), 1)]
    per_setting: dict[tuple[float, int], list[dict[str, Any]]] = {s: [] for s in settings}
    for k in range(rounds):
        for rate, core in settings[k % len(settings):] + settings[:k % len(settings)]:
            per_setting[(rate, core)].append(wake_round(rate, seconds, core))
    base = statistics.median(r["step_ms"] for r in per_setting[(0.0, 0)])
    rows = []
    for (rate, core), runs in per_setting.items():
        step = statistics.median(r["step_ms"] for r in runs)
        row = {"rate": rate, "woken_core": core, "step_ms": step, "slowdown": step / base - 1,
               "runs_ms": [r["step_ms"] for r in runs]}
        if rate:
            wakes = statistics.median(r["wakes_per_s"] for r in runs)
            own = statistics.median(r["woken_us_per_wake"] for r in runs)
            # the compute ran (1 + slowdown) x longer per step: of each second, slowdown / (1 + slowdown) went
            # elsewhere, over `wakes` wakes
            lost = row["slowdown"] / (1 + row["slowdown"]) * 1e6 / wakes
            row.update(wakes_per_s=wakes, woken_us_per_wake=own, compute_lost_us_per_wake=lost)
        rows.append(row)
    return rows


def correlation(xs: list[float], ys: list[float]) -> float:
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    spread = statistics.pstdev(xs) * statistics.pstdev(ys)
    return statistics.fmean((x - mx) * (y - my) for x, y in zip(xs, ys)) / spread if spread else float("nan")


def against_trials(path: Path, spec, candidates: list, batch_size: int, rounds: int) -> list[dict[str, Any]]:
    from calibrate import fresh_profile

    from autotune.costs import Profile
    from autotune.simulate import simulate
    from autotune.trial import TrialOptions, run_trial

    out = []
    for _ in range(rounds):
        base, woken = wake_round(0.0, 1.5), wake_round(2000.0, 1.5)
        slower = woken["step_ms"] / base["step_ms"]
        profile = Profile.from_dict(fresh_profile(path, batch_size=batch_size, device="cpu", precision="fp32"))
        errors = {}
        for c in candidates:
            measured = run_trial(spec, c, TrialOptions(steps=10, warmup=2, device="cpu")).step_time_ms
            errors[c.key] = simulate(profile, c, with_timeline=False).step_time_ms / measured - 1
        out.append({"time": time.strftime("%H:%M:%S"), "woken_us_per_wake": woken["woken_us_per_wake"],
                    "compute_lost_us_per_wake": (slower - 1) / slower * 1e6 / woken["wakes_per_s"],
                    "errors": errors})
        print(out[-1], flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="bench/models/mlp13.py")
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--configs", nargs="*", default=["GPipe/1/7,6", "1F1B/8/7,6", "VHalf/8/4,3,3,3",
                                                         "DualPipeV/16/4,3,3,3", "Interleaved1F1B/8/1,3,5,4"],
                        help="SCHEDULE/M/SPLIT, two ranks (bench/action_trace.py's form)")
    parser.add_argument("--seconds", type=float, default=5.0, help="the sampled window of each trial")
    parser.add_argument("--wake-rates", type=float, nargs="*", default=[500, 1000, 2000, 5000],
                        help="wakes a second in part 2 (none: part 2 skipped)")
    parser.add_argument("--wake-rounds", type=int, default=4)
    parser.add_argument("--wake-seconds", type=float, default=4.0)
    parser.add_argument("--rounds-against-trials", type=int, default=0)
    parser.add_argument("--host-seconds", type=float, default=8.0, help="part 0's spin (0: part 0 skipped)")
    parser.add_argument("--name", default="rank_threads")
    args = parser.parse_args()
    if not Path("/proc/self/task").is_dir():
        raise SystemExit("bench/rank_threads.py reads threads from /proc: run it on Linux")

    from autotune.model_file import load_model_file
    from autotune.trial import server

    host = host_checks(args.host_seconds) if args.host_seconds else []
    server.start()
    spec = load_model_file(Path(args.model))
    # --configs with nothing after it: part 2 alone
    trials = [sample_trial(spec, parse_config(c, args.batch_size), args.seconds) for c in args.configs]
    wakes = []
    if args.wake_rates:
        if len(os.sched_getaffinity(0)) < 2:
            print("part 2 skipped: it pins a compute to core 0 and its waker to core 1, and this process has one core")
        else:
            wakes = wake_costs(args.wake_rates, args.wake_rounds, args.wake_seconds)

    rounds = []
    if args.rounds_against_trials:
        rounds = against_trials(Path(args.model), spec, [parse_config(c, args.batch_size) for c in args.configs],
                                args.batch_size, args.rounds_against_trials)

    def pair(rows: list[dict], key: str, digits: int = 2) -> str:
        return " / ".join("-" if r[key] is None else f"{r[key]:.{digits}f}" for r in rows)

    tables = {}
    if host:
        tables["part 0: the host, processes spinning"] = _results.markdown_table(
            ["busy processes", "steal time per CPU", "a spinning loop's time lost in gaps over 0.5 ms"],
            [[h["busy"], " / ".join(f"{cpu} {v:.2%}" for cpu, v in sorted(h["steal"].items())),
              " / ".join(f"{x:.2%}" for x in h["lost"])] for h in host])
    heading = f"{args.model}, B {args.batch_size}, 2 ranks: per step (rank / rank, the busier first)"
    tables.update({
        heading: _results.markdown_table(
            ["candidate", "step ms", "message events a rank", "rank thread CPU ms", "its voluntary switches",
             "its involuntary switches", "gloo thread CPU ms", "gloo wakes", "gloo us per event",
             "gloo wakes per event"],
            [[t["candidate"], t["step_ms"], t["message_events"], pair(t["ranks"], "main_ms"),
              pair(t["ranks"], "main_voluntary", 1), pair(t["ranks"], "main_involuntary", 1),
              pair(t["ranks"], "gloo_ms"), pair(t["ranks"], "gloo_wakes", 1),
              pair(t["ranks"], "gloo_us_per_event", 0), pair(t["ranks"], "gloo_wakes_per_event", 2)]
             for t in trials]),
    })
    if wakes:
        tables["a wake on a computing core (7 Linear(256) blocks, micro-batch 16, one thread on core 0; medians)"] = \
            _results.markdown_table(
                ["wakes a second (asked)", "woken on core", "wakes a second", "compute step ms", "runs ms", "slowdown",
                 "woken thread's CPU us per wake", "compute lost us per wake"],
                [[w["rate"], w["woken_core"], w.get("wakes_per_s", 0.0), w["step_ms"],
                  " / ".join(f"{x:.3f}" for x in w["runs_ms"]),
                  f"{w['slowdown']:+.1%}", w.get("woken_us_per_wake", "-"), w.get("compute_lost_us_per_wake", "-")]
                 for w in wakes])
    if rounds:
        keys = list(rounds[0]["errors"])
        tables["part 3: the wake probe against each round's trials (error: predicted / measured - 1)"] = \
            _results.markdown_table(
                ["round", "woken thread us per wake", "compute lost us per wake", *keys],
                [[r["time"], r["woken_us_per_wake"], r["compute_lost_us_per_wake"],
                  *(f"{r['errors'][k]:+.0%}" for k in keys)] for r in rounds])
        tables["part 3: correlation over the rounds"] = _results.markdown_table(
            ["candidate", "with the woken thread's us per wake", "with the compute's loss per wake",
             "median error", "errors' range"],
            [[k, correlation([r["woken_us_per_wake"] for r in rounds], [r["errors"][k] for r in rounds]),
              correlation([r["compute_lost_us_per_wake"] for r in rounds], [r["errors"][k] for r in rounds]),
              f"{statistics.median(r['errors'][k] for r in rounds):+.0%}",
              f"{min(r['errors'][k] for r in rounds):+.0%} .. {max(r['errors'][k] for r in rounds):+.0%}"]
             for k in keys])
    _results.write(args.name, title="A CPU rank's core beside its own thread: gloo's device thread, and wakes",
                   device="cpu", tables=tables, data={"host": host, "trials": trials, "wakes": wakes, "rounds": rounds},
                   notes=__doc__)


if __name__ == "__main__":
    main()
