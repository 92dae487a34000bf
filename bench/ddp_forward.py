"""What DistributedDataParallel costs a replicated stage per micro-batch that does not sync (issue 27: dp 2
replicated trials under-predicted 12-20 %, the gap growing with the micro-batches): each model's forward and
backward, plain and wrapped as the runtime wraps a replicated stage (autotune.runtime._replicate) under no_sync,
alternating call by call, in one process over a one-rank gloo group, one thread.

    python bench/ddp_forward.py --repeats 300

Writes bench/results/ddp_forward.md: per model the plain and wrapped times and their difference (medians), and
this host's probe (Profile.host_call_ms) with the difference scaled to the reference host the simulator's CPU
constants are for (HOST_CALL_REFERENCE_MS): what LinkModel's replica_forward_overhead_ms should be there.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _results  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
MODELS = [("bench/models/mlp13.py", 16), ("bench/models/mlp13.py", 128), ("recipes/gpt.py", 4), ("recipes/mlp.py", 16),
          ("recipes/cnn.py", 8), ("bench/models/embed_mlp.py", 16), ("bench/models/tail_heavy7.py", 16)]


def measure(path: str, micro_batch: int, repeats: int, warmup: int) -> dict[str, float]:
    import torch

    from autotune.model_file import load_model_file
    from autotune.runtime import _replicate

    spec = load_model_file(ROOT / path)
    model = spec.build_model()
    x, y = spec.make_batch(micro_batch)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # find_unused_parameters=True finds none here, and says so
        wrapped = _replicate(model, None, torch.device("cpu"))
    times: dict[str, list[float]] = {"plain_forward": [], "plain_backward": [], "ddp_forward": [], "ddp_backward": []}
    for i in range(warmup + repeats):
        for kind, module in (("plain", model), ("ddp", wrapped)):
            context = wrapped.no_sync() if kind == "ddp" else contextlib.nullcontext()
            with context:
                t0 = time.perf_counter()
                loss = spec.loss_fn(module(x), y)
                t1 = time.perf_counter()
                loss.backward()
                t2 = time.perf_counter()
            for p in model.parameters():
                p.grad = None
            if i >= warmup:
                times[f"{kind}_forward"].append((t1 - t0) * 1e3)
                times[f"{kind}_backward"].append((t2 - t1) * 1e3)
    result = {k: statistics.median(v) for k, v in times.items()}
    result["tensors"] = sum(1 for p in model.parameters() if p.requires_grad)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--name", default="ddp_forward")
    args = parser.parse_args()

    import torch
    import torch.distributed as dist

    from autotune.profiling import host_call_ms
    from autotune.simulate import HOST_CALL_REFERENCE_MS, LinkModel, host_scale

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    probe = statistics.median(host_call_ms() for _ in range(3))
    scale = host_scale(probe)
    rows, data = [], []
    for path, micro_batch in MODELS:
        r = measure(path, micro_batch, args.repeats, args.warmup)
        forward = r["ddp_forward"] - r["plain_forward"]
        backward = r["ddp_backward"] - r["plain_backward"]
        rows.append([path, micro_batch, r["tensors"], r["plain_forward"], r["ddp_forward"], forward,
                     r["plain_backward"], r["ddp_backward"], backward, forward / scale])
        data.append({"model": path, "micro_batch": micro_batch, **r, "forward_extra_ms": forward,
                     "backward_extra_ms": backward, "forward_extra_at_reference_ms": forward / scale})
        print(path, micro_batch, f"forward +{forward:.3f} ms, backward +{backward:.3f} ms", flush=True)
    dist.destroy_process_group()
    forwards = [d["forward_extra_ms"] for d in data]
    table = _results.markdown_table(
        ["model", "micro-batch", "parameter tensors", "forward ms", "under DDP (no_sync) ms", "forward's extra ms",
         "backward ms", "under DDP ms", "backward's extra ms", "forward's extra at the reference host ms"], rows)
    summary = _results.markdown_table(
        ["host probe (Profile.host_call_ms) us", "reference us", "scale", "median forward extra ms",
         "at the reference host ms", "the simulator's constant (LinkModel.for_device('cpu'))"],
        [[probe * 1e3, HOST_CALL_REFERENCE_MS * 1e3, scale, statistics.median(forwards),
          statistics.median(forwards) / scale, LinkModel.for_device("cpu").replica_forward_overhead_ms]])
    _results.write(args.name, title="DistributedDataParallel's cost per micro-batch under no_sync", device="cpu",
                   tables={"summary": summary, "per model (medians)": table},
                   data={"host_call_ms": probe, "scale": scale, "models": data},
                   notes=__doc__.split("\n\n", 1)[0])


if __name__ == "__main__":
    main()
