"""How often posting a gloo send takes milliseconds, by how the two ranks post: two one-thread CPU rank processes.

bench/action_trace.py found some posts (one _batch_p2p call) of the looped schedules taking ~3 ms where a post takes
~0.05 ms (LoopedBFS m8 on bench/models/embed_mlp.py: 4-5.5 of 48 a rank, 13-15 ms a step, the largest part of its
under-prediction), and the slow ones mostly at the moment the other rank posted to it too. The simulator has no term
for them. This times the post alone, with nothing of torch's pipelining around it, three ways:

1. one way: rank 1 posts its receive and waits; rank 0 computes, then posts the send (the hand-off to a waiting
   receiver, every schedule's);
2. crossing, receives ahead: each rank posts its receive, computes, then posts its send to the other at about the
   same moment (torch's runtime, the looped and V schedules, posts receives ahead of time);
3. crossing, fused: each rank computes, then posts its send and its receive in one batch, the send first (1F1B's
   bwd_send + fwd_recv).

Each way `--iterations` times per size after a barrier and --compute-ms of matrix products; per rank: the median
post, how many took over 1 ms, and their median.

    python bench/gloo_cross.py --iterations 100 [--pin --name gloo_cross_pinned] [--idle --name gloo_cross_idle]

Why (gloo's source, gloo/transport/tcp/pair.cc, and pytorch/gloo issue #246, "Don't busy-spin in tcp transport's
event loop", open): a post holds the pair's mutex while it writes its notification or data; the device thread's
Pair::handleEvents only try_locks that mutex and returns when it fails, and the level-triggered epoll hands it the
same readable socket at once, so while the peer's message is arriving during our post, our device thread spins.
Measured here: during a slow post the posting thread used ~0.2 ms of CPU and the process ~4.5 ms, i.e. another
thread of the process spun the whole time. Two ranks posting to each other at once spin both device threads on a
2-core machine, and the posting threads, descheduled, get a core back at the scheduler's next tick (CONFIG_HZ=250
here: 4 ms): hence 2.3-4.8 ms, and both ranks released at the same tick, in step, to cross again (LoopedBFS's chains
of stalls ~4.5 ms apart). One way (the peer waiting, its device thread asleep in epoll) it does not happen. The
stand-in's artifact, not a GPU's (NCCL has no such loop), but the simulator is calibrated on the stand-in.

Not a test: on a shared machine the slow posts come and go; run it with nothing else busy.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _results  # noqa: E402

WAYS = ("one way", "crossing, receives ahead", "crossing, fused")
SLOW_MS = 1.0


def rank_main(rank: int, port: int, sizes: list[int], iterations: int, compute_ms: float, out: Path) -> None:
    import json

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2, init_method=f"tcp://127.0.0.1:{port}")
    peer = 1 - rank
    if os.environ.get("AUTOTUNE_GLOO_LOOP_IDLE") == "1":  # --idle: as autotune's CPU trials run with it
        from autotune.devices import idle_gloo_device_threads

        idle_gloo_device_threads()
    work = torch.randn(256, 256)
    posts: dict[str, list[float]] = {}

    def compute() -> None:
        start = time.perf_counter()
        while (time.perf_counter() - start) * 1e3 < compute_ms:
            work @ work

    for way in WAYS:
        for n in sizes:
            times = posts.setdefault(f"{way}|{n}", [])
            for _ in range(iterations):
                sent, got = torch.randn(n), torch.zeros(n)
                dist.barrier()
                ahead = []
                if way == "crossing, receives ahead" or (way == "one way" and rank == 1):
                    ahead = dist.batch_isend_irecv([dist.P2POp(dist.irecv, got, peer)])
                if way == "one way" and rank == 1:
                    for w in ahead:
                        w.wait()
                    continue
                compute()
                start = time.perf_counter()
                if way == "crossing, fused":
                    works = dist.batch_isend_irecv([dist.P2POp(dist.isend, sent, peer),
                                                    dist.P2POp(dist.irecv, got, peer)])
                else:
                    works = dist.batch_isend_irecv([dist.P2POp(dist.isend, sent, peer)])
                times.append((time.perf_counter() - start) * 1e3)
                for w in [*works, *ahead]:
                    w.wait()
    dist.barrier()
    dist.destroy_process_group()
    out.write_text(json.dumps(posts))


def main() -> None:
    import json
    import socket
    import subprocess

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=40)
    parser.add_argument("--sizes", type=int, nargs="+", default=[1024, 65536], help="float32 elements a message")
    parser.add_argument("--compute-ms", type=float, default=3.0)
    parser.add_argument("--pin", action="store_true", help="each rank on its own core (taskset): rank r on core r")
    parser.add_argument("--idle", action="store_true",
                        help="gloo's device threads under SCHED_IDLE (autotune.devices.idle_gloo_device_threads)")
    parser.add_argument("--name", default="gloo_cross")
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    started = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        outs = [Path(tmp) / f"rank{r}.json" for r in range(2)]
        pin = (lambda r: ["taskset", "-c", str(r)]) if args.pin else (lambda r: [])
        procs = [subprocess.Popen([*pin(r), sys.executable, __file__, "rank", str(r), str(port), str(args.iterations),
                                   str(args.compute_ms), str(outs[r]), *map(str, args.sizes)],
                                  env={**os.environ, "OMP_NUM_THREADS": "1",
                                       "AUTOTUNE_GLOO_LOOP_IDLE": str(int(args.idle)),
                                       "PYTHONPATH": str(Path(__file__).resolve().parents[1])}) for r in range(2)]
        if any(p.wait(timeout=600) for p in procs):
            raise SystemExit("bench/gloo_cross.py: a rank failed")
        per_rank = [json.loads(o.read_text()) for o in outs]
    rows: list[list[Any]] = []
    for way in WAYS:
        for n in args.sizes:
            for r, posts in enumerate(per_rank):
                times = posts.get(f"{way}|{n}", [])
                if not times:
                    continue
                slow = [t for t in times if t > SLOW_MS]
                rows.append([way, n * 4, r, statistics.median(times), f"{len(slow)} of {len(times)}",
                             statistics.median(slow) if slow else "-"])
    tables = {"one post of a send, per rank (ms)": _results.markdown_table(
        ["how", "bytes", "rank", "median post ms", f"posts over {SLOW_MS:g} ms", "their median ms"], rows)}
    notes = (__doc__.split("\n\n")[1] + f"\n\n{'Each rank pinned to its own core (taskset). ' if args.pin else ''}"
             f"{'Gloo device threads under SCHED_IDLE (idle_gloo_device_threads). ' if args.idle else ''}"
             f"Compute before each post {args.compute_ms:g} ms, "
             f"{args.iterations} iterations a way and size, {time.time() - started:.0f} s.")
    if args.no_write:
        _results.show(tables)
        return
    _results.write(args.name, title="Slow gloo posts: by how the two ranks post", device="cpu", tables=tables,
                   data={"rows": rows, "per_rank": per_rank, "args": vars(args)}, notes=notes)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "rank":
        rank, port, iterations, compute_ms, out = sys.argv[2:7]
        rank_main(int(rank), int(port), [int(x) for x in sys.argv[7:]], int(iterations), float(compute_ms), Path(out))
    else:
        main()
