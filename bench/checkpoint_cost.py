"""What activation checkpointing costs a stage of several blocks, against what one block checkpointed alone says (the
profile's checkpointing ratios come from one block: autotune.profiling._checkpoint_ratios), and the fixed cost of
one checkpoint (a one-operation function). Issue 24: on an H200 the checkpointed one-rank trials of small and
launch-bound models were over-predicted by 12-75 % (bench/results/cuda_regression.md).

    python bench/checkpoint_cost.py --model bench/models/gpt_cuda.py --micro-batch 8 --precision bf16 --device cuda
    python bench/checkpoint_cost.py --model recipes/gpt.py --micro-batch 8 --device cpu

Times the model's blocks between its first and last (a GPT's transformer blocks) as one stage, plain and
checkpointed once (as runtime.py checkpoints a stage), and one of them alone the same way; forward and backward
(loss: sum(output x g)), the median of --repeats after --warmup. Prints a table; --out writes JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import runpy
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint


def timer(device: torch.device) -> Callable[[Callable[[], Any]], float]:
    def run(fn: Callable[[], Any]) -> float:
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            return float(start.elapsed_time(end))
        begin = time.perf_counter()
        fn()
        return (time.perf_counter() - begin) * 1e3
    return run


def measure(module: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, *, checkpointed: bool, bf16: bool,
            device: torch.device, warmup: int, repeats: int) -> tuple[float, float]:
    """(forward ms, backward ms), medians."""
    clock = timer(device)
    g = torch.randn_like(x)
    precision = (torch.autocast(device.type, dtype=torch.bfloat16) if bf16 else contextlib.nullcontext())
    forwards, backwards = [], []
    for i in range(warmup + repeats):
        box: dict[str, torch.Tensor] = {}

        def forward(box: dict[str, torch.Tensor] = box) -> None:
            with precision:
                box["out"] = checkpoint(module, x, use_reentrant=False) if checkpointed else module(x)

        def backward(box: dict[str, torch.Tensor] = box) -> None:
            (box["out"].float() * g).sum().backward()

        f = clock(forward)
        b = clock(backward)
        if i >= warmup:
            forwards.append(f)
            backwards.append(b)
        x.grad = None
    return statistics.median(forwards), statistics.median(backwards)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="recipes/gpt.py")
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    device = torch.device(args.device)
    torch.manual_seed(0)
    namespace = runpy.run_path(args.model)
    model = namespace["build_model"]().to(device)
    children = list(model.children())
    blocks = nn.Sequential(*children[1:-1])
    inputs, _ = namespace["make_batch"](args.micro_batch)
    with torch.no_grad():
        x = children[0](inputs.to(device)).detach().float().requires_grad_(True)
    bf16 = args.precision == "bf16"
    common = dict(bf16=bf16, device=device, warmup=args.warmup, repeats=args.repeats)
    trivial = nn.Identity()

    def one_op(t: torch.Tensor) -> torch.Tensor:
        return trivial(t) * 2.0

    rows = {}
    for name, module in (("stage", blocks), ("one block", blocks[0]), ("one operation", one_op)):
        plain = measure(module, x, checkpointed=False, **common)
        ckpt = measure(module, x, checkpointed=True, **common)
        rows[name] = {"plain_forward_ms": plain[0], "plain_backward_ms": plain[1],
                      "checkpointed_forward_ms": ckpt[0], "checkpointed_backward_ms": ckpt[1]}
    n = len(blocks)
    one = rows["one block"]
    forward_ratio = one["checkpointed_forward_ms"] / one["plain_forward_ms"]
    recompute_ratio = (one["checkpointed_backward_ms"] - one["plain_backward_ms"]) / one["plain_forward_ms"]
    stage = rows["stage"]
    summary = {
        "blocks in the stage": n,
        "one block's ratios (the profile's way): forward, recompute": [forward_ratio, recompute_ratio],
        "stage: measured checkpointing cost ms (forward + backward)":
            stage["checkpointed_forward_ms"] + stage["checkpointed_backward_ms"]
            - stage["plain_forward_ms"] - stage["plain_backward_ms"],
        "stage: the ratios' prediction of it ms":
            stage["plain_forward_ms"] * (forward_ratio - 1 + recompute_ratio),
        "one operation: a checkpoint's fixed cost ms (forward + backward)":
            rows["one operation"]["checkpointed_forward_ms"] + rows["one operation"]["checkpointed_backward_ms"]
            - rows["one operation"]["plain_forward_ms"] - rows["one operation"]["plain_backward_ms"],
    }
    result = {"model": args.model, "micro_batch": args.micro_batch, "precision": args.precision,
              "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "torch": torch.__version__, "rows": rows, "summary": summary}
    for name, row in rows.items():
        print(f"{name:14s} " + "  ".join(f"{k} {v:.3f}" for k, v in row.items()))
    for k, v in summary.items():
        print(f"{k}: {v}")
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
