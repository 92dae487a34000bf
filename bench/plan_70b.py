"""Planning at scale (issue 23 item 6): a synthetic Llama-3-70B-sized profile planned on 8 nodes x 8 GPUs of
80 GiB at batch 512 (sequence 4096), bf16. Which replicate and which shard (FSDP2) layouts fit, and their predicted
step times, against the same plan before sharding was in the space (`--before`: a checkout of the planner without
it, run as `autotune plan --profile` on the same profile).

    python bench/plan_70b.py [--tflops 400] [--before /work/main]

The profile: Llama-3-70B's shapes (hidden 8192, FFN 28672, 8 KV heads of 128, vocabulary 128256, 80 blocks, untied
embedding and head: 70.55 B parameters), one micro-batch sample = one 4096-token sequence. Times from flops at a
stated throughput (default 400 TFLOP/s per GPU, ~40 % of an H100's dense bf16): per parameter and token, 2 flops
forward, 2 input-grad, 2 weight-grad (attention's own flops and the embedding's left out). Saved activations per
token and block (bf16, flash attention: nothing quadratic): the attention norm's input and output, q, k, v, the
attention output, the MLP norm's input and output, gate, up, SiLU(gate) and their product: 6h + 2kv + 4f elements.
The head saves its norm's input and output and the loss's float32 log-probabilities (V per token). Parameters are
float32 master weights (4 B); autocast's bf16 weight copies (replicate bf16) are the blocks' and the head's matmul
weights at 2 B.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _results  # noqa: E402

from autotune.candidate import DATA_PARALLEL_MODES, pipeline_layouts, stage_bounds  # noqa: E402
from autotune.costs import LayerCost, Profile  # noqa: E402
from autotune.graph_cache import planning  # noqa: E402
from autotune.memory_model import (  # noqa: E402
    dp_shards,
    parameter_memory_bytes,
    receive_buffer_bytes,
    unsharded_gradient_bytes,
    wire_bytes,
    working_copy_bytes,
)
from autotune.plan import PlannedCandidate, plan  # noqa: E402
from autotune.schedules import parse_schedule, stage_ranks  # noqa: E402
from autotune.simulate import LinkModel  # noqa: E402
from autotune.units import format_bytes  # noqa: E402

GiB = 2**30
HIDDEN, FFN, KV, VOCAB, BLOCKS, SEQ = 8192, 28672, 1024, 128256, 80, 4096
NODES, GPUS_PER_NODE, BATCH = 8, 8, 512
LIMIT = 80 * GiB
INTER_NODE_BANDWIDTH, INTER_NODE_LATENCY = 25e9, 10e-6  # `autotune plan --nodes`'s documented assumption (cuda)
ROOT = Path(__file__).resolve().parent.parent


def block_parameters() -> int:
    attention = 2 * HIDDEN * HIDDEN + 2 * HIDDEN * KV  # q, o; k, v
    return attention + 3 * HIDDEN * FFN + 2 * HIDDEN  # gate, up, down; two RMSNorm weights


def llama70b_profile(tflops: float) -> Profile:
    """One 4096-token sequence per micro-batch (other sizes in proportion), bf16, on cuda."""
    per_second = tflops * 1e12

    def ms(parameters: int) -> float:  # 2 flops per parameter and token
        return 2 * parameters * SEQ / per_second * 1e3

    n = block_parameters()
    block = LayerCost(
        forward_ms=ms(n), backward_input_ms=ms(n), backward_weight_ms=ms(n),
        saved_bytes=SEQ * (6 * HIDDEN + 2 * KV + 4 * FFN) * 2, output_bytes=SEQ * HIDDEN * 2,
        parameter_bytes=4 * n, autocast_copy_bytes=2 * (n - 2 * HIDDEN), parameter_groups=9,
    )
    embedding = LayerCost(  # a lookup: no matmul flops; its weight gradient is a scatter of one sequence's rows
        forward_ms=0.1, backward_input_ms=0.0, backward_weight_ms=0.5, saved_bytes=SEQ * 8,
        output_bytes=SEQ * HIDDEN * 2, parameter_bytes=4 * VOCAB * HIDDEN, parameter_groups=1,
    )
    head_parameters = VOCAB * HIDDEN + HIDDEN
    head = LayerCost(
        forward_ms=ms(VOCAB * HIDDEN), backward_input_ms=ms(VOCAB * HIDDEN), backward_weight_ms=ms(VOCAB * HIDDEN),
        saved_bytes=SEQ * (2 * HIDDEN * 2 + VOCAB * 4), output_bytes=SEQ * VOCAB * 2,
        parameter_bytes=4 * head_parameters, autocast_copy_bytes=2 * VOCAB * HIDDEN, parameter_groups=2,
    )
    costs = [embedding, *[block] * BLOCKS, head]
    names = ["Embedding", *["LlamaDecoderLayer"] * BLOCKS, "Head"]
    profile = Profile.from_layer_costs(costs, micro_batch_size=1, input_bytes=SEQ * 8, names=names, device="cuda",
                                       precision="bf16")
    return Profile(**{**profile.__dict__, "batch_size": BATCH, "model": "synthetic Llama-3-70B (bench/plan_70b.py)"})


def link() -> LinkModel:
    return LinkModel.for_device("cuda").with_probe(inter_latency_s=INTER_NODE_LATENCY,
                                                   inter_bandwidth_bytes_per_s=INTER_NODE_BANDWIDTH)


def pure_compute_s(profile: Profile) -> float:
    """Every layer's forward and backward for the global batch, spread over the GPUs, nothing else."""
    per_sample = sum(c.forward_ms + c.backward_ms for c in profile.layer_costs(1))
    return per_sample * BATCH / (NODES * GPUS_PER_NODE) / 1e3


