"""Where a trial's step goes, action by action, against the simulator's replay of the same candidate.

Runs real trials (2 ranks) with a tracer in every rank (bench/_trace_site: each pipeline action, the stage module's
own forward and backward inside it, each post and wait of a send/receive, the optimizer step) and splits each
rank's step into terms the simulator has one of each:

- compute: the stage module's forward and backward (and W) as the runtime ran them, against the profile's sum of
  the stage's layers at the micro-batch size (the simulator's compute without overheads): "compute / profile";
- action overhead: what an action took beyond the module's own time (the runtime's bookkeeping), per action;
- post: what posting a batch of sends/receives took the rank, per post;
- hand-off: from the sender's post of an activation or gradient to the end of the receiver's wait for it, where the
  receiver was already waiting (the message's own latency on the link);
- optimizer: the rank's step, against the simulator's;
- the rest: the step less all of the above and the waits (the schedule's own Python, the loss, zero_grad);
- slow posts: posts that took over SLOW_POST_MS (a post is ~0.05 ms; on the CPU stand-in some take ~3 ms, gloo's
  device thread spinning while the two ranks post to each other at once: bench/gloo_cross.py says why): how many a
  step, and the ms they took;
- crossing posts: of the posts that began within CROSSING_MS of one of the other rank's, how many were slow, and
  what they cost per crossing post, beside the other posts' share (LinkModel.crossing_post_ms charges the expected
  cost where the replay's posts cross; the prediction without it is shown beside).

    python bench/action_trace.py --model bench/models/tail_heavy7.py --batch-size 64 \\
        --configs VMin/1/2,2,1,2 1F1B/8/4,3

Each config is SCHEDULE/M/SPLIT (M micro-batches). Medians over the measured steps of each of --repeats trials.
"""

from __future__ import annotations

import argparse
import bisect
import collections
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _results  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SLOW_POST_MS = 1.0
"""A post (one _batch_p2p call) longer than this is counted slow."""
CROSSING_MS = 0.1
"""A post that begins this close to one of the other rank's crosses it (LinkModel.crossing_post_ms)."""
SITE = Path(__file__).resolve().parent / "_trace_site"


def parse_config(text: str, batch_size: int, precision: str = "fp32"):
    from autotune.candidate import Candidate
    from autotune.schedules import Schedule

    schedule, m, split = text.split("/")
    return Candidate(schedule=Schedule(schedule), pipeline_degree=2, global_batch_size=batch_size,
                     n_microbatches=int(m), layers_per_stage=tuple(int(x) for x in split.split(",")),
                     precision=precision)


def read_traces(folder: Path, warmup: int) -> list[list[list[list]]]:
    """Per rank (the one holding stage 0 first), its steps, each a list of events; warm-up steps dropped."""
    ranks = []
    for path in folder.glob("*.jsonl"):
        steps, current = [], []
        for line in path.read_text().splitlines():
            event = json.loads(line)
            current.append(event)
            if event[0] == "step":
                steps.append(current)
                current = []
        ranks.append(steps)
    ranks.sort(key=lambda steps: min(e[3] for e in steps[0] if e[0] == "F"))  # rank 0 holds stage 0
    return [steps[warmup:] for steps in ranks]


def handoffs(sender: list[list], receiver: list[list]) -> list[float]:
    """ms from the sender's post after each action to the end of the receiver's wait before the matching action,
    where that wait began before the post ended (the receiver was waiting for this message)."""
    out = []
    posts = [e for e in sender if e[0] == "post"]
    actions = [e for e in sender if e[0] in ("F", "B", "I")]
    for action in actions:
        after = next((p for p in posts if p[1] >= action[2]), None)
        if after is None:
            continue
        target = action[3] + 1 if action[0] == "F" else action[3] - 1
        kinds = ("F",) if action[0] == "F" else ("B", "I")
        matching = next((i for i, e in enumerate(receiver)
                         if e[0] in kinds and e[3] == target and e[4] == action[4]), None)
        if matching is None:
            continue
        wait = next((e for e in reversed(receiver[:matching]) if e[0] == "wait"), None)
        if wait is not None and wait[1] < after[2] <= wait[2]:
            out.append((wait[2] - after[2]) * 1e3)
    return out


def crossing_posts(mine: list[list], other: list[list]) -> tuple[list[float], list[float]]:
    """One rank's step: ms of each of its posts that began within CROSSING_MS of a post of the other rank's (the
    same step), and of the rest (LinkModel.crossing_post_ms)."""
    starts = sorted(e[1] for e in other if e[0] == "post" and e[4] > 0)
    near, far = [], []
    for kind, start, end, _, n in mine:
        if kind != "post" or n == 0:
            continue
        k = bisect.bisect_left(starts, start - CROSSING_MS / 1e3)
        close = k < len(starts) and starts[k] <= start + CROSSING_MS / 1e3
        (near if close else far).append((end - start) * 1e3)
    return near, far


