"""Tensor parallel at scale (issue 25): the Llama-3-70B-sized profile of bench/plan_70b.py planned on 8 nodes x 8 GPUs
of 80 GiB with tp 1, 2, 4 and 8, each degree alone and all together: the best layout of each and which one the
planner picks.

    python bench/plan_70b_tp.py [--tflops 400]

The profile carries the tp terms the Hugging Face Llama plan gives each block as torch's styles run it (as
`autotune profile` records them for recipes/hf_llama.py): a vocabulary-parallel embedding (one forward all-reduce),
per decoder layer 2 forward all-reduces (o_proj, down_proj) and 5 backward ones (the input gradients of q, k, v,
gate and up), everything but the two norms sharded; the head: its logits all-gathered, one backward all-reduce.
Every all-reduce moves one micro-batch's hidden states (4096 x 8192 bf16) on the intra-node link (the cuda
default, NVLink-class 50 GB/s), plus 0.02 ms a call; compute divided by tp at 90 % efficiency: both assumptions.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _results  # noqa: E402
from plan_70b import (  # noqa: E402
    BATCH,
    BLOCKS,
    GPUS_PER_NODE,
    HIDDEN,
    LIMIT,
    NODES,
    VOCAB,
    block_parameters,
    link,
    llama70b_profile,
)

from autotune.costs import Profile, TensorParallelLayer  # noqa: E402
from autotune.graph_cache import planning  # noqa: E402
from autotune.plan import PlannedCandidate, plan  # noqa: E402
from autotune.units import format_bytes  # noqa: E402


def with_llama_terms(profile: Profile) -> Profile:
    embedding = TensorParallelLayer(sharded_parameter_bytes=4 * VOCAB * HIDDEN, forward_all_reduces=1)
    block = TensorParallelLayer(sharded_parameter_bytes=4 * (block_parameters() - 2 * HIDDEN), forward_all_reduces=2,
                                backward_all_reduces=5)
    head = TensorParallelLayer(sharded_parameter_bytes=4 * VOCAB * HIDDEN, backward_all_reduces=1,
                               forward_all_gathers=1)
    return replace(profile, tensor_parallel_layers=(embedding, *[block] * BLOCKS, head))


def row(label: str, planned: list[PlannedCandidate], took: float) -> list[object]:
    feasible = [p for p in planned if p.estimate.feasible]
    if not feasible:
        leanest = min(planned, key=lambda p: max(p.estimate.peak_memory_bytes))
        return [label, "-", "nothing fits", "-", format_bytes(max(leanest.estimate.peak_memory_bytes)), "-", "-",
                round(took, 1)]
    best = feasible[0]
    c, e = best.candidate, best.estimate
    mode = ("shard/rs" if c.reshard_after_forward else "shard") if c.sharded else "replicate"
    schedule = f"{c.schedule.value}{' +ckpt' if c.activation_checkpointing else ''}, B/M {c.n_microbatches}"
    return [label, f"{c.pipeline_degree}×{c.data_parallel_degree}×{c.tensor_parallel_degree} {mode}", schedule,
            round(e.step_time_ms / 1e3, 1), format_bytes(max(e.peak_memory_bytes)),
            round(e.tensor_parallel_ms / 1e3, 1), f"{e.bubble_fraction:.0%}", round(took, 1)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tflops", type=float, default=400.0)
    args = parser.parse_args()
    profile = with_llama_terms(llama70b_profile(args.tflops))
    rows = []
    everything: list[PlannedCandidate] = []
    for degrees in ((1,), (2,), (4,), (8,), (1, 2, 4, 8)):
        started = time.perf_counter()
        with planning():
            planned = plan(profile, gpus=NODES * GPUS_PER_NODE, batch_size=BATCH, memory_limit_bytes=LIMIT,
                           link=link(), gpus_per_node=GPUS_PER_NODE, tensor_parallel_degrees=degrees)
        took = time.perf_counter() - started
        label = f"tp {degrees[0]}" if len(degrees) == 1 else "tp 1, 2, 4, 8 together"
        rows.append(row(label, planned, took))
        print(f"{label}: planned in {took:.1f} s", file=sys.stderr)
        if len(degrees) > 1:
            everything = planned
    listed = sorted({p.candidate.tensor_parallel_degree for p in everything})
    top = [[i + 1, *row("", [p], 0.0)[1:-1]] for i, p in enumerate(everything[:8])]
    tables = {
        "Best feasible candidate per tp degree, and with all degrees in one plan": _results.markdown_table(
            ["tp", "pp×dp×tp", "schedule", "step s", "peak / rank", "tp collectives s", "bubble", "plan s"], rows),
        "The combined plan's top 8": _results.markdown_table(
            ["#", "pp×dp×tp", "schedule", "step s", "peak / rank", "tp collectives s", "bubble"], top),
    }
    notes = (f"tp degrees ranked in the combined plan: {listed} (each degree's cheapest point is simulated even when "
             f"its lower bound is far behind, so every degree is ranked). `tp collectives s`: the slowest rank's tp "
             f"all-reduces and all-gathers of the step, inside its compute.")
    data = {"rows": rows, "top": top, "tflops": args.tflops, "degrees_ranked": listed}
    print(_results.write("plan_70b_tp", title="Tensor parallel in the plan of a Llama-3-70B-sized model, 8 x 8 GPUs",
                         device="cpu", tables=tables, data=data, notes=notes))


if __name__ == "__main__":
    main()