def kind(p: PlannedCandidate) -> str:
    c = p.candidate
    if not c.sharded:
        return "replicate"
    return "shard/rs" if c.reshard_after_forward else "shard"


def describe(p: PlannedCandidate) -> str:
    c = p.candidate
    extra = " +ckpt" if c.activation_checkpointing else ""
    extra += " dp-inner" if c.rank_order == "dp-inner" else ""
    return f"{c.schedule.value}{extra}, B/M {c.n_microbatches}, M {c.micro_batch_size}"


def breakdown(profile: Profile, p: PlannedCandidate) -> list[object]:
    """The fullest rank's peak beside the memory model's largest terms for the stages it holds: what the parameters
    cost (float32 state, or sharded: the parameter and AdamW shards, the working copy and the unsharded gradients)
    and the receive buffers. The terms need not peak together (resharding lets go of copies; with two stages per
    rank, one stage's gradients may be reduced before the other's accumulate)."""
    c, e = p.candidate, p.estimate
    costs = profile.layer_costs(c.micro_batch_size)
    rank = max(range(c.pipeline_degree), key=lambda r: e.peak_memory_bytes[r])
    bounds = stage_bounds(c.layers_per_stage)
    mine = [s for s, r in enumerate(stage_ranks(c.schedule, c.pipeline_degree, c.n_stages)) if r == rank]
    params = sum(costs[i].parameter_bytes for s in mine for i in range(bounds[s], bounds[s + 1]))
    receive = 0.0
    for s in mine:
        into, out = (None if s == 0 else costs[bounds[s] - 1]), costs[bounds[s + 1] - 1]
        wire_in = 0.0 if into is None else wire_bytes(into.output_bytes, into.wire_output_bytes, candidate=c)
        wire_out = wire_bytes(out.output_bytes, out.wire_output_bytes, candidate=c)
        receive += receive_buffer_bytes(wire_in, wire_out, candidate=c, first=s == 0, last=s == c.n_stages - 1)
    state = parameter_memory_bytes(params, profile.optimizer_state_ratio, dp_shards(c))
    copy = working_copy_bytes(params, candidate=c)
    grads = unsharded_gradient_bytes(params, candidate=c)
    peak = e.peak_memory_bytes[rank]
    return [f"{c.pipeline_degree}×{c.data_parallel_degree}", kind(p), describe(p), rank,
            *(format_bytes(int(x)) for x in (params, state, copy, grads, receive, peak))]


def busiest_rank_compute_s(profile: Profile, entry: dict[str, object]) -> float:
    """The busiest pipeline rank's compute per step in a plan's JSON entry: its stages' forward and backward (and
    recompute, checkpointed) for every micro-batch, nothing else."""
    m, pp = int(entry["num_microbatches"]), int(entry["pipeline_degree"])  # type: ignore[call-overload]
    split = [int(n) for n in entry["layers_per_stage"]]  # type: ignore[attr-defined]
    costs = profile.layer_costs(int(entry["micro_batch_size"]))  # type: ignore[call-overload]
    bounds = stage_bounds(split)
    per_rank = [0.0] * pp
    for s, r in enumerate(stage_ranks(parse_schedule(str(entry["schedule"])), pp, len(split))):
        for c in costs[bounds[s]:bounds[s + 1]]:
            per_rank[r] += c.forward_ms + c.backward_ms + (c.forward_ms if entry["activation_checkpointing"] else 0)
    return max(per_rank) * m / 1e3