IDLE_BUCKETS_MS = (0.5, 2.0, 5.0)
"""Edges of the idle-gap buckets of after_idle: an action begun within 0.5 ms of the rank's previous busy end, 0.5-2,
2-5, over 5 ms."""


def after_idle(events: list[list], profiled: dict[tuple[int, str], float]) -> list[tuple[float, float]]:
    """One rank's step: (idle gap ms, the module's time / the profile's) for each compute action, the gap from the
    end of the rank's previous action or optimizer step (waits and posts between count as idle) to its start
    (LinkModel.idle_resume_ms charges what such a gap costs); profiled[(stage, kind)] is the bare replay's duration
    of one such action."""
    busy_end, out = None, []
    modules = [e for e in events if e[0].startswith("module_")]
    for kind, start, end, stage, _ in events:
        if kind == "opt":
            busy_end = end
        if kind not in ("F", "B", "I", "W"):
            continue
        base = profiled.get((stage, kind))
        if busy_end is not None and base:
            inside = sum(m[2] - m[1] for m in modules if start <= m[1] and m[2] <= end)
            out.append(((start - busy_end) * 1e3, inside * 1e3 / base))
        busy_end = end
    return out


def idle_buckets(pairs: list[tuple[float, float]]) -> list[dict]:
    """after_idle's pairs by IDLE_BUCKETS_MS: each bucket's action count and median compute / profile."""
    edges = (0.0, *IDLE_BUCKETS_MS, float("inf"))
    out = []
    for low, high in zip(edges, edges[1:]):
        ratios = [r for gap, r in pairs if low <= gap < high]
        out.append({"from_ms": low, "to_ms": high, "actions": len(ratios),
                    "compute_over_profile": statistics.median(ratios) if ratios else None})
    return out


def split_step(events: list[list]) -> dict[str, float]:
    """One rank's step in ms per term."""
    total = collections.defaultdict(float)
    counts = collections.Counter()
    for kind, start, end, *_ in events:
        total[kind] += (end - start) * 1e3
        counts[kind] += 1
        if kind == "post" and (end - start) * 1e3 > SLOW_POST_MS:
            total["slow_post"] += (end - start) * 1e3
            counts["slow_post"] += 1
    compute = total["module_F"] + total["module_B"]  # B, I and W each run the module's backward once
    actions = total["F"] + total["B"] + total["I"] + total["W"]
    n_actions = counts["F"] + counts["B"] + counts["I"] + counts["W"]
    return {
        "step": total["step"], "compute": compute, "action_overhead": actions - compute,
        "actions": n_actions, "post": total["post"], "posts": counts["post"], "wait": total["wait"],
        "optimizer": total["opt"], "slow_posts": counts["slow_post"], "slow_post_ms": total["slow_post"],
        "rest": total["step"] - actions - total["post"] - total["wait"] - total["opt"],
    }


