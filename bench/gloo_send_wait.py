"""How long a gloo send's wait lasts when its receive is posted late: the premise of the simulator's send gates
(autotune.simulate._send_gates) for torch's GPipe and 1F1B, which wait for their own sends before going on.

Two one-thread rank processes over gloo (loopback). Rank 0 posts a send (alone, or as torch's 1F1B does, in one
batch with a receive from rank 1: `batch_isend_irecv`) and waits for it; rank 1 sleeps `delay` ms, then posts the
matching receive (and, for the batch, the send rank 0 receives). Each row: rank 0's post, its wait until done, and
how long after rank 1's post its receive completed. A send that completed on its own would wait ~0 whatever the
delay; gloo's waits until the receive is posted, and the receive then completes at once: the sender sits in gloo's
wait, so the receiver pays no wake (autotune.simulate.LinkModel.late_receives_wake is for a sender that computes).

    python bench/gloo_send_wait.py --repeats 5

Not a test: timings on a shared machine are noise; run it with nothing else busy.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _results  # noqa: E402

SIZES = (4096, 65536, 1 << 20)
DELAYS_MS = (0.0, 5.0, 50.0)


def _rank(rank: int, init: str, repeats: int, out: str) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    rows = []
    for fused in (False, True):
        for nbytes in SIZES:
            for delay in DELAYS_MS:
                post, wait, arrive = [], [], []
                for _ in range(repeats):
                    x, back = torch.ones(nbytes // 4), torch.ones(1024)
                    dist.barrier()
                    if rank == 0:
                        start = time.perf_counter()
                        ops = [dist.P2POp(dist.isend, x, 1)] + ([dist.P2POp(dist.irecv, back, 1)] if fused else [])
                        works = dist.batch_isend_irecv(ops)
                        posted = time.perf_counter()
                        for w in works:
                            w.wait()
                        done = time.perf_counter()
                        post.append((posted - start) * 1e3)
                        wait.append((done - start) * 1e3)
                    else:
                        time.sleep(delay / 1e3)
                        start = time.perf_counter()
                        ops = ([dist.P2POp(dist.isend, back, 0)] if fused else []) + [dist.P2POp(dist.irecv, x, 0)]
                        for w in dist.batch_isend_irecv(ops):
                            w.wait()
                        arrive.append((time.perf_counter() - start) * 1e3)
                    dist.barrier()
                rows.append({"fused": fused, "bytes": nbytes, "delay_ms": delay, "rank": rank,
                             "post_ms": statistics.median(post) if post else None,
                             "wait_ms": statistics.median(wait) if wait else None,
                             "receive_ms": statistics.median(arrive) if arrive else None, "n": repeats})
    Path(out).write_text(json.dumps(rows))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--no-write", action="store_true", help="print, do not write bench/results")
    args = parser.parse_args()
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        init = f"file://{tmp}/store"
        outs = [f"{tmp}/rank{r}.txt" for r in range(2)]
        ctx = mp.get_context("spawn")
        procs = [ctx.Process(target=_rank, args=(r, init, args.repeats, outs[r])) for r in range(2)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout=300)
            if p.exitcode != 0:
                raise SystemExit(f"bench/gloo_send_wait.py: a rank failed (exit {p.exitcode})")
        ranks = [json.loads(Path(o).read_text()) for o in outs]
    table: list[list[Any]] = []
    for sender, receiver in zip(*ranks):
        table.append(["send + receive, one batch (1F1B)" if sender["fused"] else "send alone", sender["bytes"],
                      sender["delay_ms"], sender["post_ms"], sender["wait_ms"], receiver["receive_ms"]])
    header = ["rank 0 posts", "bytes", "rank 1 posts its receive after ms", "rank 0's post ms",
              "rank 0's wait until done ms", "rank 1's receive, from its post ms"]
    tables = {f"medians of {args.repeats} (2 one-thread ranks, gloo over loopback)": _results.markdown_table(header,
                                                                                                          table)}
    if args.no_write:
        _results.show(tables)
        return
    _results.write("gloo_send_wait", title="A gloo send waits for its receive to be posted", device="cpu",
                   tables=tables, data={"rows": ranks}, notes=__doc__.split("\n\n", 1)[1])


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