def per_layout(profile: Profile, details: list[list[object]] | None = None) -> list[list[object]]:
    """Per pp x dp layout and data-parallel choice: the fastest feasible candidate, else the leanest (and, into
    details, where its fullest rank's memory goes)."""
    rows: list[list[object]] = []
    for pp, dp in pipeline_layouts(NODES * GPUS_PER_NODE, BATCH, profile.n_layers):
        started = time.perf_counter()
        with planning():
            planned = plan(profile, gpus=NODES * GPUS_PER_NODE, batch_size=BATCH, memory_limit_bytes=LIMIT,
                           link=link(), layouts=[(pp, dp)], gpus_per_node=GPUS_PER_NODE,
                           data_parallel_modes=DATA_PARALLEL_MODES)
        took = time.perf_counter() - started
        for choice in ("replicate", "shard", "shard/rs"):
            mine = [p for p in planned if kind(p) == choice]
            if not mine:
                continue
            feasible = [p for p in mine if p.estimate.feasible]
            best = feasible[0] if feasible else min(mine, key=lambda p: max(p.estimate.peak_memory_bytes))
            e = best.estimate
            if details is not None:
                details.append(breakdown(profile, best))
            rows.append([f"{pp}×{dp}", choice, "yes" if feasible else "no", describe(best),
                         round(e.step_time_ms / 1e3, 1), format_bytes(max(e.peak_memory_bytes)),
                         round(e.gather_ms / 1e3, 2), round(e.reduce_scatter_ms / 1e3, 2), round(took, 1)])
        print(f"pp {pp} x dp {dp}: planned in {took:.1f} s", file=sys.stderr)
    return rows


def cli_plan(checkout: Path, profile_path: Path, top: int) -> tuple[list[dict[str, object]] | str, float]:
    """`autotune plan --profile` with the planner of a checkout (PYTHONPATH): its JSON (or, when nothing fits, exit
    3, its one line) and wall time."""
    command = [sys.executable, "-m", "autotune", "plan", "--profile", str(profile_path), "--nodes", str(NODES),
               "--gpus-per-node", str(GPUS_PER_NODE), "--batch-size", str(BATCH), "--memory-limit", "80GiB",
               "--json", "--top", str(top)]
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, check=False,
                          env={**os.environ, "PYTHONPATH": str(checkout)}, cwd=checkout)
    took = time.perf_counter() - started
    if done.returncode == 3:
        return done.stderr.strip(), took
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)} in {checkout} failed ({done.returncode}): {done.stderr.strip()}")
    return json.loads(done.stdout), took


