"""Rank side of the inter-node link probe: two ranks (node 0 and node 1) ping-pong to measure the latency and the
bandwidth of one send between nodes. Minima, not medians: a busy machine preempts in millisecond slices."""

from __future__ import annotations

import datetime
import math
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

PROBE_BYTES = 4 * 2**20
"""Size of each streamed message."""
LATENCY_ROUND_TRIPS = 30
STREAMED = 8
"""Large messages per bandwidth sample, at most."""
SAMPLE_S = 0.1
"""What one bandwidth sample should last, at least (fewer messages per sample on a slow link)."""


def ping_pong(buf: torch.Tensor, rank: int) -> None:
    """One round trip of buf between ranks 0 and 1 of the default group: rank 0 sends first, then receives it back."""
    peer = 1 - rank
    if rank == 0:
        dist.send(buf, peer)
        dist.recv(buf, peer)
    else:
        dist.recv(buf, peer)
        dist.send(buf, peer)


BOOT_ID = "/proc/sys/kernel/random/boot_id"
"""One per running kernel: two "nodes" that read the same are one machine (namespaces or containers on it)."""


def boot_id() -> str | None:
    """This machine's boot id (Linux), None where there is none to read."""
    try:
        with open(BOOT_ID) as f:
            return f.read().strip() or None
    except OSError:
        return None


def probe(rank: int, store: dist.Store, device: torch.device, timeout_s: float) -> dict[str, Any]:
    """Join a 2-rank group and measure: latency = the fastest round trip of 4 bytes / 2; bandwidth = up to STREAMED
    messages of PROBE_BYTES sent one way plus a 4-byte ack, best of 3, latency removed; all-reduce bandwidth = the
    bytes one all-reduce of PROBE_BYTES moves each way (a ring of 2: PROBE_BYTES) over its time, best of 3 after a
    small one (the backend's first collective sets itself up), latency removed: what the backend's own collective
    gets out of the link (gloo's on the CPU stand-in, two namespaces over a veth pair: ~88 % of one stream's at 20
    Mbit/s, ~40 % unshaped, where its reductions and copies take longer than the wire). same_host: both ranks read
    the same boot id (LinkModel.nodes_share_host)."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, store=store, rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=max(timeout_s, 1.0)))
    mine = boot_id()  # both ranks are up (the group formed): the peer's comes at once
    store.set(f"boot_id/{rank}", mine or "")
    theirs = store.get(f"boot_id/{1 - rank}").decode() or None
    peer = 1 - rank
    big = torch.empty(PROBE_BYTES // 4, device=device)
    ack = torch.empty(1, device=device)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def timed(op: Callable[[], object]) -> float:
        t0 = time.perf_counter()
        op()
        sync()
        return time.perf_counter() - t0

    def round_trip(buf: torch.Tensor) -> float:
        return timed(lambda: ping_pong(buf, rank))

    def stream(n: int) -> float:
        t0 = time.perf_counter()
        for _ in range(n):
            if rank == 0:
                dist.send(big, peer)
            else:
                dist.recv(big, peer)
        if rank == 0:
            dist.recv(ack, peer)
        else:
            dist.send(ack, peer)
        sync()
        return time.perf_counter() - t0

    round_trip(big)  # connection set-up, first touch of the buffers
    latency = min(round_trip(ack) for _ in range(LATENCY_ROUND_TRIPS)) / 2
    # As many messages per sample as fill SAMPLE_S (rank 0's first guess decides, for both), at most STREAMED: a
    # slow link gets 1 (at 20 Mbit/s each message takes 1.7 s; 3 x 8 of them would outlast the probe's timeout).
    first = torch.tensor([float(STREAMED)])
    if rank == 0:
        first[0] = max(1, min(STREAMED, math.ceil(SAMPLE_S / max(stream(1) - 2 * latency, 1e-9))))
        dist.send(first, peer)
    else:
        stream(1)
        dist.recv(first, peer)
    n = int(first[0])
    seconds = min(stream(n) for _ in range(3)) - 2 * latency
    dist.all_reduce(ack)
    reduced = min(timed(lambda: dist.all_reduce(big)) for _ in range(3)) - 2 * latency
    dist.destroy_process_group()
    return {"rank": rank, "latency_s": latency, "bandwidth_bytes_per_s": n * PROBE_BYTES / max(seconds, 1e-9),
            "allreduce_bandwidth_bytes_per_s": PROBE_BYTES / max(reduced, 1e-9),
            "same_host": mine is not None and mine == theirs}