def trace_config(spec, profile, candidate, *, steps: int, warmup: int, repeats: int, folder: Path) -> dict:
    from dataclasses import replace

    import autotune.simulate as simulator
    from autotune.simulate import LinkModel, simulate
    from autotune.trial import TrialOptions, run_trial

    link = LinkModel.for_profile(profile)  # as the search predicts: the host's probes applied
    estimate = simulate(profile, candidate, link=link)
    gates = simulator._send_gates  # beside: the replay before GPipe and 1F1B waited for their sends (2026-11-28)
    simulator._send_gates = lambda *args: None
    try:
        ungated = simulate(profile, candidate, link=link)
    finally:
        simulator._send_gates = gates
    uncrossed = simulate(profile, candidate, link=replace(link, crossing_post_ms=0.0))
    unresumed = simulate(profile, candidate, link=replace(link, idle_resume_ms=()))
    # the profile's compute alone: no overheads, no slowdown, sends not on the rank, no crossing posts (the replay
    # adds their charge to the action's duration)
    bare = simulate(profile, candidate, link=replace(link, per_action_overhead_ms=0.0, message_overhead_ms=0.0,
                                                     held_activation_ms_per_mib=0.0, compute_slowdown=0.0,
                                                     sends_on_rank=False, crossing_post_ms=0.0,
                                                     idle_resume_ms=()))
    sim_compute = collections.defaultdict(float)
    profiled: dict[tuple[int, str], float] = {}
    for event in bare.timeline:
        sim_compute[event.rank] += event.end_ms - event.start_ms
        profiled[(event.stage, event.kind)] = event.end_ms - event.start_ms
    idle: dict[int, list[tuple[float, float]]] = collections.defaultdict(list)
    measured, per_rank, hands = [], collections.defaultdict(list), []
    crossing: list[float] = []
    apart: list[float] = []
    for r in range(repeats):
        result = run_trial(spec, candidate, TrialOptions(steps=steps, warmup=warmup, device="cpu"))
        if result.step_time_ms is None:
            raise SystemExit(f"{candidate.key}: trial failed: {result.error}")
        measured.append(result.step_time_ms)
        run = folder / f"{candidate.key}-{r}".replace("/", "_")
        run.mkdir()
        for trace in folder.glob("*.jsonl"):  # the ranks write beside it (the fork server's environment is fixed)
            trace.rename(run / trace.name)
        ranks = read_traces(run, warmup)
        for rank, rank_steps in enumerate(ranks):
            for step_events in rank_steps:
                per_rank[rank].append(split_step(step_events))
                idle[rank] += after_idle(step_events, profiled)
        for s in range(min(len(ranks[0]), len(ranks[1]))):
            hands += handoffs(ranks[0][s], ranks[1][s]) + handoffs(ranks[1][s], ranks[0][s])
            for mine, other in ((ranks[0][s], ranks[1][s]), (ranks[1][s], ranks[0][s])):
                near, far = crossing_posts(mine, other)
                crossing += near
                apart += far

    def median(rank: int, key: str) -> float:
        return statistics.median(d[key] for d in per_rank[rank])

    ranks_out = []
    for rank in sorted(per_rank):
        actions, posts = median(rank, "actions"), median(rank, "posts")
        ranks_out.append({
            "rank": rank, "step_ms": median(rank, "step"), "compute_ms": median(rank, "compute"),
            "profile_compute_ms": sim_compute[rank],
            "action_overhead_ms_per_action": median(rank, "action_overhead") / max(actions, 1),
            "post_ms_per_post": median(rank, "post") / max(posts, 1), "posts": posts,
            "wait_ms": median(rank, "wait"), "optimizer_ms": median(rank, "optimizer"), "rest_ms": median(rank, "rest"),
            "slow_posts": median(rank, "slow_posts"), "slow_post_ms": median(rank, "slow_post_ms"),
            "actions": actions, "after_idle": idle_buckets(idle[rank]),
        })
    return {"candidate": candidate.key, "candidate_dict": candidate.to_dict(),
            "measured_ms": statistics.median(measured), "measured_runs_ms": measured,
            "predicted_ms": estimate.step_time_ms, "predicted_ungated_ms": ungated.step_time_ms,
            "predicted_optimizer_ms": estimate.optimizer_ms,
            "handoff_ms_median": statistics.median(hands) if hands else None, "handoffs": len(hands),
            "predicted_uncrossed_ms": uncrossed.step_time_ms,
            "predicted_unresumed_ms": unresumed.step_time_ms,
            "crossing_posts": len(crossing), "crossing_slow": sum(x > SLOW_POST_MS for x in crossing),
            "crossing_slow_ms": [x for x in crossing if x > SLOW_POST_MS],
            "apart_posts": len(apart), "apart_slow": sum(x > SLOW_POST_MS for x in apart),
            "apart_slow_ms": [x for x in apart if x > SLOW_POST_MS],
            "ranks": ranks_out}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--configs", nargs="+", required=True, help="SCHEDULE/M/SPLIT, e.g. VMin/1/2,2,1,2")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--name", default="action_trace")
    parser.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    parser.add_argument("--no-write", action="store_true", help="print each row's JSON, write no bench/results")
    args = parser.parse_args()
    if os.environ.get("AUTOTUNE_TRACE_DIR") is None:
        # the tracer must be in the fork server's environment before it starts: re-run this script with it
        env = {**os.environ, "AUTOTUNE_TRACE_DIR": tempfile.mkdtemp(prefix="autotune-trace-"),
               "PYTHONPATH": os.pathsep.join(filter(None, [str(SITE), str(ROOT), os.environ.get("PYTHONPATH")]))}
        os.execve(sys.executable, [sys.executable, *sys.argv], env)

    from autotune.model_file import check_model, load_model_file
    from autotune.profiling import profile_model

    spec = load_model_file(Path(args.model))
    check_model(spec, args.batch_size)
    started = time.time()
    profile = profile_model(spec, batch_size=args.batch_size, device="cpu", precision=args.precision)
    rows = []
    folder = Path(os.environ["AUTOTUNE_TRACE_DIR"])
    try:
        for text in args.configs:
            candidate = parse_config(text, args.batch_size, args.precision)
            rows.append(trace_config(spec, profile, candidate, steps=args.steps, warmup=args.warmup,
                                     repeats=args.repeats, folder=folder))
            print(json.dumps(rows[-1]), flush=True)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    if args.no_write:
        return
    table = []
    for row in rows:
        for r in row["ranks"]:
            table.append([row["candidate"] if r["rank"] == 0 else "", f"{row['measured_ms']:.1f}" if r["rank"] == 0
                          else "", f"{row['predicted_ms']:.1f}" if r["rank"] == 0 else "",
                          f"{row['predicted_ungated_ms']:.1f}" if r["rank"] == 0 and "predicted_ungated_ms" in row
                          else "", r["rank"],
                          f"{r['compute_ms']:.2f}", f"{r['profile_compute_ms']:.2f}",
                          f"{r['compute_ms'] / r['profile_compute_ms']:.2f}" if r["profile_compute_ms"] else "",
                          f"{r['action_overhead_ms_per_action']:.3f}", f"{r['post_ms_per_post']:.3f}",
                          f"{row['handoff_ms_median']:.3f}" if r["rank"] == 0 and row["handoff_ms_median"] else "",
                          f"{r['wait_ms']:.2f}", f"{r['optimizer_ms']:.2f}",
                          f"{row['predicted_optimizer_ms']:.2f}" if r["rank"] == 0 else "", f"{r['rest_ms']:.2f}",
                          f"{r['slow_posts']:g} of {r['posts']:g}", f"{r['slow_post_ms']:.2f}"])
    crossings = []
    for row in rows:
        n, slow, apart, apart_slow = (row["crossing_posts"], row["crossing_slow"], row["apart_posts"],
                                      row["apart_slow"])
        crossings.append([row["candidate"], f"{row['measured_ms']:.1f}", f"{row['predicted_ms']:.1f}",
                          f"{row['predicted_uncrossed_ms']:.1f}",
                          f"{slow} of {n}" + (f" ({slow / n:.0%})" if n else ""),
                          f"{statistics.median(row['crossing_slow_ms']):.2f}" if slow else "-",
                          f"{sum(row['crossing_slow_ms']) / n:.2f}" if n else "-",
                          f"{apart_slow} of {apart}" + (f" ({apart_slow / apart:.0%})" if apart else "")])
    resumed = []
    for row in rows:
        for r in row["ranks"]:
            resumed.append([row["candidate"] if r["rank"] == 0 else "",
                            f"{row['measured_ms']:.1f}" if r["rank"] == 0 else "",
                            f"{row['predicted_ms']:.1f}" if r["rank"] == 0 else "",
                            f"{row['predicted_unresumed_ms']:.1f}" if r["rank"] == 0 else "", r["rank"],
                            *(f"{b['compute_over_profile']:.2f} ({b['actions']})" if b["actions"] else "-"
                              for b in r["after_idle"])])
    edges = (0, *IDLE_BUCKETS_MS)
    idle = "AUTOTUNE_GLOO_LOOP_IDLE=1 " if os.environ.get("AUTOTUNE_GLOO_LOOP_IDLE") == "1" else ""
    command = idle + "python bench/action_trace.py " + " ".join(sys.argv[1:])
    _results.write(
        args.name, title="Where a trial's step goes, action by action (the simulator's terms, measured)",
        device="cpu",
        tables={f"{args.model}, B {args.batch_size}, 2 ranks (medians over steps; ms)": _results.markdown_table(
            ["candidate", "measured step", "predicted step", "predicted without the GPipe / 1F1B send gates",
             "rank", "compute", "profile's compute",
             "compute / profile", "overhead per action", "per post", "hand-off", "waiting", "optimizer",
             "predicted optimizer (slowest rank)", "rest", f"posts over {SLOW_POST_MS:g} ms", "their ms"], table),
            f"crossing posts: a post that began within {CROSSING_MS:g} ms of one of the other rank's (all steps, "
            "both ranks)": _results.markdown_table(
                ["candidate", "measured step", "predicted step", "predicted without crossing posts",
                 f"crossing posts over {SLOW_POST_MS:g} ms", "their median ms", "their ms per crossing post",
                 f"other posts over {SLOW_POST_MS:g} ms"], crossings),
            "after idle: each compute action's module time over the profile's, by the gap since the rank's "
            "previous action or optimizer step ended (median, actions)": _results.markdown_table(
                ["candidate", "measured step", "predicted step", "predicted without the idle term (LinkModel."
                 "idle_resume_ms)", "rank",
                 *(f"gap {low:g}-{high:g} ms" for low, high in zip(edges, edges[1:])),
                 f"gap over {edges[-1]:g} ms"], resumed)},
        data={"command": command, "model": args.model, "batch_size": args.batch_size, "rows": rows,
              "profile": profile.to_dict(), "idle_resume_ms": profile.idle_resume_ms,
              "idle_resume_window_ms": profile.idle_resume_window_ms,
              "wall_s": time.time() - started},
        notes=f"command: `{command}`\n\n" + __doc__.split("\n\n")[1])


if __name__ == "__main__":
    main()
