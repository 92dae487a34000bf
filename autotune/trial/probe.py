"""Rank side of the inter-node link probe: two ranks (node 0 and node 1) ping-pong to measure the latency and the
bandwidth of one send between nodes. Minima, not medians: a busy machine preempts in millisecond slices."""

from __future__ import annotations

import datetime
import time
from typing import Any

import torch
import torch.distributed as dist

PROBE_BYTES = 4 * 2**20
"""Size of each streamed message."""
LATENCY_ROUND_TRIPS = 30
STREAMED = 8
"""Large messages per bandwidth sample."""


def probe(rank: int, store: dist.Store, device: torch.device, timeout_s: float) -> dict[str, Any]:
    """Join a 2-rank group and measure: latency = the fastest round trip of 4 bytes / 2; bandwidth = STREAMED
    messages of PROBE_BYTES sent one way plus a 4-byte ack, best of 3, latency removed."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, store=store, rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=max(timeout_s, 1.0)))
    peer = 1 - rank
    big = torch.empty(PROBE_BYTES // 4, device=device)
    ack = torch.empty(1, device=device)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def round_trip(buf: torch.Tensor) -> float:
        t0 = time.perf_counter()
        if rank == 0:
            dist.send(buf, peer)
            dist.recv(buf, peer)
        else:
            dist.recv(buf, peer)
            dist.send(buf, peer)
        sync()
        return time.perf_counter() - t0

    def stream() -> float:
        t0 = time.perf_counter()
        for _ in range(STREAMED):
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

    for _ in range(3):  # connection set-up, first touch of the buffers
        round_trip(big)
    latency = min(round_trip(ack) for _ in range(LATENCY_ROUND_TRIPS)) / 2
    seconds = min(stream() for _ in range(3)) - 2 * latency
    dist.destroy_process_group()
    return {"rank": rank, "latency_s": latency,
            "bandwidth_bytes_per_s": STREAMED * PROBE_BYTES / max(seconds, 1e-9)}