def cli_row(label: str, entry: dict[str, object] | str) -> list[object]:
    if isinstance(entry, str):  # nothing fits: the planner's own line
        return [label, "-", "-", entry, "-", "-"]
    mode = entry.get("data_parallel_mode", "replicate")
    if mode == "shard" and entry.get("fsdp_reshard_after_forward"):
        mode = "shard/rs"
    peak = max(entry["predicted_peak_memory_bytes"])  # type: ignore[type-var]
    ckpt = " +ckpt" if entry["activation_checkpointing"] else ""
    return [label, f"{entry['pipeline_degree']}×{entry['data_parallel_degree']}", mode,
            f"{entry['schedule']}{ckpt}, B/M {entry['num_microbatches']}, M {entry['micro_batch_size']}",
            round(float(entry["predicted_step_time_ms"]) / 1e3, 1), format_bytes(int(peak))]  # type: ignore[arg-type]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tflops", type=float, default=400.0, help="throughput per GPU the times are computed at")
    parser.add_argument("--before", type=Path, default=None,
                        help="a checkout whose planner has no sharding (e.g. the commit before it), to compare")
    args = parser.parse_args()
    profile = llama70b_profile(args.tflops)
    parameters = sum(c.parameter_bytes for c in profile.layer_costs(1)) // 4
    compute = pure_compute_s(profile)
    details: list[list[object]] = []
    rows = per_layout(profile, details)
    with tempfile.TemporaryDirectory() as tmp:
        profile_path = Path(tmp) / "llama70b.json"
        profile_path.write_text(json.dumps(profile.to_dict()))
        after, after_s = cli_plan(ROOT, profile_path, top=5)
        before = cli_plan(args.before, profile_path, top=1) if args.before else None
    if isinstance(after, str):
        raise SystemExit(f"this planner found nothing that fits: {after}")
    head = [cli_row("after (this planner)", after[0])]
    if before is not None:
        head.insert(0, cli_row(f"before ({args.before})", before[0] if isinstance(before[0], str) else before[0][0]))
    tables = {
        "Best plan, `autotune plan --profile P --nodes 8 --gpus-per-node 8 --batch-size 512 --memory-limit 80GiB`":
            _results.markdown_table(["planner", "pp×dp", "data parallel", "schedule", "step s", "peak / rank"], head),
        "Each layout and data-parallel choice: the fastest that fits, else the leanest (plan() per layout)":
            _results.markdown_table(["pp×dp", "data parallel", "fits 80 GiB", "schedule", "step s", "peak / rank",
                                     "all-gather s", "reduce-scatter s", "plan s"], rows),
        "Where the fullest rank's memory goes (the same rows)": _results.markdown_table(
            ["pp×dp", "data parallel", "schedule", "rank", "parameters (fp32)", "state (fp32: params, grads, "
             "AdamW; sharded: param + AdamW shards)", "working copy (bf16)", "unsharded fp32 grads",
             "receive buffers", "peak"], details),
        "The after plan's top 5": _results.markdown_table(
            ["#", "pp×dp", "data parallel", "schedule", "step s", "peak / rank"],
            [[i + 1, *cli_row("", e)[1:]] for i, e in enumerate(after)]),
    }
    notes = (
        f"Synthetic profile: {parameters / 1e9:.2f} B parameters (80 blocks of {block_parameters() / 1e6:.1f} M, "
        f"embedding and head of {VOCAB * HIDDEN / 1e9:.2f} B each), sequence {SEQ}, bf16, times at "
        f"{args.tflops:g} TFLOP/s per GPU: pure compute {compute:.1f} s per step of {BATCH} sequences over "
        f"{NODES * GPUS_PER_NODE} GPUs (forward + backward of every layer, nothing else). Links: `autotune plan "
        f"--nodes`'s cuda defaults (NVLink-class 50 GB/s inside a node, {INTER_NODE_BANDWIDTH / 1e9:g} GB/s and "
        f"{INTER_NODE_LATENCY * 1e6:g} us per message between nodes). `all-gather s` and `reduce-scatter s`: the "
        "slowest rank's FSDP2 collectives per step, hidden behind compute or not; `plan s`: plan() wall time for "
        "the layout (this machine, shared). The sharded memory follows torch's pipeline stage: gradients accumulate "
        "unsharded in float32 until the stage's last backward (no reduce-scatter per micro-batch), and a stage a "
        "backward gathered stays gathered until the next forward (or the step's end without resharding).\n\n"
        f"The after plan's best, {after[0]['pipeline_degree']}×{after[0]['data_parallel_degree']}: its busiest "
        f"rank computes {busiest_rank_compute_s(profile, after[0]):.1f} s per step (its stages' forward, backward "
        "and recompute for every micro-batch), against the 34 s of a perfect spread: 82 layers do not split evenly "
        "over its ranks, and full checkpointing adds a forward. What binds memory: for shard, the unsharded float32 "
        "gradients (4 B per parameter of the rank's stages, as torch's pipeline stage defers the reduce-scatter to "
        "the stage's last backward) and torch's receive buffers (one per micro-batch, in and out) before the "
        "sharded state; so pp 8 x 8 shard, whose state is 13 GiB, needs 90 GiB.\n\n"
        f"After-planner CLI wall time {after_s:.0f} s" + (f"; before {before[1]:.0f} s." if before else ".")
        + " (This machine is shared: times are not benchmarks.)"
    )
    data = {"per_layout": rows, "after": after, "before": before[0] if before else None,
            "pure_compute_s": compute, "parameters": parameters, "tflops": args.tflops}
    path = _results.write("plan_70b", title="Planning a Llama-3-70B-sized model on 8 x 8 GPUs of 80 GiB",
                          device="cpu", tables=tables, data=data, notes=notes)
    print(path)


if __name__ == "__main__":
    main()
