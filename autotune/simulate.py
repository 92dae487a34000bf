"""Pure: replay a schedule's per-rank action lists in virtual time with profiled costs -> Estimate."""

from __future__ import annotations

import bisect
import functools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, fields, replace
from itertools import accumulate, pairwise
from typing import Any, cast

from autotune.action_graph import ActionGraph, compile_graph, compiled_graph, sweep_order
from autotune.candidate import Candidate
from autotune.costs import CheckpointPasses, LayerCost, Profile, stage_gradient_moves, stage_shared_copy_bytes
from autotune.errors import UsageError
from autotune.memory_model import (
    WeightGradients,
    arrival_copy_bytes,
    autocast_copy_bytes,
    batch_bytes,
    boundary_shared,
    cast_on_wire,
    dp_shards,
    first_weight_bytes,
    gather_buffer_bytes,
    gradient_shard_bytes,
    gradients_made_in_step,
    held_per_microbatch,
    input_backward_bytes,
    input_held_elsewhere_bytes,
    layer_backward_bytes,
    loss_backward_bytes,
    optimizer_step_bytes,
    output_saved_bytes,
    param_dtype_factor,
    parameter_memory_bytes,
    receive_buffer_bytes,
    recompute_bytes,
    reduce_buffer_bytes,
    sends_kept_to_the_end,
    sent_bytes,
    split_kept_bytes,
    unsharded_gradient_bytes,
    weight_gradient_factor,
    weight_version_bytes,
    wire_bytes,
    working_copy_bytes,
)
from autotune.placement import crossing_boundaries, dp_nodes
from autotune.schedules import SCHEDULES, Action, ActionKind, Schedule, stage_ranks
from autotune.tp_costs import tensor_parallel_layer_costs

TP_CPU_OVERHEAD_MS = 1.5
"""What one tensor-parallel collective costs a CPU rank beyond its wire time (gloo over loopback): DTensor's
dispatch of the sharded modules' ops around it (sharding propagation, redistribution) and the functional
collective's call and wait. bench/tp_block.py on the 2-core development machine at load ~2 (not quiet): one Llama
layer (hidden 64, micro-batch 4 x 32 tokens) took 2.0 ms whole and 16.3 ms at tp 2 with its 7 collectives, whose
gloo all-reduce alone takes 0.67 ms (bench/results/tp_block.md): (16.3 - 2.0 / 2) / 7 - 0.67 = 1.5 ms."""

# The CPU stand-in's rank-side costs, each measured inside real trials by bench/action_trace.py (a tracer in every
# rank times each action, the stage module's own forward and backward inside it, each post and wait of a send or
# receive and the optimizer step; bench/results/action_trace_*.md): 48 configurations of the six calibration models
# (all nine synchronous schedules, 1 to 16 micro-batches), 96 rank-steps. Least squares over them:
#   module time beyond the profile  = 0.089 ms per action + 0.116 x the profile's compute
#   the rank's time outside actions = 0.80 ms per step + 0.049 ms per action (schedule, loss, zero_grad), plus
#                                     0.024 ms per action inside torch's stage code, around the module
# medians: posting a send or receive 0.098 ms; a message waited for arrived 0.020 ms after its post. The run
# committed in bench/results (profiles with the split-backward extras, which take part of the per-action term):
#   0.044 ms per action + 0.138 x the profile's compute; 0.85 ms per step + 0.044 per action; 0.090; 0.020 ms.
CPU_LATENCY_S = 20e-6
"""A send's latency on the CPU stand-in: from the sender's post to the end of the receiver's wait (traced median)."""
CPU_MESSAGE_OVERHEAD_MS = 0.06
"""Posting one send or receive (torch's _batch_p2p over gloo), on the rank's own time, where the other rank does not
post to it at that moment (else CROSSING_POST_CPU_MS too): traced medians 0.03-0.08 ms. It was 0.1, the median of
all posts, crossing ones included."""
CPU_PER_ACTION_OVERHEAD_MS = 0.1
"""Per compute action: 0.089 (the module's call beyond its blocks' profiled times) + torch's stage code and the
schedule's own work between actions (traced medians 0.013-0.045 ms). It was 0.16, with 0.049 ms per action of a
least-squares fit's "outside the actions", which carried what the crossing posts cost."""
HOST_CALL_REFERENCE_MS = 0.0385
"""Profile.host_call_ms on the machine where CPU_PER_ACTION_OVERHEAD_MS was traced: the median of the optimizer-call
probes (the same AdamW step over one element, 35-41 us; Profile.optimizer_call_ms of its 2026-11-28/29 calibrations'
profiles, all AdamW). Another host's per-action cost is the constant times its own probe over this one
(LinkModel.for_profile). The optimizer-call probe takes the median of 5 steps, host_call_ms of 51: on a 2-core EPYC
VM the first read 66-72 us where the second read 56-59, so the scale it gives is, if anything, short."""
HOST_SCALE_RANGE = (0.25, 4.0)
"""How far a host's probe may move the per-action overhead (a probe off by more is a disturbed measurement)."""


def host_scale(host_call_ms: float) -> float:
    """What a host's probe (Profile.host_call_ms) puts on the CPU stand-in's Python-side costs: the probe over
    HOST_CALL_REFERENCE_MS, within HOST_SCALE_RANGE (LinkModel.for_profile)."""
    low, high = HOST_SCALE_RANGE
    return min(high, max(low, host_call_ms / HOST_CALL_REFERENCE_MS))
CROSSING_POST_CPU_MS = 1.0
CROSSING_POST_WINDOW_CPU_MS = 0.2
"""A post to a rank that posts to this one at the same moment now and then waits ~3 ms, where a post takes ~0.05:
gloo's tcp device threads spin while a post holds their pair's lock (pytorch/gloo#246), and two ranks posting to
each other at once on the 2-core machine lose both cores to them until the next scheduler tick (bench/gloo_cross.py:
6-28 % of such posts 2.3-4.8 ms). Inside real trials, `python bench/action_trace.py --model bench/models/
embed_mlp.py --batch-size 64 --repeats 2 --name action_trace_crossing_embed_mlp --configs ...` (bench/results/
action_trace_crossing_embed_mlp.md): of the posts that began within 0.1 ms of one of the other rank's, 11-27 % took
over 1 ms (medians 2.4-3.4 ms), 0.36-0.74 ms per such post (GPipe m8 0.71, LoopedBFS m8 0.74, Interleaved1F1B m8
0.47, VHalf m8 0.63, DualPipeV m16 0.36); of the other posts 0-3 %; 1F1B m8's posts never came that close (its
sends wait for their receives). Behind a light first stage 1F1B's do (bench/results/action_trace_1f1b_embed_mlp.md:
embed_mlp [1-4] m4 and m8: 15 of 36 and 42 of 98 over 1 ms, 1.1 and 1.4 ms per crossing post, and the two
predicted 30 and 37 % under; none on [1-4] m2 and [3-2] m8, within 5 %). The replay charges 0.6 ms a crossing post
by its own times, weighted down linearly with the distance between the two posts, none from 0.2 ms apart, in
expectation over the posts' jitter about the replay's times (CROSSING_POST_JITTER_CPU_MS; LinkModel.crossing_post_ms,
_crossing_share), to every synchronous schedule, 1F1B included since the jitter (see there). Whole
steps, the committed calibrations predicted again (--from-json, 13 model runs): mean step-time error 10.6 -> 8.2 %
(with the two constants above; neither alone did it); a fresh calibration of the four bench models: MAPE 7.6-9.7 %
(bench/results/calibration_models_1915.md), against 6.9-17.3 % (calibration_models_1530.md). The posts are placed
where torch's runtime makes them: a fused pair's sends after its backward (ActionGraph.sent) and the multi-stage
schedules' receives where _add_send_recv puts them (_receives_posted), not at the previous action's end; over the
576 configurations of the committed calibrations (pp 2, every schedule) the mean step-time error went 8.2 -> 7.9 %,
DualPipeV's 11.2 -> 9.7 % and ZBVZeroBubble's 9.0 -> 7.9 %.

It was 0.6 ms a crossing post, each post charged: where a rank posts its sends and receives together after an action
(DualPipeV's middle rank: two sends and two receives after each fused pair; its first rank one pair at a time), the
one rank paid twice the other's, though the trace measured the two alike. bench/models/mlp13.py DualPipeV m32 on the
2-core EPYC VM (bench/results/action_trace_dualpipev_mlp13.md): 9.6 and 11.0 ms a step of posts over 1 ms on ranks 0
and 1; charged 11.5 and 21.6 ms, so predicted +18 % over its measurement in the headline calibration (over in all
seven passes). Now a rank's posts to one peer at one moment cross once (_crossing_posts): 10.3 ms on each rank, +2 %.
Refitted over the 3139 pp 2 configurations of the committed calibrations (the sweep re-predicts every
bench/results/calibration*.json): once a moment at 0.6 ms 8.34 %, 0.8 7.91 %, 0.9 7.78 %, 1.0 7.69 %, 1.1 7.69 %,
1.2 7.76 %, against 7.88 % for each post at 0.6 ms; DualPipeV's family 9.23 -> 8.22 %, every other fp32 family
within 0.1 point or better (GPipe 7.20 -> 6.83 %, InterleavedZeroBubble 7.87 -> 7.41 %, LoopedBFS 8.75 -> 8.52 %)."""
CROSSING_POST_JITTER_CPU_MS = 0.1
"""How far a post's moment strays from the replay's (the spread of a normal): the replay places posts to the
microsecond, the runtime's wander by about an action's overhead (CPU_PER_ACTION_OVERHEAD_MS), and the crossing share
is taken in expectation over it (_crossing_share). Without it the share's triangle slopes at 1 / window from an exact
alignment, which the replay makes wherever ranks' stages are equal: 1F1B was left uncharged because charging it made
the planner buy a 3 % the term made up with an uneven split on 96 equal tiny layers over 8 ranks (a step of 8.2 ms
then 27.8; [12-12-12-8-16-12-12-12] + checkpointing first, tests/unit/test_partition.py). With 0.1 ms the even split
is first again (23.3 ms, the uneven ones within 0.05 %), and 1F1B is charged. Over the 840 configurations of the
committed calibrations (bench/calibrate.py --from-json, every schedule, the recipes and the four bench models) the
mean step-time error went 7.73 -> 7.46 % (1F1B's 7.9 -> 7.5, DualPipeV's 10.8 -> 9.3 %); the 13-layer MLP's in the
headline calibration 11.4 -> 9.5 % (its 1F1B m8 -20 -> -1 %, DualPipeV m32 +61 -> +30 %). Swept: 0.05 ms 7.53 %,
0.15 ms 7.69 %, 0.2 ms 7.86 %, 0.3 ms 8.36 %."""
CPU_COMPUTE_SLOWDOWN = 0.12
"""Profiled compute runs 11.6 % slower inside a two-rank pipelined step than timed alone (traced fit)."""
CPU_STEP_OVERHEAD_MS = 0.8
"""Once per step and rank outside its actions (traced fit's intercept)."""

COLLECTIVE_CPU_BANDWIDTH_BYTES_PER_S = 1.05e9
"""What gloo's collectives get per byte of a ring step on the CPU stand-in, where the rank's own thread and gloo's
share a core. `python bench/gloo_wake.py --repeats 2` part 4 (8 Linear(W, W) units, W 256-1448: 0.25-8 MiB a unit;
2 one-thread ranks), least squares over the widths, ms per MiB of the tensor beyond a fixed 1.6-2.0 ms
(COLLECTIVE_WAKE_CPU_MS): DistributedDataParallel's sync 0.59, FSDP2's all-gather 0.95 and its reduce-scatter 1.34
a unit (bench/results/gloo_wake.md; two earlier runs: 0.72, 0.89, 1.30 and 0.72, 0.86, 1.38), where the ring over
the point-to-point 3 GB/s charged 0.35, 0.17 and 0.17. gloo's collectives alone, back to back, 16 MiB: all-gather
9.9, all-reduce 13.3, reduce-scatter 20-22 ms (medians; a /tmp script). So here an all-gather costs about an
all-reduce's two ring passes of its tensor and a reduce-scatter three (LinkModel.all_gather_passes,
reduce_scatter_passes), at one rate: 1.05 GB/s, 1.0 ms per MiB for the first two and 1.5 for the reduce-scatter.
Checked on whole trials, recipes/mlp.py dp 2 at B 64 (8.9 MB of gradients in 10 units), 1F1B: replicate m1 and m4
24.2 and 39.3 ms measured, 19.1 and 33.8 predicted with the ring over 3 GB/s, 24.3 and 37.6 with this."""

SHARD_UNIT_OVERHEAD_CPU_MS = 0.18
SHARD_UNIT_OVERHEAD_CPU_MS_PER_MIB = 0.015
"""FSDP2's hooks per unit and compute action on the CPU stand-in, the unit already gathered, and what they cost more
per MiB of the unit's parameters: `python bench/gloo_wake.py --repeats 2` part 5 (8 units, 2 ranks, micro-batches
2-4 of a step under FSDP2 against the same module unsharded; least squares over units of 0.25-8 MiB of the mean
of a forward's and a backward's: 0.18 ms + 0.015 ms per MiB; an earlier run 0.15 + 0.024). Whole models the same
way (a /tmp script, 4 micro-batches of 8): bench/models/mlp13.py 0.19 / 0.16 ms a forward / backward (0.25 MiB
units), recipes/gpt.py 0.25 / 0.21 (0.19 MiB, 12 tensors a block), recipes/mlp.py 0.34 / 0.38 (up to 4 MiB)."""

REPLICA_FORWARD_OVERHEAD_CPU_MS = 0.18
"""DistributedDataParallel's forward on the CPU stand-in beyond the stage module's, per forward of a replicated
stage (LinkModel.replica_forward_overhead_ms), at the reference host (HOST_CALL_REFERENCE_MS; LinkModel.for_profile
scales it). `python bench/ddp_forward.py --repeats 300` (bench/results/ddp_forward.md; a stage wrapped as
runtime._replicate wraps it, under no_sync, against the module alone, call by call): the forward +0.13-0.29 ms over
seven models (median 0.25 on a 2-core EPYC VM whose probe read 53 us: 0.18 here), the backward +0.03. In trials it
went unpriced, where it is paid by every micro-batch: mlp13 pp 1 x dp 2 at B 256 stepped 1.2 / 4.9 / 7.9 ms slower
at 1 / 8 / 32 micro-batches under DDP than with one flat all-reduce after the schedule (bench/dp_overlap.py
--model bench/models/mlp13.py, bench/results/dp_overlap_mlp13_m*.md), and its dp 2 trials at 1-16 micro-batches
were predicted 4-17 % under (5-10 % with the term; the same at 32 micro-batches, of 4 samples, +5 -> +15 %, where
the profile already over-counts). bench/calibrate.py --from-json bench/results/calibration_dp.json (dp 2, the
development machine): step-time MAPE mlp 8.9 -> 7.9 %, gpt 12.0 -> 11.6, cnn 7.2 -> 6.8, mlp13 12.1 -> 11.5,
gpt2block 3.6 -> 4.1."""

SHARDED_OPTIMIZER_GROUP_CPU_MS = 0.4
"""AdamW over FSDP2's DTensor shards on the CPU stand-in, per parameter-holding module beyond half the unsharded
step: `python bench/gloo_wake.py --repeats 2` part 5 (one Linear per unit: median 0.45 ms, 0.39-1.0 over units
of 0.25-8 MiB); whole models the same way (a /tmp script): recipes/gpt.py 14.8 ms against 3.4 unsharded (40
modules: 0.33 each), bench/models/mlp13.py 8.0 against 3.2 (13: 0.49), recipes/mlp.py 10.6 against 8.4 (10:
0.64)."""

COLLECTIVE_WAKE_CPU_MS = 2.0
"""What a collective a CPU rank waits for costs beyond its wire time: gloo's threads sleep while the rank computes,
and waking them is slow on a VM (up to a 4 ms scheduler tick at the development machine's 250 Hz).
`python bench/gloo_wake.py --repeats 3` (bench/results/gloo_wake.md; 2 one-thread ranks, bench/models/mlp13.py):
- a 64 B all-reduce: 0.31 ms back to back, 0.7-3.6 ms (median, by run) after 8 ms of compute;
- FSDP2 (13 units, one at a time): 1.4-1.5 ms per all-gather and 2.3-2.7 ms per reduce-scatter beyond half the
  one-rank compute, against ~0.55 ms of wire each on LinkModel.for_device("cpu"); `autotune trial
  bench/models/mlp13.py --gpus 2 --device cpu --batch-size 256 --microbatches 1 --dp 2 --data-parallel shard
  --schedule 1F1B` stepped in 58-67 ms against 10.9 predicted without this term: 1.8-2.2 ms per collective;
- DistributedDataParallel (a 1 MiB and a 2.2 MB bucket): 3.5-5.7 ms more per forward and backward than without it,
  4.4-6.8 (median 5.5) in six runs by hand the same way, against 3.1 ms for the two all-reduces' wire. Its buckets
  queue back to back on gloo's thread, which stays awake: 13 buckets cost ~0.35 ms each beyond two.
One figure, 2.0 ms: paid by each FSDP2 unit's collective, and once by DDP's sync."""


@dataclass(frozen=True, kw_only=True)
class LinkModel:
    """What the profile does not see: moving tensors between ranks, per-action bookkeeping, the optimizer step."""

    bandwidth_bytes_per_s: float
    """Point-to-point bandwidth between two pipeline ranks (and per ring step of the data-parallel all-reduce)."""
    latency_s: float
    """Fixed delay of one send/recv."""
    per_action_overhead_ms: float
    """Runtime bookkeeping added to every compute action: the schedule's own work around it, torch's stage code, the
    stage module's call beyond its blocks' profiled times (autograd's set-up of a backward, small kernels)."""
    optimizer_bytes_per_s: float
    """Parameter bytes per second one optimizer step gets through; used only when the profile did not time it."""
    message_overhead_ms: float = 0.0
    """Time a rank itself spends posting one send or one receive to another rank (charged on its own timeline, to
    the action that sends and to the one that receives), on top of the wire time the receiver waits for."""
    held_activation_ms_per_mib: float = 0.0
    """Slowdown of each backward action per MiB of activations its rank holds at that moment (memory pressure:
    allocator page faults, cache misses, more messages outstanding); 0 where it was not seen (cuda)."""
    inter_node_bandwidth_bytes_per_s: float | None = None
    """Point-to-point bandwidth between ranks on different nodes (per rank: each has its own path, as with
    rail-optimised NICs); None: as inside a node."""
    inter_node_latency_s: float | None = None
    """Fixed delay of one send/recv between nodes; None: as inside a node."""
    inter_node_allreduce_bandwidth_bytes_per_s: float | None = None
    """What the backend's collectives get out of the link between nodes, per ring step's bytes (the probe times an
    all-reduce: gloo's over a 20 Mbit/s link moved its bytes at ~88 % of one stream's rate); None: the point-to-point
    inter-node bandwidth."""
    tensor_parallel_efficiency: float = 1.0
    """Tensor parallel: how much of the ideal 1/tp a sharded layer's compute gets (autotune.tp_costs: its time is
    the sharded part / (tp x this)); smaller matrix products run below the whole one's rate."""
    tensor_parallel_overhead_ms: float = 0.0
    """Tensor parallel: what each tp collective costs the rank beyond the wire (DTensor's bookkeeping around it, the
    call itself), per call."""
    late_receives_wake: bool = False
    """Whether a receive posted after its send waits for the sending rank's collective thread to wake: gloo moves
    such a send in its own thread, which sleeps while the rank computes (a 4 KiB-1 MiB receive posted 3 ms late
    arrived a median 2.3-4.0 ms after it was posted while the sender computed, on the development machine), or the
    sending rank's next call into gloo does (its next post or wait; traced in trials: 0.7 and 1.7 ms). The replay
    charges min(collective_wake_ms, until the sender's action then running ends)."""
    sends_on_rank: bool = False
    """Whether a send's bytes go out on the sending rank's own time, so that they have arrived (but for the
    latency) when its post returns: gloo over TCP writes them into the socket in the thread that posts the send
    (two CPU ranks over loopback: posting 1 MiB took 0.30 ms, 4 MiB 1.05 ms, and the receiver's waiting recv
    completed 0.002 ms after). False: the wire time is the receiver's wait alone (NCCL sends on its own stream).
    Between nodes the sender pays the same copy into its socket (at the rate inside a node: traced posts of 32 KiB
    took as long over the link as inside the node), and the receiver waits for the slower wire besides."""
    compute_slowdown: float = 0.0
    """Share by which profiled compute (layers, loss, the optimizer step) runs slower inside a pipelined step than
    timed alone: other ranks computing beside it and the stages' micro-batches taking turns share caches and memory
    bandwidth (bench/action_trace.py measures it per rank); 0 where it was not measured (cuda)."""
    step_overhead_ms: float = 0.0
    """What every rank pays once per step outside its actions and optimizer: the schedule's set-up (splitting the
    batch into micro-batches), zero_grad, collecting the losses."""
    gradient_sync_overlaps: bool = True
    """Whether DistributedDataParallel's bucketed all-reduces run beside the backward that fills them (NCCL on its
    own stream); False where they take the rank's own time (gloo on the CPU core the rank computes on)."""
    collective_bandwidth_bytes_per_s: float | None = None
    """What a data-parallel collective inside a node gets per byte of each ring step (DDP's all-reduce, FSDP2's
    all-gathers and reduce-scatters); None: the point-to-point bandwidth (NCCL's rings). gloo on the CPU stand-in
    moves a collective's bytes at well under a send's rate (COLLECTIVE_CPU_BANDWIDTH_BYTES_PER_S)."""
    all_gather_passes: int = 1
    """Ring passes an all-gather costs: 1, half an all-reduce (NCCL's rings); 2 on the CPU stand-in, where FSDP2's
    all-gather over gloo costs about what an all-reduce of the same tensor does (COLLECTIVE_CPU_BANDWIDTH_BYTES_PER_S
    says what was measured). Inside a node: across nodes, where the wire decides, an all-gather is one pass."""
    reduce_scatter_passes: int = 1
    """Ring passes a reduce-scatter costs inside a node: 1 (NCCL); 3 on the CPU stand-in, where gloo's
    reduce-scatter is slower than its all-reduce of the same tensor (COLLECTIVE_CPU_BANDWIDTH_BYTES_PER_S)."""
    all_gather_passes_across_nodes: float = 1.0
    """Ring passes an all-gather costs on the link between nodes: 1 (NCCL); 1.5 for gloo over TCP, whose
    all_gather_into_tensor of one FSDP2 unit across a tbf-shaped link settles, after its first few calls, at 1.5 to
    1.6 times the wire time of the half each rank sends, where an all-reduce of the same bytes moves both ways at
    once in one: bench/internode.py's collective table (mlp13's 263 kB unit, 2 ranks: 83 ms against 55 at 20
    Mbit/s, 9.0 against 5.7 at 200; spaced 300 ms apart the same)."""
    reduce_scatter_passes_across_nodes: int = 1
    """Ring passes a reduce-scatter costs on the link between nodes: 1 (NCCL); 2 for gloo, whose reduce-scatter
    moves an all-reduce's bytes: bench/internode.py, mlp13 dp 2 sharded across a tbf-shaped link (13 units, 3.3 MiB),
    what the link added to the step was 3.4 (20 Mbit/s) and 3.5 (200 Mbit/s) times what one ring pass of the
    replicated all-reduce took (an all-gather's pass and a reduce-scatter's two: 3)."""
    sharded_optimizer_group_ms: float = 0.0
    """What the optimizer step costs a sharded rank per parameter-holding module beyond its shards' bytes: stepping
    DTensors a tensor at a time goes through DTensor's dispatch for each op (torch's default AdamW off CUDA); 0 where
    it was not measured (cuda: foreach steps a list at once). CPU: SHARDED_OPTIMIZER_GROUP_CPU_MS."""
    shard_unit_overhead_ms: float = 0.0
    """What FSDP2's hooks cost a rank per sharded unit and compute action, its parameters already gathered (its
    pre/post-forward and pre/post-backward work on the rank's thread); 0 where it was not measured (cuda: the hooks
    run ahead of the GPU's kernels). CPU: SHARD_UNIT_OVERHEAD_CPU_MS."""
    shard_unit_overhead_ms_per_mib: float = 0.0
    """What FSDP2's hooks cost beyond shard_unit_overhead_ms per MiB of the unit's parameters, per compute action
    (larger units cost more: the gradients a backward accumulates unsharded between syncs, among others); 0 where
    it was not measured (cuda). CPU: SHARD_UNIT_OVERHEAD_CPU_MS_PER_MIB."""
    collective_wake_ms: float = 0.0
    """What a data-parallel collective the rank waits for costs it beyond the wire time, where the collectives'
    threads sleep while the rank computes (gloo on the CPU stand-in, COLLECTIVE_WAKE_CPU_MS): paid by each FSDP2
    unit's all-gather and reduce-scatter, and once per step by DistributedDataParallel's sync (its buckets queue back
    to back behind the first)."""
    replica_forward_overhead_ms: float = 0.0
    """What DistributedDataParallel's forward costs the rank beyond the stage module's, per forward action of a
    replicated stage it wraps (runtime.overlaps_gradient_sync): its Python around the call (the no_sync check, the
    inputs' walk, the reducer's bookkeeping), paid by every micro-batch, not only the one that syncs; 0 where it
    was not measured (cuda: it runs ahead of the GPU's kernels). CPU: REPLICA_FORWARD_OVERHEAD_CPU_MS, scaled to the
    profiled host as per_action_overhead_ms is (for_profile)."""
    crossing_post_ms: float = 0.0
    """What a send or receive post costs on average beyond message_overhead_ms when the rank it goes to or comes
    from posts at the same moment, weighted down with the distance (_crossing_share: crossing_post_window_ms,
    crossing_post_jitter_ms; CPU: CROSSING_POST_CPU_MS); 0 where it was not seen (cuda)."""
    crossing_post_window_ms: float = 0.1
    """How close two ranks' posts to each other must be for crossing_post_ms."""
    crossing_post_jitter_ms: float = 0.0
    """How far a post's moment strays from the replay's (a normal spread), for crossing_post_ms: the share a post
    pays is the expectation over it (_crossing_share). CPU: CROSSING_POST_JITTER_CPU_MS."""
    idle_resume_ms: tuple[tuple[float, float], ...] = ()
    """What a compute action costs beyond its own time right after its rank was idle: (gap ms, extra ms) points,
    the gaps rising, linear between them (from (0, 0)) and flat beyond the last, for an action of
    idle_resume_window_ms or longer; a shorter one pays its share. The gap runs from the end of the rank's previous
    action (the step's start for its first) to the action's start by the replay's times. () : no charge (cuda, and
    profiles without the host's probe: Profile.idle_resume_ms, which for_profile takes)."""
    idle_resume_window_ms: float = 0.0
    """The length of action that pays all of idle_resume_ms (the probe's workload)."""
    nodes_share_host: bool = False
    """Whether the "nodes" are one machine (network namespaces or containers on one kernel: the inter-node probe
    found the same boot id on both), so that ranks on different nodes still share its cores: crossing_post_ms is
    charged across nodes as inside one. A post crossing one of its peer's costs the cores both ranks' gloo threads
    spin on (bench/gloo_cross.py); on separate machines each node has its own. bench/internode.py's two namespaces
    on the 2-core Xeon VM (internode_xeon, unshaped rows): VHalf m4 measured 27.7 ms across the veth, 25.0 with both
    ranks on one node, predicted 22.2 across without the crossing posts (-20 %), 26.3 with them (-5 %); GPipe m4 with
    checkpointing -18 -> -6 %; the unshaped rows' mean error over that run and three saved ones 10.0 / 12.9 / 8.9 /
    9.2 -> 6.7 / 12.9 / 8.7 / 7.0 %, the shaped rows' within a point."""

    def __post_init__(self) -> None:
        # a study's stored link comes back from JSON with lists: keep the points a tuple of pairs (hashable)
        object.__setattr__(self, "idle_resume_ms", tuple((float(g), float(ms)) for g, ms in self.idle_resume_ms))

    @classmethod
    def for_profile(cls, profile: Profile, **overrides: float) -> LinkModel:
        """for_device(profile.device), with the CPU stand-in's per-action overhead scaled to the profiled host.

        A rank's time around each action is Python and torch's dispatch (the module call, the stage and schedule
        code), so it moves with the host's speed at those, not with its compute. On a 2-core EPYC VM whose probe
        (Profile.host_call_ms) read 56-59 us against the development machine's 35-41, the calibration models' steps
        at many micro-batches were under-predicted by 18-28 % with the defaults; with this term scaled (x1.46-1.52)
        the seven models' step-time MAPE went 10.2 -> 8.8 % on average and the goal was met on five instead of four
        (bench/results/calibration_host.md). DistributedDataParallel's forward (replica_forward_overhead_ms) is
        Python around the module's call too, and scales alike; so do the posts of sends and receives
        (message_overhead_ms, crossing_post_ms: torch's _batch_p2p and gloo's dispatch on the rank's thread). On
        that VM a one-way post took 0.18-0.27 ms against the development machine's 0.09-0.15 (x1.8-2.0,
        bench/results/gloo_cross_host.md) and a crossing one 1.37 ms in a 1F1B m8 of bench/models/mlp13.py against
        the 0.6 charged (action_trace_mlp13_host.md); scaled by the probe (x1.45-1.5), its saved runs predicted
        again (bench/calibrate.py --from-json): calibration_host's seven models' step-time MAPE 8.84 -> 7.56 %
        (mean signed error -6.0 -> -3.5 %), calibration_ckpt's five 7.55 -> 6.83 %; bench/internode.py --from-json
        internode_stage_ckpt's unshaped rows 11.3 -> 10.6 %, internode_host's no worse (6.0 %). Scaling the
        collectives' wake (collective_wake_ms, the scheduler's, not Python's) as well moved neither (7.51, 6.82 %).
        A field given in overrides is kept as given. Profiles without the probe (0: every development-machine
        calibration's), and CUDA's, keep the defaults.

        The profile's idle probe (Profile.idle_resume_ms, on the CPU) becomes idle_resume_ms as measured."""
        link = cls.for_device(profile.device, **overrides)
        if profile.device == "cpu" and profile.idle_resume_ms and "idle_resume_ms" not in overrides:
            link = replace(link, idle_resume_ms=profile.idle_resume_ms,
                           idle_resume_window_ms=profile.idle_resume_window_ms)
        if profile.device != "cpu" or profile.host_call_ms <= 0:
            return link
        scale = host_scale(profile.host_call_ms)
        python_side = ("per_action_overhead_ms", "replica_forward_overhead_ms", "message_overhead_ms",
                       "crossing_post_ms")
        scaled = {name: getattr(link, name) * scale for name in python_side if name not in overrides}
        return replace(link, **scaled)

    @classmethod
    def for_device(cls, device: str, **overrides: float) -> LinkModel:
        """Defaults for cpu (gloo over loopback, one thread per rank) or cuda (NCCL); any field can be overridden.

        The cpu numbers are for two one-thread ranks over gloo on the 2-core development machine. Bandwidth comes
        from a large send/recv (3 GB/s); latency, message and per-action overheads, the compute slowdown and the
        step overhead were each measured inside real trials, term by term (CPU_LATENCY_S and the constants beside
        it; bench/action_trace.py), and checked against whole steps by bench/calibrate.py
        (bench/results/calibration.md). The held-activation slowdown is 0 on cpu: the compute slowdown is what
        the traces show of it. The cuda link ones are NVLink-class guesses
        with no memory-pressure term: one GPU (the only CUDA machine this was run on, an H200) has no peer to
        measure a link to. Its pp = 1 trials (bench/cuda_first_run.py) put the per-action overhead at or below 0 (the
        per-block profile over-counts small kernels' launches; a compute-bound GPT's steps were predicted within
        +1..+8 %), so the 0.05 ms stays.

        Tensor parallel (assumed, not calibrated on a GPU): on cuda 90 % of the ideal 1/tp for a sharded layer's
        compute and 0.02 ms per collective beyond the wire; on cpu (one thread a rank) the compute splits whole and
        each collective costs TP_CPU_OVERHEAD_MS beyond gloo's wire (see there)."""
        if device.startswith("cuda"):
            base = {"bandwidth_bytes_per_s": 50e9, "latency_s": 20e-6, "per_action_overhead_ms": 0.05,
                    "optimizer_bytes_per_s": 200e9, "message_overhead_ms": 0.01, "held_activation_ms_per_mib": 0.0,
                    "compute_slowdown": 0.0, "step_overhead_ms": 0.0, "sends_on_rank": False,
                    "late_receives_wake": False,
                    "tensor_parallel_efficiency": 0.9, "tensor_parallel_overhead_ms": 0.02}
        elif device == "cpu":
            base = {"bandwidth_bytes_per_s": 3e9, "latency_s": CPU_LATENCY_S,
                    "per_action_overhead_ms": CPU_PER_ACTION_OVERHEAD_MS, "optimizer_bytes_per_s": 1e9,
                    "message_overhead_ms": CPU_MESSAGE_OVERHEAD_MS, "held_activation_ms_per_mib": 0.0,
                    "compute_slowdown": CPU_COMPUTE_SLOWDOWN, "step_overhead_ms": CPU_STEP_OVERHEAD_MS,
                    "sends_on_rank": True, "late_receives_wake": True,
                    "tensor_parallel_efficiency": 1.0, "tensor_parallel_overhead_ms": TP_CPU_OVERHEAD_MS,
                    "crossing_post_ms": CROSSING_POST_CPU_MS, "crossing_post_window_ms": CROSSING_POST_WINDOW_CPU_MS,
                    "crossing_post_jitter_ms": CROSSING_POST_JITTER_CPU_MS,
                    "gradient_sync_overlaps": False, "collective_wake_ms": COLLECTIVE_WAKE_CPU_MS,
                    "replica_forward_overhead_ms": REPLICA_FORWARD_OVERHEAD_CPU_MS,
                    "collective_bandwidth_bytes_per_s": COLLECTIVE_CPU_BANDWIDTH_BYTES_PER_S,
                    "all_gather_passes": 2, "reduce_scatter_passes": 3, "reduce_scatter_passes_across_nodes": 2,
                    "all_gather_passes_across_nodes": 1.5,
                    "shard_unit_overhead_ms": SHARD_UNIT_OVERHEAD_CPU_MS,
                    "shard_unit_overhead_ms_per_mib": SHARD_UNIT_OVERHEAD_CPU_MS_PER_MIB,
                    "sharded_optimizer_group_ms": SHARDED_OPTIMIZER_GROUP_CPU_MS}
        else:
            raise UsageError(f"no link model for device {device!r}; use cpu or cuda")
        unknown = set(overrides) - set(base) - {"inter_node_bandwidth_bytes_per_s", "inter_node_latency_s",
                                                "inter_node_allreduce_bandwidth_bytes_per_s", "idle_resume_ms",
                                                "idle_resume_window_ms"}
        if unknown:
            raise UsageError(f"unknown link model field(s) {sorted(unknown)}; known: {sorted(base)}")
        return cls(**{**base, **overrides})

    def transfer_ms(self, nbytes: float) -> float:
        """One point-to-point send of nbytes."""
        return (self.latency_s + nbytes / self.bandwidth_bytes_per_s) * 1e3 if nbytes > 0 else 0.0

    def allreduce_ms(self, nbytes: float, world_size: int, n_nodes: int = 1) -> float:
        """All-reduce of nbytes over world_size ranks: a reduce-scatter, then an all-gather (ring_ms, 2 passes).
        On one node a ring: 2(d-1) steps of nbytes/d each. Over n_nodes (k = world_size / n_nodes ranks each),
        hierarchically, as NCCL does: reduce-scatter and all-gather inside each node (a ring of k), and a ring
        all-reduce of the 1/k shard across the nodes on the inter-node link."""
        return self.ring_ms(nbytes, world_size, n_nodes, passes=2)

    def all_gather_ms(self, nbytes: float, world_size: int, n_nodes: int = 1) -> float:
        """All-gather of a tensor of nbytes (whole, gathered) from world_size equal shards: half an all-reduce
        (ring_ms, all_gather_passes passes inside a node, all_gather_passes_across_nodes across): FSDP2's unshard."""
        return self.ring_ms(nbytes, world_size, n_nodes, passes=self.all_gather_passes,
                            far_passes=self.all_gather_passes_across_nodes)

    def reduce_scatter_ms(self, nbytes: float, world_size: int, n_nodes: int = 1) -> float:
        """Reduce-scatter of nbytes (whole, before scattering) into world_size shards: the other half of an
        all-reduce (ring_ms, reduce_scatter_passes passes inside a node, reduce_scatter_passes_across_nodes across):
        FSDP2's gradient reduction."""
        return self.ring_ms(nbytes, world_size, n_nodes, passes=self.reduce_scatter_passes,
                            far_passes=self.reduce_scatter_passes_across_nodes)

    def ring_ms(self, nbytes: float, world_size: int, n_nodes: int = 1, *, passes: float,
                far_passes: float | None = None) -> float:
        """`passes` ring passes over nbytes (1: reduce-scatter or all-gather, 2: all-reduce), each d-1 steps of
        nbytes/d on one node; over nodes, the passes inside each node's ring of k plus `far_passes` (default
        `passes`) of the 1/k shard across the nodes on the inter-node link."""
        if world_size <= 1 or nbytes <= 0:
            return 0.0
        if n_nodes <= 1:
            steps = passes * (world_size - 1)
            bandwidth = self.collective_bandwidth_bytes_per_s or self.bandwidth_bytes_per_s
            return steps * (self.latency_s + nbytes / world_size / bandwidth) * 1e3
        k = max(1, world_size // n_nodes)
        inside = self.ring_ms(nbytes, k, passes=passes) if k > 1 else 0.0
        far = self.across_nodes()
        if self.inter_node_allreduce_bandwidth_bytes_per_s:
            far = replace(far, bandwidth_bytes_per_s=self.inter_node_allreduce_bandwidth_bytes_per_s)
        return inside + far.ring_ms(nbytes / k, n_nodes, passes=passes if far_passes is None else far_passes)

    def across_nodes(self) -> LinkModel:
        """The link between ranks on different nodes (this one where no inter-node figures are set)."""
        return replace(
            self,
            bandwidth_bytes_per_s=self.inter_node_bandwidth_bytes_per_s or self.bandwidth_bytes_per_s,
            latency_s=self.inter_node_latency_s if self.inter_node_latency_s is not None else self.latency_s,
            inter_node_bandwidth_bytes_per_s=None,
            inter_node_latency_s=None,
            inter_node_allreduce_bandwidth_bytes_per_s=None,
            collective_bandwidth_bytes_per_s=None,  # across nodes: the probed all-reduce's rate, or the link's
        )

    def with_probe(
        self,
        *,
        inter_latency_s: float,
        inter_bandwidth_bytes_per_s: float,
        intra_latency_s: float | None = None,
        intra_bandwidth_bytes_per_s: float | None = None,
        inter_allreduce_bandwidth_bytes_per_s: float | None = None,
        nodes_share_host: bool = False,
    ) -> LinkModel:
        """This link with inter-node figures from a probe (autotune.cluster). The calibrated intra-node figures
        absorb more than the wire (per-message costs of the runtime), so with an intra probe to compare, the model
        adds only the difference crossing makes: latency + (inter - intra), 1/bandwidth + (1/inter - 1/intra);
        without one, the probe's own figures. Never faster than inside a node. The all-reduce's bandwidth (where
        the probe timed one) scales the point-to-point one by what the collective got of the probed stream's.
        nodes_share_host: the probe found both nodes on one machine (LinkModel.nodes_share_host)."""
        if intra_latency_s is not None and intra_bandwidth_bytes_per_s:
            latency = self.latency_s + max(0.0, inter_latency_s - intra_latency_s)
            inverse = 1 / self.bandwidth_bytes_per_s + max(
                0.0, 1 / inter_bandwidth_bytes_per_s - 1 / intra_bandwidth_bytes_per_s
            )
            bandwidth = 1 / inverse
        else:
            latency = max(self.latency_s, inter_latency_s)
            bandwidth = min(self.bandwidth_bytes_per_s, inter_bandwidth_bytes_per_s)
        collective = None
        if inter_allreduce_bandwidth_bytes_per_s:
            collective = bandwidth * min(1.0, inter_allreduce_bandwidth_bytes_per_s / inter_bandwidth_bytes_per_s)
        return replace(self, inter_node_latency_s=latency, inter_node_bandwidth_bytes_per_s=bandwidth,
                       inter_node_allreduce_bandwidth_bytes_per_s=collective, nodes_share_host=nodes_share_host)


@dataclass(frozen=True, kw_only=True)
class TimelineEvent:
    """One compute action as simulated."""

    rank: int
    """Pipeline rank that ran it."""
    stage: int
    """Stage index."""
    kind: ActionKind
    """F, B, I or W."""
    microbatch: int
    """Micro-batch index."""
    start_ms: float
    """Start, from the beginning of the step."""
    end_ms: float
    """End, from the beginning of the step."""


@dataclass(frozen=True, kw_only=True)
class Estimate:
    """What the simulator predicts for one candidate."""

    step_time_ms: float
    """One optimizer step: the pipeline, then the gradient all-reduce (dp > 1) and the optimizer, slowest rank."""
    throughput_samples_per_s: float
    """Global batch size / step time."""
    bubble_fraction: float
    """Idle share of rank-time while the pipeline runs (0: every rank busy from first action to last)."""
    peak_memory_bytes: tuple[int, ...]
    """Per pipeline rank: parameters, grads, optimizer state, in-flight activations and receive buffers."""
    feasible: bool
    """Every rank's peak is within the memory limit (True when there is no limit)."""
    pipeline_time_ms: float
    """From the first action to the last, all ranks."""
    optimizer_ms: float
    """The slowest rank's optimizer step."""
    allreduce_ms: float
    """The slowest rank's data-parallel gradient all-reduce (0 with dp = 1, and sharded)."""
    gather_ms: float = 0.0
    """Sharded: the slowest rank's FSDP2 all-gathers of the step, hidden behind compute or not (0 otherwise)."""
    reduce_scatter_ms: float = 0.0
    """Sharded: the slowest rank's gradient reduce-scatters, one per stage after its last backward (0 otherwise)."""
    tensor_parallel_ms: float = 0.0
    """Tensor parallel: the slowest rank's tp collectives of the step, inside its compute actions (0 at tp 1)."""
    memory_limit_bytes: int | None = None
    """The limit feasible was judged against."""
    timeline: tuple[TimelineEvent, ...] = ()
    """Every compute action with its simulated start and end (empty when not asked for)."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "step_time_ms": self.step_time_ms,
            "throughput_samples_per_s": self.throughput_samples_per_s,
            "bubble_fraction": self.bubble_fraction,
            "peak_memory_bytes": list(self.peak_memory_bytes),
            "feasible": self.feasible,
            "pipeline_time_ms": self.pipeline_time_ms,
            "optimizer_ms": self.optimizer_ms,
            "allreduce_ms": self.allreduce_ms,
            "gather_ms": self.gather_ms,
            "reduce_scatter_ms": self.reduce_scatter_ms,
            "tensor_parallel_ms": self.tensor_parallel_ms,
            "memory_limit_bytes": self.memory_limit_bytes,
            "timeline": [
                {"rank": e.rank, "stage": e.stage, "kind": e.kind, "microbatch": e.microbatch,
                 "start_ms": e.start_ms, "end_ms": e.end_ms}
                for e in self.timeline
            ],
        }


def simulate(
    profile: Profile,
    candidate: Candidate,
    *,
    link: LinkModel | None = None,
    memory_limit_bytes: int | None = None,
    with_timeline: bool = True,
    actions: Sequence[Sequence[Action]] | None = None,
    gpus_per_node: int | None = None,
) -> Estimate:
    """Replay the candidate's schedule in virtual time with the profile's costs at its micro-batch size.

    Each rank runs its actions in order. F of stage s, micro-batch i waits for F of s-1 (plus a transfer when s-1
    lives on another rank); B or I of s waits for its own F and for B/I of s+1 (plus a transfer); W waits for its
    own I. A stage costs the sum of its layers (times 1 + link.compute_slowdown; a split backward's I and W with the
    layers' split extras) plus link.per_action_overhead_ms per action; with activation checkpointing B and I also
    pay one forward. Each rank pays link.step_overhead_ms once a step. `actions` replaces the schedule's own lists
    (custom schedules).
    gpus_per_node: the ranks fill nodes of this many (candidate.rank_order says how); a send between stages on
    different nodes, and the all-reduce of a data-parallel group spread over nodes, use link.across_nodes(). None:
    one node.

    Sharded candidates (FSDP2) gather each stage's parameters and reduce-scatter its gradients over dp (on the
    link dp spans, as the replicate all-reduce): see _shard_walk for when. Tensor-parallel candidates run on one tp
    rank's costs (autotune.tp_costs: compute split, collectives added, bytes divided). The profile must be of the
    candidate's precision: its times and bytes are that precision's."""
    candidate.validate(profile.n_layers)
    if candidate.precision != profile.precision:
        raise UsageError(
            f"the profile was measured in {profile.precision} but the candidate trains in {candidate.precision}; "
            f"profile again with --precision {candidate.precision} (or plan in {profile.precision})"
        )
    link = link or LinkModel.for_profile(profile)
    tp_costs = tensor_parallel_layer_costs(profile, candidate.micro_batch_size, candidate.tensor_parallel_degree,
                                           link)
    return simulate_costs(
        tp_costs.layers,
        candidate,
        collective_ms=tp_costs.collective_ms,
        input_bytes=profile.input_bytes_at(candidate.micro_batch_size),
        optimizer_ms_per_byte=optimizer_ms_per_byte(profile, link),
        optimizer_call_ms=optimizer_call_ms(profile),
        optimizer_state_ratio=profile.optimizer_state_ratio,
        optimizer_peak_ratio=profile.optimizer_peak_ratio,
        optimizer_per_tensor=profile.device == "cpu",
        loss_saved_bytes=profile.loss_saved_bytes_at(candidate.micro_batch_size),
        loss_input_bytes=profile.loss_input_bytes_at(candidate.micro_batch_size),
        loss_backward_bytes=profile.loss_backward_bytes_at(candidate.micro_batch_size),
        target_bytes=profile.target_bytes_at(candidate.micro_batch_size),
        link=link,
        memory_limit_bytes=memory_limit_bytes,
        with_timeline=with_timeline,
        actions=actions,
        shared_parameters=profile.shared_parameters,
        gpus_per_node=gpus_per_node,
        workspace_bytes=profile.device_workspace_bytes,
    )


@dataclass(frozen=True, kw_only=True)
class Predictor:
    """The one way a study predicts a candidate: its profile with the link, memory limit and nodes it was planned
    with. The search, `load_search`, the report and its explanations all ask one, so a config's `predicted` block
    and the report of its study agree by construction (multi-node included). A study stores what rebuilds it
    (setup_entries) in its setup; of_setup reads it back."""

    profile: Profile
    link: LinkModel
    memory_limit_bytes: int | None = None
    gpus_per_node: int | None = None
    """Ranks per node when the ranks span nodes; None: one node."""

    @classmethod
    def of_setup(
        cls, profile: Profile, setup: Mapping[str, Any], *, memory_limit_bytes: int | None = None
    ) -> Predictor:
        """The predictor of a study from its setup (its link, gpus_per_node, memory_limit_bytes); a study written
        before the link was stored gets the profile device's default link. memory_limit_bytes overrides the
        setup's."""
        known = {f.name for f in fields(LinkModel)}
        stored = {k: v for k, v in (setup.get("link") or {}).items() if k in known}
        link = LinkModel(**stored) if stored else LinkModel.for_profile(profile)
        limit = memory_limit_bytes if memory_limit_bytes is not None else setup.get("memory_limit_bytes")
        per_node = setup.get("gpus_per_node")
        return cls(profile=profile, link=link, memory_limit_bytes=int(limit) if limit is not None else None,
                   gpus_per_node=int(per_node) if per_node else None)

    def setup_entries(self) -> dict[str, Any]:
        """What of_setup needs beside the setup's own keys (memory_limit_bytes, gpus_per_node)."""
        return {"link": asdict(self.link)}

    def __call__(self, candidate: Candidate, *, with_timeline: bool = False) -> Estimate:
        return simulate(self.profile, candidate, link=self.link, memory_limit_bytes=self.memory_limit_bytes,
                        with_timeline=with_timeline, gpus_per_node=self.gpus_per_node)


def simulate_costs(
    costs: Sequence[LayerCost],
    candidate: Candidate,
    *,
    input_bytes: int,
    optimizer_ms_per_byte: float,
    optimizer_state_ratio: float,
    link: LinkModel,
    optimizer_call_ms: float = 0.0,
    optimizer_peak_ratio: float = 0.0,
    optimizer_per_tensor: bool = False,
    loss_saved_bytes: int = 0,
    loss_input_bytes: int | None = None,
    loss_backward_bytes: int | None = None,
    memory_limit_bytes: int | None = None,
    with_timeline: bool = True,
    actions: Sequence[Sequence[Action]] | None = None,
    shared_parameters: Sequence[tuple[Sequence[int], int]] = (),
    gpus_per_node: int | None = None,
    collective_ms: Sequence[float] = (),
    workspace_bytes: int = 0,
    target_bytes: int = 0,
) -> Estimate:
    """simulate() on per-layer costs already taken at the candidate's micro-batch size, and with tp > 1 on one tp
    rank (tp_costs.tensor_parallel_costs; collective_ms: their tp collectives per layer and micro-batch, for the
    estimate's tensor_parallel_ms) (the planner's fast path).
    optimizer_per_tensor: the optimizer steps one tensor at a time (torch's default off CUDA: no foreach), so its
    temporaries scale with a rank's largest layer, not with all its parameters. loss_saved_bytes: what loss_fn
    saves (part of the last layer's saved_bytes): outside a checkpointed stage, so kept, not recomputed.
    loss_input_bytes: the last layer's output as loss_fn gets it, which the last stage keeps (Profile.
    loss_input_bytes_at; None: the output as profiled); loss_backward_bytes: the peak of loss_fn's backward over
    what was alive before it (Profile.loss_backward_bytes_at; None: memory_model.loss_backward_bytes).
    workspace_bytes: the libraries' workspaces every rank holds (Profile.device_workspace_bytes), added to each peak.
    target_bytes: one micro-batch's targets (Profile.target_bytes_at), held by the last stage's rank."""
    if len(costs) != sum(candidate.layers_per_stage):
        raise UsageError(
            f"layers_per_stage {list(candidate.layers_per_stage)} covers {sum(candidate.layers_per_stage)} layers "
            f"but the costs have {len(costs)}; profile the same model the candidate was made for"
        )
    crossing, n_nodes = None, 1
    if gpus_per_node is not None and candidate.world_size > gpus_per_node:
        c = candidate
        # the pp x dp grid of tp groups: gpus_per_node / tp grid positions a node (a tp group stays in one node)
        per_node = max(1, gpus_per_node // c.tensor_parallel_degree)
        crossing = crossing_boundaries(
            stage_ranks(c.schedule, c.pipeline_degree, c.n_stages), c.data_parallel_degree, per_node,
            c.rank_order,
        )
        n_nodes = dp_nodes(c.pipeline_degree, c.data_parallel_degree, per_node, c.rank_order)
    stages = _stage_costs(costs, candidate, input_bytes=input_bytes, link=link, crossing=crossing,
                          shared=shared_parameters, loss_saved=loss_saved_bytes, loss_input=loss_input_bytes,
                          loss_backward=loss_backward_bytes)
    if actions is None:
        c = candidate
        plan = compiled_graph(c.schedule, c.pipeline_degree, c.n_microbatches, c.n_stages)
    else:
        plan = compile_graph(tuple(tuple(rank) for rank in actions), candidate.n_stages, candidate.n_microbatches)
    if len(plan.rank_actions) != candidate.pipeline_degree:
        raise UsageError(
            f"the action lists have {len(plan.rank_actions)} ranks but the candidate has pipeline_degree "
            f"{candidate.pipeline_degree}; pass one list per pipeline rank"
        )

    dur, xfer = _durations(plan, stages, candidate, link)
    gather_ms = reduce_scatter_ms = [0.0] * candidate.pipeline_degree
    walk = _shard_walk(plan, candidate.reshard_after_forward) if candidate.sharded else None
    if walk is not None:
        gather_ms, reduce_scatter_ms = _add_shard_costs(dur, plan, stages, walk, candidate, link, n_nodes)
    elif link.replica_forward_overhead_ms and candidate.under_ddp:  # (a rank's shared parameters: not seen here)
        dur = [d + link.replica_forward_overhead_ms if k == "F" else d for d, k in zip(dur, plan.kind)]
    late = link.late_receives_wake and link.collective_wake_ms > 0
    across = crossing is not None and any(crossing)

    # torch's single-stage schedules wait for their sends before going on, and gloo moves no byte of a send before
    # its receive is posted: inside a node the replay holds such a sender until its receiver posted (across nodes
    # _replay's wire model already moves no byte before that)
    c = candidate
    gloo = link.late_receives_wake and not across and actions is None
    plan_gates = _send_gates(c.schedule, c.pipeline_degree, c.n_microbatches, c.n_stages) if gloo else None

    def replay(graph: ActionGraph, durations: list[float], transfers: list[float]) -> list[float]:
        gated = plan_gates if graph is plan else None  # 2BW's two-step graph: no torch schedule class, no gates
        if gated is not None:  # GPipe / 1F1B inside a node on gloo: each action also waits for its gated sends
            done = _replay_late_receives(graph, durations, transfers, None, 0.0, gated=gated)
        else:
            done = _replay(graph, durations, transfers, stages, candidate, crossing)
        if not late:
            return done
        if across:
            return _replay(graph, durations, transfers, stages, candidate, crossing,
                           woken=_WakeClock(graph, durations, done, link.collective_wake_ms))
        return _replay_late_receives(graph, durations, transfers, done, link.collective_wake_ms, gated=gated)

    finish = replay(plan, dur, xfer)
    # Two ranks posting to each other at once (LinkModel.crossing_post_ms), inside a node (or across nodes that are
    # one machine: nodes_share_host), by this replay's times; not 2BW's steady state (its own two-step replay below)
    if (link.crossing_post_ms and (not across or link.nodes_share_host)
            and not SCHEDULES[c.schedule].asynchronous):
        ahead = None if SCHEDULES[c.schedule].placement == "single" or actions is not None else _receives_posted(plan)
        extra = _crossing_posts(plan, finish, link.crossing_post_ms, link.crossing_post_window_ms, ahead,
                                link.crossing_post_jitter_ms)
        if extra is not None:
            dur = [d + e for d, e in zip(dur, extra)]
            finish = replay(plan, dur, xfer)
    # A rank's action right after it sat idle runs slower (LinkModel.idle_resume_ms), by this replay's gaps
    if link.idle_resume_ms and not SCHEDULES[c.schedule].asynchronous:
        resumed = _idle_resume(plan, finish, dur, link)
        if resumed is not None:
            dur = [d + e for d, e in zip(dur, resumed)]
            finish = replay(plan, dur, xfer)

    pp = candidate.pipeline_degree
    rank_end = [max(map(finish.__getitem__, ids), default=0.0) for ids in plan.rank_actions]
    pipeline_ms = max(rank_end)
    asynchronous = SCHEDULES[candidate.schedule].asynchronous
    if asynchronous:
        # 2BW runs step after step as one 1F1B without a flush: in steady state a step takes what one more step adds
        # to the pipeline, the replay of two steps' micro-batches less that of one (the fill and the drain are paid
        # once per run; a trial's window of k steps pays 1/k of them per step on top of this).
        c = candidate
        two = compiled_graph(c.schedule, c.pipeline_degree, 2 * c.n_microbatches, c.n_stages)
        two_dur, two_xfer = _durations(two, stages, candidate, link)
        pipeline_ms = max(replay(two, two_dur, two_xfer)) - pipeline_ms
        rank_end = [pipeline_ms] * pp
    busy = sum(dur)
    bubble = 1.0 - busy / (pp * pipeline_ms) if pipeline_ms > 0 else 0.0

    rank_params = [0] * pp
    for s, r in enumerate(plan.stage_rank):
        rank_params[r] += stages.parameter_bytes[s]
    shards = dp_shards(candidate)
    # One step per rank over its stages (sharded: over its shards): the fixed cost once, the rest by bytes.
    optimizer_ms = [(optimizer_call_ms + p / shards * optimizer_ms_per_byte) * (1.0 + link.compute_slowdown) if p
                    else 0.0 for p in rank_params]
    if candidate.sharded and link.sharded_optimizer_group_ms:  # stepping DTensors, a module's tensors at a time
        for s, r in enumerate(plan.stage_rank):
            optimizer_ms[r] += link.sharded_optimizer_group_ms * stages.shard_groups[s]
    if candidate.sharded:  # the reduce-scatters are in the last backwards' durations (_add_shard_costs)
        allreduce_ms = [0.0] * pp
        sync_end = rank_end
    elif asynchronous:
        # 2BW: one flat all-reduce per update, started when a rank ends the step's backwards and waited for when the
        # step after next needs the weights: hidden behind the rank's work of a step, save what outlasts it
        allreduce_ms = [link.allreduce_ms(p, candidate.data_parallel_degree, n_nodes) for p in rank_params]
        rank_busy = [sum(map(dur.__getitem__, ids)) for ids in plan.rank_actions]
        sync_end = [pipeline_ms + max(0.0, allreduce_ms[r] - rank_busy[r]) for r in range(pp)]
    else:  # replicas: the all-reduces, and the wake once per rank that syncs (LinkModel.collective_wake_ms)
        dp = candidate.data_parallel_degree
        wake = link.collective_wake_ms if dp > 1 else 0.0
        allreduce_ms = [link.allreduce_ms(p, dp, n_nodes) + (wake if p else 0.0) for p in rank_params]
        if SCHEDULES[candidate.schedule].splits_backward:  # runtime.overlaps_gradient_sync: one flat all-reduce after
            sync_end = [rank_end[r] + allreduce_ms[r] for r in range(pp)]
        else:
            bucket_ms = functools.lru_cache(maxsize=None)(lambda nbytes: link.allreduce_ms(nbytes, dp, n_nodes))
            sync_end = _overlapped_sync_end(plan, finish, dur, stages.parameter_bytes, rank_end, bucket_ms,
                                            overlaps=link.gradient_sync_overlaps, overhead_ms=wake)
    step_ms = max(sync_end[r] + optimizer_ms[r] for r in range(pp)) + link.step_overhead_ms

    tensor_parallel_ms = [0.0] * pp
    if collective_ms:
        bounds = list(accumulate(candidate.layers_per_stage, initial=0))
        for s, r in enumerate(plan.stage_rank):
            tensor_parallel_ms[r] += candidate.n_microbatches * sum(collective_ms[bounds[s]:bounds[s + 1]])
    peaks = _peak_memory(plan, stages, candidate, optimizer_state_ratio, optimizer_peak_ratio,
                         (input_bytes, target_bytes), per_tensor=optimizer_per_tensor, shard=walk)
    peaks = [p + workspace_bytes + int(weight_version_bytes(r, candidate=candidate))
             for p, r in zip(peaks, rank_params)]
    feasible = memory_limit_bytes is None or max(peaks) <= memory_limit_bytes
    timeline: tuple[TimelineEvent, ...] = ()
    if with_timeline:
        timeline = tuple(
            TimelineEvent(rank=plan.rank[a], stage=plan.stage[a], kind=plan.kind[a], microbatch=plan.microbatch[a],
                          start_ms=finish[a] - dur[a], end_ms=finish[a])
            for a in range(len(plan.kind))
        )
    return Estimate(
        step_time_ms=step_ms,
        throughput_samples_per_s=candidate.global_batch_size / step_ms * 1e3 if step_ms > 0 else float("inf"),
        bubble_fraction=max(0.0, bubble),
        peak_memory_bytes=tuple(peaks),
        feasible=feasible,
        pipeline_time_ms=pipeline_ms,
        optimizer_ms=max(optimizer_ms),
        allreduce_ms=max(allreduce_ms),
        gather_ms=max(gather_ms),
        reduce_scatter_ms=max(reduce_scatter_ms),
        tensor_parallel_ms=max(tensor_parallel_ms),
        memory_limit_bytes=memory_limit_bytes,
        timeline=timeline,
    )


def idle_resume_extra_ms(link: LinkModel, gap_ms: float, action_ms: float) -> float:
    """What an action of action_ms costs beyond it after its rank sat idle for gap_ms (LinkModel.idle_resume_ms)."""
    if not link.idle_resume_ms or gap_ms <= 0.0:
        return 0.0
    g0 = penalty = 0.0  # from (0, 0), linear to the first point at or past the gap, flat past the last
    for g1, p1 in link.idle_resume_ms:
        if gap_ms <= g1:
            penalty = penalty + (p1 - penalty) * (gap_ms - g0) / (g1 - g0) if g1 > g0 else p1
            break
        g0, penalty = g1, p1
    window = link.idle_resume_window_ms
    return penalty * min(1.0, action_ms / window) if window > 0.0 else penalty


def _idle_resume(plan: ActionGraph, finish: list[float], dur: list[float], link: LinkModel) -> list[float] | None:
    """Per action, what it costs beyond its duration because its rank was idle before it (idle_resume_extra_ms), by
    the replay's times (finish): the gap from the rank's previous action's end (the step's start for its first).
    None: no action waited."""
    extra = [0.0] * len(plan.kind)
    waited = False
    for a, p in enumerate(plan.prev):
        gap = finish[a] - dur[a] - (finish[p] if p >= 0 else 0.0)
        if gap > 1e-9:
            extra[a] = idle_resume_extra_ms(link, gap, dur[a])
            waited = waited or extra[a] > 0.0
    return extra if waited else None


def _crossing_posts(
    plan: ActionGraph, finish: list[float], cost_ms: float, window_ms: float, posted: Sequence[int] | None = None,
    jitter_ms: float = 0.0,
) -> list[float] | None:
    """Per action, what its posts cost beyond message_overhead_ms because the rank at the other end posted to this
    one at about the same moment (LinkModel.crossing_post_ms), by the replay's times (finish): a send when its action
    ends (a fused run's last: ActionGraph.sent), a receive when the rank ends the action after which it is posted
    (posted, torch's runtime: _receives_posted; None: the previous action, as torch's single-stage schedules post
    theirs), charged to the rank's next action; weighted by _crossing_share of the distance to the other rank's
    nearest post, once per moment: a rank's posts to one peer at one moment (a fused run's sends and the receives
    posted after it) cross the other rank's together. None: no two posts cross."""
    n = len(plan.kind)
    rank, sent, prev = plan.rank, plan.sent, plan.prev
    after = posted if posted is not None else prev
    posts: list[tuple[int, float, int]] = []  # (action, when, the other rank)
    for x in range(n):
        if plan.cross[x]:
            p = after[x]
            ahead = _next_on_rank(plan, p) if p >= 0 else plan.rank_actions[rank[x]][0]
            posts.append((ahead, finish[p] if p >= 0 else 0.0, rank[sent[x]]))
            posts.append((sent[x], finish[sent[x]], rank[x]))
    when: dict[tuple[int, int], list[float]] = {}
    for a, t, other in posts:
        when.setdefault((rank[a], other), []).append(t)
    for times in when.values():
        times.sort()
    extra = [0.0] * n
    crossed = False
    # a rank's posts to one peer at one moment (the sends and receives torch posts together after an action) cross
    # the other's once: charged once, to the first one's action
    moments: dict[tuple[int, int, float], int] = {}
    for a, t, other in posts:
        moments.setdefault((rank[a], other, t), a)
    for (mine, other, t), a in moments.items():
        times = when.get((other, mine))
        if times:
            k = bisect.bisect_left(times, t)  # the nearest is times[k - 1] or times[k]
            near = min(abs(times[j] - t) for j in (k - 1, k) if 0 <= j < len(times))
            share = _crossing_share(near, window_ms, jitter_ms)
            if share > 0:
                extra[a] += cost_ms * share
                crossed = True
    return extra if crossed else None


def _crossing_share(offset_ms: float, window_ms: float, jitter_ms: float) -> float:
    """The share of crossing_post_ms a post pays when the other rank's nearest post is offset_ms from it by the
    replay's times: 1 - |d| / window where |d| < window, d = offset + e, expected over e ~ N(0, jitter_ms^2), the
    posts' own jitter about the replay's times (LinkModel.crossing_post_jitter_ms). The triangle alone (jitter 0)
    slopes at 1 / window right from d = 0, so the replay's exact alignments (equal layers, tiny steps) were charged
    in full and a planner could buy its way out of them with a few microseconds of imbalance; with the jitter the
    share is flat about 0 and the total over all offsets stays the triangle's."""
    if jitter_ms <= 0:
        return max(0.0, 1.0 - offset_ms / window_ms)
    if offset_ms >= window_ms + 6 * jitter_ms:
        return 0.0

    def ramp(x: float) -> float:  # E[max(0, x + e)]
        z = x / jitter_ms
        return x * 0.5 * math.erfc(-z / math.sqrt(2)) + jitter_ms * math.exp(-0.5 * z * z) / math.sqrt(2 * math.pi)

    # the triangle is (ramp(d + w) - 2 ramp(d) + ramp(d - w)) / w for ramp(x) = max(0, x); so is its expectation
    return max(0.0, (ramp(offset_ms + window_ms) - 2 * ramp(offset_ms) + ramp(offset_ms - window_ms)) / window_ms)


def _next_on_rank(plan: ActionGraph, a: int) -> int:
    """The action after a on its rank (a rank's action ids rise along its list); a itself if it is the last."""
    ids = plan.rank_actions[plan.rank[a]]
    return a + 1 if a + 1 <= ids[-1] else a


def _durations(
    plan: ActionGraph, stages: _StageCosts, candidate: Candidate, link: LinkModel
) -> tuple[list[float], list[float]]:
    """Each action's duration (with the rank's side costs) and the transfer into it, in the graph's action order."""
    # Durations and the transfer into each action, by (kind, stage): tables in the graph's slot order (F, B, I, W).
    duration = stages.forward + stages.backward + stages.backward_input + stages.backward_weight
    incoming = stages.activation_transfer + stages.grad_transfer + stages.grad_transfer + [0.0] * candidate.n_stages
    dur = list(map(duration.__getitem__, plan.slot))
    xfer = [incoming[i] if c else 0.0 for i, c in zip(plan.slot, plan.cross)]
    _add_rank_side_costs(dur, plan, stages, link)
    return dur, xfer


class _WakeClock:
    """When a send whose receive was posted after it moves (LinkModel.late_receives_wake): when the sending rank's
    collective thread wakes (wake_ms) or the action the rank runs then, as a first replay placed it, ends, whichever
    is first; at once if the rank was waiting."""

    def __init__(self, plan: ActionGraph, dur: list[float], first: list[float], wake_ms: float) -> None:
        self.first = first
        self.starts = [[first[a] - dur[a] for a in ids] for ids in plan.rank_actions]
        self.ends = [[first[a] for a in ids] for ids in plan.rank_actions]
        self.wake_ms = wake_ms

    def moved(self, at: float, sender: int) -> float:
        """When the send of rank `sender` moves, for a receive posted at `at` (after the send)."""
        starts, ends = self.starts[sender], self.ends[sender]
        k = bisect.bisect_right(starts, at) - 1
        busy_until = ends[k] if k >= 0 and ends[k] > at else at
        return at + min(self.wake_ms, busy_until - at)


def _replay_late_receives(
    plan: ActionGraph, dur: list[float], xfer: list[float], first: list[float] | None, wake_ms: float,
    *, gated: _SendGates | None = None,
) -> list[float]:
    """The replay again, with each receive posted after its send (the receiving rank gets to the action after the
    sending one ended) delivered when the sending rank's collective thread wakes (wake_ms) or the sending rank next
    calls into gloo, whichever is first: the end of its action running then, as the first replay placed it (first),
    or at once if it was waiting (LinkModel.late_receives_wake). gated (GPipe / 1F1B, _send_gates): each action also
    waits until the receives of the sends torch waits for before it are posted, and a receive posted while its
    sender waits for it moves at once. first None: that first replay itself (gated; no wake)."""
    n = len(plan.kind)
    prev, dep, own, cross, rank = plan.prev, plan.sent, plan.own, plan.cross, plan.rank  # dep: when sent
    if first is not None and not any(cross[a] and first[prev[a]] > first[dep[a]] for a in range(n)):
        return first  # no receive posted late: the same replay again
    clock = _WakeClock(plan, dur, first, wake_ms) if first is not None else None
    gates = gated.gates if gated is not None else None
    blocked = gated.blocked if gated is not None else ()
    finish = [0.0] * (n + 1)
    for a in gated.order if gated is not None else plan.order:
        t = finish[prev[a]]
        d = dep[a]
        u = finish[d] + xfer[a]
        if clock is not None and cross[a] and t > finish[d]:
            g = blocked[a] if blocked else -1
            if g < 0 or clock.first[prev[g]] > t:  # the sender computes, or (GPipe) runs forwards before its wait
                u = clock.moved(t, rank[d]) + xfer[a]
            # else the sender waits for this very send in gloo (1F1B's fused batch): it moves at once
        if u > t:
            t = u
        u = finish[own[a]]
        if u > t:
            t = u
        if gates is not None:
            for x in gates[a]:
                u = max(finish[prev[x]], finish[dep[x]]) + xfer[x]
                if u > t:
                    t = u
        finish[a] = t + dur[a]
    return finish


@dataclass(frozen=True)
class _SendGates:
    """Where torch's single-stage schedules wait for their own sends (GPipe, 1F1B): gates[a], the receives (actions
    on other ranks) whose posting action a waits for before it starts; order: a topological order that counts them."""

    gates: tuple[tuple[int, ...], ...]
    order: tuple[int, ...]
    blocked: tuple[int, ...]
    """Per receive, the sender's action whose start waits for it (-1: none): from the end of the action before that
    one the sender sits in gloo's wait for the send, so a receive posted then is served at once."""


@functools.lru_cache(maxsize=64)
def _send_gates(schedule: Schedule, pipeline_degree: int, n_microbatches: int, n_stages: int) -> _SendGates | None:
    """The sends torch's ScheduleGPipe and Schedule1F1B wait for, and where (None for every other schedule: torch's
    runtime for the others posts its receives ahead and waits for its sends at the end of the step).

    gloo moves no byte of a send before its receive is posted, so a wait for a send lasts until the receiver got to
    it. Schedule1F1B fuses each send with the receive of the rank's next action when the next action is of the other
    kind (F then B, B then F) and waits for both before it; a send followed by an action of the same kind (the
    warm-up's forwards, the cool-down's backwards) is waited for after that action, before the one after it.
    ScheduleGPipe waits for every forward's send after the last forward, and for the backwards' at the end of the
    step. Without this the replay let a sender start its next action at once, and a receive posted meanwhile then
    waited for the sender's thread to wake (late_receives_wake): the receiving rank's forwards held back until the
    sender's backwards ended, which in traces start only after the receive was posted (bench/gloo_send_wait.py,
    bench/results/action_trace_mlp13.md: 1F1B m4 / m8 / m16 predicted 16.8 / 20.9 / 30.8 ms without the gates,
    15.2 / 19.2 / 28.1 with them, 16.0 / 17.2 / 24.0 measured)."""
    info = SCHEDULES[schedule]
    if info.torch_class not in ("ScheduleGPipe", "Schedule1F1B"):
        return None
    plan = compiled_graph(schedule, pipeline_degree, n_microbatches, n_stages)
    n = len(plan.kind)
    receivers: list[list[int]] = [[] for _ in range(n)]
    for x in range(n):
        if plan.cross[x]:
            receivers[plan.dep[x]].append(x)
    gates: list[list[int]] = [[] for _ in range(n)]
    for ids in plan.rank_actions:
        kinds = [plan.kind[a] for a in ids]
        first_backward = next((k for k, kind in enumerate(kinds) if kind != "F"), len(ids))
        for k, y in enumerate(ids):
            if not receivers[y]:
                continue
            if info.torch_class == "ScheduleGPipe":
                at = first_backward if kinds[k] == "F" else len(ids)  # the backwards': at the step's end
            else:
                at = k + 1 if k + 1 < len(ids) and kinds[k + 1] != kinds[k] else k + 2
            if at < len(ids):
                gates[ids[at]].extend(receivers[y])
    order = _gated_order(plan, gates)
    blocked = [-1] * n
    for a, xs in enumerate(gates):
        for x in xs:
            blocked[x] = a
    return _SendGates(gates=tuple(map(tuple, gates)), order=order, blocked=tuple(blocked))


def _gated_order(plan: ActionGraph, gates: Sequence[Sequence[int]]) -> tuple[int, ...]:
    """A topological order of plan that also places each gate's receiving rank's previous action before the action
    it gates (torch's schedules never deadlock on them)."""
    prev, dep, own = plan.prev, plan.dep, plan.own
    order, _ = sweep_order(plan.rank_actions,
                           lambda a, done: done[dep[a]] and done[own[a]] and all(done[prev[x]] for x in gates[a]))
    if len(order) < len(plan.kind):
        raise AssertionError("send gates deadlock the schedule")  # torch's own schedules run: a bug here
    return tuple(order)


def _replay(
    plan: ActionGraph, dur: list[float], xfer: list[float], stages: _StageCosts, candidate: Candidate,
    crossing: Sequence[bool] | None, *, woken: _WakeClock | None = None,
) -> list[float]:
    """Each action's finish time when every rank runs its actions in order, as soon as their inputs arrived (one past
    the last: 0.0). woken (across nodes): the senders' timelines of a first replay, to replay again with each
    receive posted after its send moved when the sender's collective thread wakes or the sender next calls into gloo
    (as _replay_late_receives inside a node)."""
    n = len(plan.kind)
    prev, dep, own = plan.prev, plan.sent, plan.own  # dep: the action whose end sends the tensor (ActionGraph.sent)
    # finish[-1] (one past the actions) stays 0.0: a missing dependency (-1) waits for nothing, without a branch
    # (an action without dep has no transfer, and every finish is >= 0).
    finish = [0.0] * (n + 1)
    if crossing is None or not any(crossing):
        for a in plan.order:
            t = finish[prev[a]]
            u = finish[dep[a]] + xfer[a]
            if u > t:
                t = u
            u = finish[own[a]]
            if u > t:
                t = u
            finish[a] = t + dur[a]
    else:
        # Across nodes (bench/internode.py: two namespaces over a tbf-shaped link):
        #
        # Two ranks move one tensor at a time between them, either way. The receive's readiness reaches the sender
        # as a small message queued behind whatever the receiver is sending it, so of two transfers the other way
        # round at once (1F1B's fused send + receive) the second starts when the first ends: one message each way
        # at once took twice one message's time when the two were posted apart, as a pipeline's ranks post them,
        # and LoopedBFS m16 at 20 Mbit/s (96 hand-offs of 16 KiB) took 689 ms, their wire time end to end.
        #
        # GPipe and 1F1B (torch's single-stage schedules) post a receive only when the rank gets to the action that
        # needs it, and gloo moves no byte of a send before its receive is posted (a receive posted 300 ms after
        # its send still took the full wire time). So their wire time (bytes / bandwidth) is not hidden behind the
        # receiver's previous action. Torch's runtime (the other schedules) posts receives ahead of time.
        #
        # One way between two ranks the tensors go one at a time, in the order they became ready to move (the send
        # posted and its receive too), not in the order the receiver needs them, and a receive's readiness waits
        # behind the tensor on the wire the other way when it is posted. VHalf m4 at 20 Mbit/s (traced,
        # bench/internode.py): a micro-batch's activations, sent early, moved before a gradient the receiver wanted
        # first, and a receive posted meanwhile on the other rank was ready only when those activations were through.
        # So before a transfer is placed, the transfers the other way and then the same way that were ready earlier
        # (their sends and receives posted) are placed first.
        #
        # The rest of a transfer (its latency, which the calibrated figures make a per-message cost of the runtime)
        # overlaps as before.
        wire_in = stages.activation_wire + stages.grad_wire + stages.grad_wire + [0.0] * candidate.n_stages
        wire = [wire_in[i] if c else 0.0 for i, c in zip(plan.slot, plan.cross)]
        rank = plan.rank
        posted_late = SCHEDULES[candidate.schedule].placement == "single"
        free: dict[tuple[int, int], float] = {}  # (lower rank, higher rank): when their last transfer ends
        posted = None if posted_late else _receives_posted(plan)
        sent_first = _sent_first(plan) if posted_late else {}
        posts: tuple[int, ...] = posted or ()  # the runtime's receive posts (only read where posted is not None)
        lanes: dict[tuple[int, int], tuple[list[float], list[float]]] = {}  # (from, to rank): placed starts, ends
        waiting: dict[tuple[int, int], list[int]] = {}  # (from rank, to rank): receivers not placed, in send order
        for x in range(n):  # a rank's action ids rise along its list: send order is dep order
            if wire[x] and posted is not None:
                waiting.setdefault((rank[dep[x]], rank[x]), []).append(x)
                lanes.setdefault((rank[dep[x]], rank[x]), ([], []))
                lanes.setdefault((rank[x], rank[dep[x]]), ([], []))
        for queue in waiting.values():
            queue.sort(key=dep.__getitem__)
        arrived: dict[int, float] = {}  # receivers whose transfer was placed ahead of their turn: when it ended
        replayed = bytearray(n + 1)
        replayed[n] = 1  # -1: nothing to wait for
        # Across nodes too, a receive the rank gets to after its send was posted waits for the sending rank's
        # collective thread, by the rule inside a node (_replay_late_receives, against this replay's first pass):
        # the tensor comes when that thread wakes or the sender's running action ends, and the whole transfer
        # (latency and wire) from then. Traced on the unshaped link (bench/internode.py, 1F1B m8): each
        # steady-state receive came 1.4-1.8 ms after its post, when the sender's next backward ended, and the same
        # trial ran ~20 % slower across the link than with both ranks on one node (two runs). Over six runs of the
        # bench the unshaped rows' mean error went 13.3 -> 12.5 % with it (five runs today: 13.8 -> 11.7 %).
        def woke(at: float, sender: int) -> float:
            return woken.moved(at, sender) if woken is not None else at

        def ready(x: int, s: int, r: int) -> float:
            at = finish[posts[x]]  # r gets to the receive in its list and posts it
            starts, ends = lanes[(r, s)]
            k = bisect.bisect_right(starts, at) - 1
            if k >= 0 and at < ends[k]:  # its readiness waits behind the transfer r -> s then on the wire
                at = ends[k]
            if at > finish[dep[x]]:
                return woke(at, s)
            return finish[dep[x]]

        def place(x: int, s: int, r: int, at: float) -> float:
            starts, ends = lanes[(s, r)]
            start = max(at, ends[-1]) if ends else at
            starts.append(start)
            ends.append(start + wire[x])
            waiting[(s, r)].remove(x)
            return start + wire[x]

        def ahead(s: int, r: int, until: float, before: int) -> None:
            """Place the transfers s -> r sent before `before` (an action id; n: any), whose receives are posted,
            ready by `until`, in the order they were ready."""
            known = []
            for x in waiting.get((s, r), ()):  # in send order: the ones sent so far are a prefix
                if dep[x] >= before or not replayed[dep[x]]:
                    break
                if replayed[posts[x]]:
                    known.append((ready(x, s, r), x))
            for when, x in sorted(known):
                if when <= until:
                    arrived[x] = place(x, s, r, when)

        for a in plan.order:
            t = finish[prev[a]]
            w = wire[a]
            if w and posted is not None:
                if a in arrived:
                    u = arrived.pop(a)
                else:
                    s, r = rank[dep[a]], rank[a]
                    ahead(r, s, finish[posted[a]], n)
                    at = ready(a, s, r)
                    ahead(s, r, at, dep[a])
                    u = place(a, s, r, at)
                    if woken is not None and t > finish[dep[a]]:  # the rank gets to a after the send
                        u = max(u, woke(t, s) + xfer[a])
            elif w and a in arrived:  # moved ahead of the receive the rank posted behind it (below)
                u = arrived.pop(a)
            elif w:
                pair = (min(rank[a], rank[dep[a]]), max(rank[a], rank[dep[a]]))
                x = sent_first.get(a, -1)
                if x >= 0 and wire[x] and not replayed[x] and replayed[prev[x]] and finish[prev[x]] <= t:
                    # 1F1B fuses a stage's sends with its next receives, sends first (bwd_send + fwd_recv): the
                    # tensor whose receive was already posted goes on the wire, and this receive's readiness reaches
                    # the sender behind it. Traced at 200 and 20 Mbit/s (bench/internode.py, 1F1B m2): the gradient,
                    # then the next micro-batch's activation, two wire times between a stage's backward and its
                    # next forward.
                    free[pair] = arrived[x] = max(finish[dep[x]], free.get(pair, 0.0)) + wire[x]
                start = max(finish[dep[a]], free.get(pair, 0.0))
                if t > finish[dep[a]]:  # t: the rank gets to a and posts the receive, after the send
                    start = max(start, woke(t, rank[dep[a]]))
                free[pair] = u = start + w
                if woken is not None and t > finish[dep[a]]:  # the whole transfer from then
                    u = start + xfer[a]
            else:
                u = t
            v = finish[dep[a]] + xfer[a]  # and the whole transfer from the send (wire[a] is part of xfer[a])
            if not w and woken is not None and plan.cross[a] and t > finish[dep[a]]:  # inside a node
                v = woke(t, rank[dep[a]]) + xfer[a]
            if v > u:
                u = v
            if u > t:
                t = u
            u = finish[own[a]]
            if u > t:
                t = u
            finish[a] = t + dur[a]
            replayed[a] = 1
    return finish


@functools.lru_cache(maxsize=64)
def _sent_first(plan: ActionGraph) -> dict[int, int]:
    """Per receive across ranks, the transfer that its rank's previous action sends back to the sender (1F1B's
    fused bwd_send + fwd_recv, the send first), where there is one."""
    dep, prev, rank, cross = plan.dep, plan.prev, plan.rank, plan.cross
    sends = {(dep[x], rank[x]): x for x in range(len(plan.kind)) if cross[x]}
    found = {a: sends.get((prev[a], rank[dep[a]]), -1) for a in range(len(plan.kind)) if cross[a] and prev[a] >= 0}
    return {a: x for a, x in found.items() if x >= 0}


@functools.lru_cache(maxsize=64)
def _receives_posted(plan: ActionGraph) -> tuple[int, ...]:
    """Per action whose tensor crosses ranks, the action on its own rank after which torch's runtime posts the
    receive (-1: before its first): torch's _add_send_recv walks the ranks in lock step, one compute action (a fused
    run, ActionGraph.fused_end, as one) per rank per round, and puts a receive in the receiving rank's list when the
    sender's action goes into the sender's."""
    n = len(plan.kind)
    posted = [-1] * n
    receivers: list[list[int]] = [[] for _ in range(n)]
    run_end = plan.fused_end
    for a in range(n):
        if plan.cross[a]:
            receivers[plan.dep[a]].append(a)
    done = bytearray(n)
    head = [0] * len(plan.rank_actions)
    last = [-1] * len(plan.rank_actions)
    moved = True
    while moved:
        moved = False
        for r, ids in enumerate(plan.rank_actions):
            if head[r] >= len(ids):
                continue
            a = ids[head[r]]
            run = range(a, run_end[a] + 1)
            if any(plan.dep[x] >= 0 and not done[plan.dep[x]] for x in run):
                continue
            for x in run:
                done[x] = 1
            head[r] += len(run)
            last[r] = run[-1]
            moved = True
            for y in run:
                for x in receivers[y]:
                    posted[x] = last[plan.rank[x]]
    return tuple(posted)  # cached: shared by every simulation of the graph


DDP_FIRST_BUCKET_BYTES = 2**20
DDP_BUCKET_BYTES = 25 * 2**20
"""torch's DistributedDataParallel buckets: the first (the last layers' gradients) 1 MiB, the others 25 MiB."""


def _overlapped_sync_end(
    plan: ActionGraph, finish: list[float], dur: list[float], parameter_bytes: list[int], rank_end: list[float],
    allreduce_ms: Callable[[float], float], *, overlaps: bool = True, overhead_ms: float = 0.0,
) -> list[float]:
    """When each rank's data-parallel gradient sync ends under DistributedDataParallel (runtime.
    overlaps_gradient_sync): a stage's gradients become ready evenly over its last backward, last layers first, and
    each of DDP's buckets is all-reduced, one after another on the rank, once it is full. With one bucket nothing
    overlaps: the all-reduce follows the backward, as the flat one did. Where the link's collectives do not overlap
    compute (LinkModel.gradient_sync_overlaps), every bucket waits for the backward's end; a rank with buckets pays
    overhead_ms (LinkModel.collective_wake_ms) once."""
    last_b: dict[int, int] = {}
    for a in range(len(dur)):
        if plan.kind[a] == "B" and (plan.stage[a] not in last_b or finish[a] > finish[last_b[plan.stage[a]]]):
            last_b[plan.stage[a]] = a
    ready: list[list[tuple[float, float]]] = [[] for _ in rank_end]  # (ready at, bucket bytes) per rank
    for stage, a in last_b.items():
        total, done = float(parameter_bytes[stage]), 0.0
        while done < total:
            size = min(total - done, DDP_FIRST_BUCKET_BYTES if done == 0 else DDP_BUCKET_BYTES)
            done += size
            at = finish[a] - dur[a] + dur[a] * done / total if overlaps else finish[a]
            ready[plan.stage_rank[stage]].append((at, size))
    ends = []
    for r, buckets in enumerate(ready):
        t, wake = 0.0, overhead_ms  # paid by the first bucket, after which gloo's threads are awake
        for at, size in sorted(buckets):
            t = max(t, at) + wake + allreduce_ms(size)
            wake = 0.0
        ends.append(max(t, rank_end[r]))
    return ends


def step_time_lower_bound(
    costs: Sequence[LayerCost],
    candidate: Candidate,
    *,
    input_bytes: int,
    optimizer_ms_per_byte: float,
    link: LinkModel,
    optimizer_call_ms: float = 0.0,
) -> float:
    """A step time no schedule order can beat, without building the action lists (the planner prunes with it).

    Per rank r, whose lowest stage is s: its first action is a forward of s, so it waits for one micro-batch's
    forwards through the stages below s (on other ranks); then it runs all its actions one after another, then
    its optimizer step. Its last backward (B, or I where backwards split) is one of stage s, after which that
    micro-batch's backwards through the stages below s still run, then the optimizer step of stage 0's rank.
    These head and tail terms are the pipeline's fill and drain: (pp - 1)(f + b) for 1F1B, 1/v of it interleaved;
    an asynchronous schedule (2BW) pays them once per run, not per step: its bound is the busiest rank's work.
    Split backwards are counted as one action (the lower overhead); transfers, messages and all-reduces (sharded:
    all-gathers and reduce-scatters) as free; a sharded rank steps its optimizer over its shards (1/dp)."""
    stages = _stage_costs(costs, candidate, input_bytes=input_bytes, link=link)
    ranks = stage_ranks(candidate.schedule, candidate.pipeline_degree, candidate.n_stages)
    m = candidate.n_microbatches
    split = SCHEDULES[candidate.schedule].splits_backward
    # The backward on the critical chain: I (never longer than B) where a schedule may split, else B.
    chain = [min(b, i) for b, i in zip(stages.backward, stages.backward_input)] if split else stages.backward
    forward_below = list(accumulate(stages.forward, initial=0.0))
    chain_below = list(accumulate(chain, initial=0.0))
    pp = candidate.pipeline_degree
    busy, before_last, params, lowest = [0.0] * pp, [0.0] * pp, [0] * pp, [candidate.n_stages] * pp
    for s, r in enumerate(ranks):
        busy[r] += m * (stages.forward[s] + stages.backward[s])
        before_last[r] += m * (stages.forward[s] + chain[s])  # what must run before the rank's last backward
        params[r] += stages.parameter_bytes[s]
        lowest[r] = min(lowest[r], s)
    shards = dp_shards(candidate)
    optimizer = [optimizer_call_ms + p / shards * optimizer_ms_per_byte if p else 0.0 for p in params]
    if SCHEDULES[candidate.schedule].asynchronous:  # no flush, so no fill and drain in a step: each rank's own work
        return max(b + o for b, o in zip(busy, optimizer))
    last = optimizer[ranks[0]]
    return max(
        max(forward_below[s] + b + o for s, b, o in zip(lowest, busy, optimizer)),
        max(forward_below[s] + b + chain_below[s] + last for s, b in zip(lowest, before_last)),
        sum(stages.forward) + sum(stages.backward),
    )


def max_in_flight(schedule: Schedule, pipeline_degree: int, n_microbatches: int, n_stages: int) -> list[int]:
    """Per stage, the most micro-batches whose activations it holds at once under the schedule's order
    (F adds one; B, or W after I, frees one). 1F1B: pp - stage; GPipe: n_microbatches."""
    plan = compiled_graph(Schedule(schedule), pipeline_degree, n_microbatches, n_stages)
    return list(plan.in_flight)


# --- stage costs --------------------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class _StageCosts:
    forward: list[float]
    backward: list[float]
    backward_input: list[float]
    backward_weight: list[float]
    activation_transfer: list[float]
    """Into stage s: stage s-1's output, when s-1 is on another rank."""
    grad_transfer: list[float]
    """Into stage s: the gradient of its output from s+1."""
    activation_wire: list[float]
    """Of activation_transfer, the time on the wire between nodes (bytes / bandwidth; 0 inside a node)."""
    grad_wire: list[float]
    """Of grad_transfer, the time on the wire between nodes (0 inside a node)."""
    output_send: list[float]
    """What sending the stage's output costs the rank that runs its F (LinkModel.sends_on_rank; 0 otherwise)."""
    grad_send: list[float]
    """What sending the gradient of the stage's input costs the rank that runs its B or I (as above)."""
    held_bytes: list[int]
    """What one in-flight micro-batch keeps between F and B: saved activations (the stage input only, with
    checkpointing) and the stage's output."""
    recompute_bytes: list[int]
    """What a checkpointed backward rebuilds for the micro-batch it works on (0 without checkpointing)."""
    weight_recompute_bytes: list[int]
    """A checkpointed stage's split W (not the first stage's): what its recomputes, one per parameter group, hold
    together at its peak (0 otherwise; _weight_recompute_bytes)."""
    receive_buffer_bytes: list[int]
    """Receive buffers of the stage for the whole step: activations in, gradients in."""
    arrival_copy_bytes: list[int]
    """bf16 under autocast: the float32 copy of a bfloat16 input the stage makes on arrival, through each forward
    (its gradient is in the backward bytes; memory_model.arrival_copy_bytes)."""
    parameter_bytes: list[int]
    output_held_bytes: list[int]
    """The part of held_bytes that is the stage's output (what a send keeps after the backward)."""
    sent_grad_bytes: list[int]
    """The gradient of the stage input one backward sends back (0 on the first stage)."""
    loss_backward_bytes: list[int]
    """What the loss's backward allocates (the last stage; 0 elsewhere), before the stage's own backward."""
    backward_bytes: list[int]
    """What one backward (B or I) or W of the stage allocates at its worst layer (memory_model)."""
    first_backward_bytes: list[int]
    """The same for the stage's first backward of the step, whose weight gradients become .grad (with them, where
    memory_model.gradients_made_in_step)."""
    split_kept_bytes: list[int]
    """The gradients an I makes for its W (memory_model.input_backward_bytes, or split_kept_bytes where the profile
    has no backward bytes)."""
    input_backward_bytes: list[int | None]
    """What an I holds at most on top, its input's gradient included (memory_model.input_backward_bytes); None
    where the profile has no backward bytes: then the most of a whole backward's and of the kept gradients with the
    input's."""
    loss_saved_bytes: list[int]
    """What the loss saved (part of held_bytes, the last stage only): let go of once the loss's backward ran."""
    input_released_bytes: list[int]
    """What an I lets go of when it detaches the loss (part of held_bytes, the last stage only): what the loss
    saved and the output it read."""
    largest_layer_bytes: list[int]
    """Parameter bytes of the stage's largest layer, or of the largest tied parameter it holds."""
    shared_copy_bytes: list[int]
    """Of parameter_bytes, the copies of tied parameters whose bytes the profile counts on another stage."""
    first_gradient_bytes: list[int]
    """The gradients the stage's first backward makes: its parameters', a tied parameter's on the rank's stage that
    runs a backward first (costs.stage_gradient_moves)."""
    largest_grad_bytes: list[int]
    """A W's fresh weight gradients at the stage's largest layer (memory_model.weight_gradient_factor)."""
    first_weight_bytes: list[int]
    """The stage's first W of the step, where it makes the gradients: what it holds at most on top, its gradients
    included (memory_model.first_weight_bytes; the stage's parameter bytes where the profile has no backward
    bytes)."""
    working_copy_bytes: list[int]
    """Sharded: the stage's gathered parameters (memory_model.working_copy_bytes); 0 replicated."""
    gather_unit_bytes: list[int]
    """Sharded: the largest layer's share of the working copy: an FSDP2 unit, gathered with nothing to hide it."""
    shard_units: list[int]
    """Sharded: the stage's FSDP2 units (its blocks that hold parameters, each fully_shard-ed: one collective each
    per gather and per reduce-scatter); 0 replicated."""
    shard_groups: list[int]
    """Sharded: the stage's modules holding parameters of their own (LayerCost.parameter_groups, at least one per
    layer with parameters): their DTensor shards are what the optimizer steps through; 0 replicated."""
    forward_copy_bytes: list[int]
    """Sharded with reshard_after_forward: what a forward that gathers holds at once (two units, the one computing
    and the next, prefetched); 0 otherwise."""
    gather_buffer_bytes: list[int]
    """Sharded: an all-gather's input while the stage gathers (memory_model.gather_buffer_bytes)."""
    reduce_buffer_bytes: list[int]
    """Sharded: what a unit's reduce adds at most: its reduce-scatter input (memory_model.reduce_buffer_bytes) less
    its working copy, which FSDP2 lets go of first (FSDPParamGroup.post_backward reshards, then reduces)."""
    unsharded_grad_bytes: list[int]
    """Sharded: the stage's unsharded float32 gradients (memory_model.unsharded_gradient_bytes)."""
    gathering_backward_bytes: list[int]
    """Sharded with reshard_after_forward: a backward's at a backward that gathers, the units it gathers as it goes
    included (memory_model.layer_backward_bytes' gathered); 0 otherwise."""
    gathering_first_backward_bytes: list[int]
    """The same, for the stage's first backward of the step."""


def _weight_recompute_bytes(
    recompute: int, saved: Sequence[int], groups: Sequence[int], measured: Sequence[int | None]
) -> int:
    """What a checkpointed stage's split W holds of its recomputes at its peak. torch's W runs one autograd pass per
    parameter group (stage_backward_weight), and each pass recomputes the whole stage; what a pass recomputed stays
    until the W ends unless a pass walked the node that saved it (retain_graph off frees a walked node's saved
    tensors, for every pass). A group's pass walks its own layer's weight path: it keeps all of the layers whose
    groups have not run yet (R), of those whose groups have (I) only what the weight paths do not use (a ReLU's
    output, attention's softmax), and of its own layer r, measured with the layer alone (LayerCost.
    checkpoint_weight_bytes / its groups, where r = I + W (g - 1) / 2g with W = R - I over its g passes). The
    groups run layer after layer; the last pass's own recompute is in flight at the peak.

    Traced on a Hugging Face OPT's stages of 2, 3 and 5 decoder layers (8 groups each): 33, 148 and ~400 MB in one
    W, 11, 16 and 26x what the stage's backward rebuilds once. Profiles without the measurement: every group keeps
    the stage's recompute."""
    total_groups, total_saved = sum(groups), sum(saved)
    if recompute <= 0 or total_groups <= 0 or total_saved <= 0:
        return 0
    if any(m is None for m in measured):
        return total_groups * recompute
    rebuilt = [recompute * s / total_saved for s in saved]
    own = [(m or 0) / g if g else 0.0 for m, g in zip(measured, groups)]  # r: one group's pass, the layer alone
    kept_after = []  # I of each layer: what stays of it once its groups have run
    for r_all, r, g in zip(rebuilt, own, groups):
        walked = (g - 1) / (2 * g) if g else 0.0
        weight_path = min(r_all, max(0.0, (r_all - r) / (1.0 - walked))) if g else 0.0
        kept_after.append(r_all - weight_path)
    held = sum(g * (own[j] + sum(kept_after[:j]) + sum(rebuilt[j + 1:])) for j, g in enumerate(groups) if g)
    # the last pass's recompute in flight, but its own layer's, which the layer measured alone holds already
    last = max((j for j, g in enumerate(groups) if g), default=len(groups) - 1)
    return int(held + recompute - rebuilt[last])


def _composed_weight_recompute_bytes(
    recompute: int, rebuilt: Sequence[int], groups: Sequence[int], passes: Sequence[CheckpointPasses | None],
    inputs: Sequence[int],
) -> int | None:
    """What a checkpointed stage's split W holds of its recomputes at its peak, composed from its layers measured
    alone pass by pass (costs.CheckpointPasses); None where a layer with parameters was not (then
    _weight_recompute_bytes).

    torch's W runs one autograd pass per parameter group, layer after layer, and each recomputes the whole stage.
    A recompute keeps what the graph still holds: of a layer whose passes ran, what no pass walked
    (CheckpointPasses.kept; a later layer's groups keep its graph); of a later layer, all it rebuilt; of the layer
    whose pass runs, what it kept alone (`held` where a later layer keeps its graph, else `free`). Every earlier
    recompute keeps the same, so at pass p of layer L, after n passes of earlier layers, while it recomputes:
        T + (rebuilt of the other layers) + (n + p - 1) (kept before L + kept of L after p - 1 + rebuilt after L)
    (before its first pass, all it rebuilt), and while it walks:
        T' + (n + p) (kept before L + rebuilt after L) + (n + p - 1) (kept of L after p)
    with T and T' what the pass adds alone in each phase on top of its p - 1 recomputes, less what the earlier
    layers' W let go of (CheckpointPasses.let_go: the gradients their I kept for it); the most over every pass and
    phase. A later layer's input is rebuilt too: where it saves it (inputs; 0 for the first), counted kept while
    the layer's passes run, and after them only where none of them walks the node that saved it
    (CheckpointPasses.input_kept: RMSNorm's pow, not LayerNorm's).

    Counting each pass's keeps for the whole W, as _weight_recompute_bytes does, overcounts what later passes let
    go of: recipes/gpt.py ZBV and DualPipeV m4 checkpointed, +0.0 .. +2.2 % here, up to +43 % there; the
    checkpointed memory calibration's split-backward configurations -1.2 .. +5.4 % (up to +35.7 % there)."""
    if any(g and p is None for g, p in zip(groups, passes)):
        return None
    total = sum(rebuilt)
    scale = recompute / total if total > 0 else 0.0
    share = [r * scale for r in rebuilt]
    whole = sum(share)
    with_groups = [j for j, g in enumerate(groups) if g]
    if not with_groups:
        return 0
    best, earlier = 0.0, 0
    for j in with_groups:
        measured = cast(CheckpointPasses, passes[j])
        runs = measured.held if j != with_groups[-1] else measured.free
        kept = sum(share[i] if not groups[i] else cast(CheckpointPasses, passes[i]).kept
                   + (inputs[i] if cast(CheckpointPasses, passes[i]).input_kept else 0) for i in range(j))
        # what the earlier layers' W let go of that was there before the W (their I's gradients for it, ...)
        gone = sum(cast(CheckpointPasses, passes[i]).let_go for i in range(j) if groups[i])
        after = sum(share[j + 1:])
        others = whole - share[j]
        keeps = share[j]  # before its first pass, every recompute keeps all the layer rebuilt
        for p, (recomputing, walking, keeps_after) in enumerate(runs, start=1):
            n = earlier + p - 1
            # recomputing: the stage's whole recompute alive, the earlier recomputes keep what they kept after the
            # pass before
            alone = recomputing + inputs[j] - (p - 1) * keeps
            best = max(best, alone + others + n * (kept + keeps + after) - gone)
            # walking: the recompute's own keeps of the other layers, the earlier ones' as this pass leaves them
            keeps_after += inputs[j]
            alone = walking + inputs[j] - (p - 1) * keeps_after
            best = max(best, alone + (n + 1) * (kept + after) + n * keeps_after - gone)
            keeps = keeps_after
        earlier += len(runs)
    return int(best)


def _sharded_tied_cast_bytes(
    copies: Sequence[int], shared: Sequence[tuple[Sequence[int], int]], bounds: Sequence[int], owner: Sequence[int],
    *, candidate: Candidate,
) -> list[int]:
    """Per stage, sharded in bf16: the bfloat16 copy autocast makes of a tied parameter that FSDP2 leaves whole and
    float32 (both uses on the rank: sharding.tied_on_rank), per forward of a layer that casts it (a tied LM head; the
    layer's profiled autocast copies, capped at the parameter's). A Qwen2 with tied embeddings, pp 1 x dp 2: -1.7 %
    without it. 0 otherwise (sharded stages compute on bfloat16 parameters: nothing else to cast)."""
    n_stages = len(bounds) - 1
    result = [0] * n_stages
    if not (candidate.sharded and candidate.precision == "bf16"):
        return result
    for layers, nbytes in shared:
        rank_of = [owner[next(s for s in range(n_stages) if bounds[s] <= i < bounds[s + 1])] for i in layers]
        for s in range(n_stages):
            here = [i for i in layers if bounds[s] <= i < bounds[s + 1]]
            if here and rank_of.count(owner[s]) > 1:  # both uses on the rank: left out of FSDP
                result[s] += sum(min(copies[i], nbytes // 2) for i in here)
    return result


def _stage_costs(
    costs: Sequence[LayerCost],
    candidate: Candidate,
    *,
    input_bytes: int,
    link: LinkModel,
    crossing: Sequence[bool] | None = None,
    shared: Sequence[tuple[Sequence[int], int]] = (),
    loss_saved: int = 0,
    loss_input: int | None = None,
    loss_backward: int | None = None,
) -> _StageCosts:
    """Per stage: compute, transfers in (over link.across_nodes() where crossing[s]: the hand-off s-1 -> s crosses
    nodes), bytes held."""
    bounds = list(accumulate(candidate.layers_per_stage, initial=0))
    far = link.across_nodes() if crossing is not None and any(crossing) else link
    overhead = link.per_action_overhead_ms
    slower = 1.0 + link.compute_slowdown
    n_stages = candidate.n_stages

    # Per-layer columns, summed per stage with sum() over slices (the same sums as summing the layers one by one).
    checkpointing = candidate.activation_checkpointing
    forward_ms = [c.forward_ms for c in costs]
    if checkpointing:  # a layer's checkpointed forward and recompute default to its forward
        forward_ms = [f if c.checkpointed_forward_ms is None else c.checkpointed_forward_ms
                      for f, c in zip(forward_ms, costs)]
        recompute_ms = [c.forward_ms if c.recompute_ms is None else c.recompute_ms for c in costs]
        parameter_groups = [c.parameter_groups for c in costs]
    backward_input_ms = [c.backward_input_ms for c in costs]
    backward_weight_ms = [c.backward_weight_ms for c in costs]
    split_input_ms = [c.split_input_extra_ms for c in costs]
    split_weight_ms = [c.split_weight_extra_ms for c in costs]
    saved_bytes = [c.saved_bytes for c in costs]
    parameter_bytes = [c.parameter_bytes for c in costs]
    copies = [c.autocast_copy_bytes for c in costs]
    grad_factor = weight_gradient_factor(candidate)  # fresh weight gradients, per float32 parameter byte
    param_factor = param_dtype_factor(candidate)
    profiled = [c.backward_bytes for c in costs]

    owner = stage_ranks(candidate.schedule, candidate.pipeline_degree, n_stages)
    shared_copies = stage_shared_copy_bytes(shared, bounds, owner)
    tied_casts = _sharded_tied_cast_bytes(copies, shared, bounds, owner, candidate=candidate)
    gradient_moves = stage_gradient_moves(shared, bounds, owner)

    result: dict[str, list[Any]] = {k: [] for k in _StageCosts.__dataclass_fields__}
    for s, (a, b) in enumerate(pairwise(bounds)):
        forward = sum(forward_ms[a:b]) * slower
        recompute = sum(recompute_ms[a:b]) * slower if checkpointing else 0.0
        backward_input = sum(backward_input_ms[a:b]) * slower
        backward_weight = sum(backward_weight_ms[a:b]) * slower
        stage_in = input_bytes if a == 0 else costs[a - 1].output_bytes
        stage_out = costs[b - 1].output_bytes
        # as they travel: a bfloat16 wire halves float32 tensors (memory_model.wire_bytes); the batch never does
        wire_in = 0.0 if a == 0 else wire_bytes(stage_in, costs[a - 1].wire_output_bytes, candidate=candidate)
        wire_out = wire_bytes(stage_out, costs[b - 1].wire_output_bytes, candidate=candidate)
        saved = int(sum(saved_bytes[a:b])) + autocast_copy_bytes(sum(copies[a:b]), candidate=candidate)
        saved += tied_casts[s]
        if a and not boundary_shared(candidate):  # its first layer saves its own copy of what it received
            saved += costs[a].saved_handoff_bytes
        result["forward"].append(forward + overhead)
        result["backward"].append(backward_input + backward_weight + recompute + overhead)
        if s == 0:
            # The first stage's input is the data: no input gradient to compute, so torch's split backward finds
            # nothing to do in I and its W runs the whole backward (traced: I ~0.01 ms).
            result["backward_input"].append(overhead)
            result["backward_weight"].append(backward_input + backward_weight + recompute + overhead)
        else:
            # Checkpointed, torch's W runs one autograd pass per parameter group, and each pass recomputes the
            # stage (torch 2.13 stage_backward_weight): GPT's zero-bubble schedules ran 4-4.7x slower with it.
            # torch's I and W each walk the graph again in Python (LayerCost.split_input_extra_ms)
            groups = sum(parameter_groups[a:b]) if checkpointing else 0
            split_input, split_weight = sum(split_input_ms[a:b]) * slower, sum(split_weight_ms[a:b]) * slower
            result["backward_input"].append(backward_input + split_input + recompute + overhead)
            result["backward_weight"].append(backward_weight + split_weight + groups * recompute + overhead)
        crosses_in = crossing is not None and s > 0 and crossing[s]
        crosses_out = crossing is not None and s < n_stages - 1 and crossing[s + 1]
        into = far if crosses_in else link
        back = far if crosses_out else link
        result["activation_wire"].append(wire_in / far.bandwidth_bytes_per_s * 1e3 if crosses_in else 0.0)
        result["grad_wire"].append(wire_out / far.bandwidth_bytes_per_s * 1e3 if crosses_out else 0.0)
        # sends_on_rank: a send inside the node goes out on the sender's time (output_send, grad_send), and the
        # receiver waits for its latency alone
        on_rank_in = link.sends_on_rank and not crosses_in
        on_rank_out = link.sends_on_rank and not crosses_out
        result["activation_transfer"].append(
            0.0 if s == 0 else into.latency_s * 1e3 if on_rank_in else into.transfer_ms(wire_in))
        result["grad_transfer"].append(
            0.0 if s == n_stages - 1 else back.latency_s * 1e3 if on_rank_out else back.transfer_ms(wire_out))
        # across nodes the posting thread still copies the bytes into its socket (at the rate inside a node); the
        # receiver waits for the wire on top (activation_transfer, grad_transfer above)
        result["output_send"].append(
            wire_out / link.bandwidth_bytes_per_s * 1e3 if link.sends_on_rank and s < n_stages - 1 else 0.0)
        result["grad_send"].append(
            wire_in / link.bandwidth_bytes_per_s * 1e3 if link.sends_on_rank and s > 0 else 0.0)
        first, last = s == 0, s == n_stages - 1
        # the last stage keeps its output as the loss gets it (float32 in bf16: runtime.loss_input), the others as
        # it travels
        kept_out = (loss_input if loss_input is not None else stage_out) if last else wire_out
        # a checkpoint keeps the input its stage computes on: cast to float32 on arrival where not shared
        kept_in = stage_in if first or boundary_shared(candidate) else max(stage_in, int(2 * wire_in))
        held = held_per_microbatch(saved, kept_in, kept_out, candidate=candidate)
        # what it keeps of its input and saves of its output are tensors counted already (memory_model)
        held -= input_held_elsewhere_bytes(stage_in, saved_bytes[a], costs[a].saved_input_bytes,
                                           candidate=candidate, first=first)
        # a float32 output cast for a bfloat16 wire gets its gradient made by the cast's backward
        cast_out = not last and cast_on_wire(stage_out, costs[b - 1].wire_output_bytes, candidate=candidate)
        output_saved = output_saved_bytes(stage_out, costs[b - 1].saved_output_bytes, candidate=candidate, last=last,
                                          cast_out=cast_out)
        held -= output_saved
        recompute = recompute_bytes(saved, candidate=candidate, input_saved=costs[a].saved_input_bytes or 0)
        if checkpointing and last:  # the loss runs outside the checkpointed stage: what it saves is kept
            held += min(loss_saved, saved)
            recompute -= min(loss_saved, saved)
        result["held_bytes"].append(int(held))
        result["loss_saved_bytes"].append(min(loss_saved, saved) if last else 0)
        # the I detaches the loss: what it saved goes, and the output it read once the I returns (traced: the
        # last stage's logits of a micro-batch whose I had run were gone before its W)
        result["input_released_bytes"].append(min(loss_saved, saved) + kept_out - output_saved if last else 0)
        result["recompute_bytes"].append(recompute)
        weight_recompute = 0
        if checkpointing and s:
            # what the recompute rebuilds of each layer: the checkpoint keeps the stage input (the first layer's)
            # and the loss saves its own outside the checkpoint (the last layer's profile counts it)
            rebuilt = list(saved_bytes[a:b])
            rebuilt[0] -= min(costs[a].saved_input_bytes or 0, rebuilt[0])
            if last:
                rebuilt[-1] -= min(result["loss_saved_bytes"][-1], rebuilt[-1])
            # what a later layer saves of its input, rebuilt inside the stage (the first layer's is the checkpoint's)
            inputs = [0] + [c.saved_input_bytes or 0 for c in costs[a + 1:b]]
            composed = (_composed_weight_recompute_bytes(recompute, rebuilt, parameter_groups[a:b],
                                                         [c.checkpoint_passes for c in costs[a:b]], inputs)
                        if b - a > 1 else None)
            weight_recompute = composed if composed is not None else _weight_recompute_bytes(
                recompute, rebuilt, parameter_groups[a:b], [c.checkpoint_weight_bytes for c in costs[a:b]])
        result["weight_recompute_bytes"].append(weight_recompute)
        receive = receive_buffer_bytes(wire_in, wire_out, candidate=candidate, first=first, last=last)
        result["receive_buffer_bytes"].append(int(receive))
        _, sent_grad = sent_bytes(wire_in, wire_out, first=first, last=last)
        result["output_held_bytes"].append(int(kept_out))
        result["sent_grad_bytes"].append(int(sent_grad))
        layer_in = [stage_in] + [costs[i].output_bytes for i in range(a, b - 1)]
        layer_out = [c.output_bytes for c in costs[a:b]]
        largest = max(parameter_bytes[a:b])
        # a tied parameter is one tensor on every stage that holds it (its first layer's bytes count it once)
        tied = max((nbytes for layers, nbytes in shared if any(a <= i < b for i in layers)), default=0)
        result["largest_layer_bytes"].append(max(largest, tied))
        result["largest_grad_bytes"].append(int(largest * grad_factor))
        stage_profiled = [p for p in profiled[a:b] if p is not None]
        input_peak: int | None
        # a bfloat16 input the runtime casts to float32 on arrival: its float32 gradient in the backward
        arrival = arrival_copy_bytes(stage_in, wire_in, candidate=candidate, first=first)
        result["arrival_copy_bytes"].append(int(arrival))
        if len(stage_profiled) == b - a:
            input_peak, kept = input_backward_bytes(stage_profiled, first=first, last=last, cast_out=cast_out,
                                                    arrival_grad=arrival)
            n_layers = b - a
            weight_kept = [p.input_kept[int(i == n_layers - 1 and not last and not cast_out)]
                           for i, p in enumerate(stage_profiled)]
            first_weight: int | None = first_weight_bytes(parameter_bytes[a:b], weight_kept)
        else:  # a profile saved before backward bytes were recorded
            input_peak, kept = None, split_kept_bytes(saved_bytes[a:b], layer_in, first=first)
            first_weight = None
        result["split_kept_bytes"].append(kept)
        result["input_backward_bytes"].append(input_peak)
        result["loss_backward_bytes"].append(
            (loss_backward_bytes(stage_out) if loss_backward is None else loss_backward) if last else 0)
        # what each layer's backward lets go of once done: not the output (kept for the send), nor what the loss
        # saved (let go of before, in _peak_memory)
        freed = [*saved_bytes[a:b - 1], saved_bytes[b - 1] - output_saved - result["loss_saved_bytes"][-1]]
        backwards: tuple[tuple[str, WeightGradients], ...] = (
            ("backward_bytes", "fresh"),
            ("first_backward_bytes", "kept" if gradients_made_in_step(candidate)
             else "accumulated" if candidate.sharded else "elsewhere"),
        )
        # resharding: a backward that gathers holds each layer's working copy as it goes
        gathered = ([p * param_factor for p in parameter_bytes[a:b]]
                    if candidate.sharded and candidate.reshard_after_forward else None)
        for key, weights in backwards:
            layers = dict(first=first, last=last, weights=weights, profiled=profiled[a:b], grad_factor=grad_factor,
                          freed=freed, cast_out=cast_out, arrival_grad=arrival,
                          recomputed_output=costs[b - 1].saved_output_bytes if checkpointing else 0)
            result[key].append(int(layer_backward_bytes(parameter_bytes[a:b], layer_in, layer_out, **layers)))
            result[f"gathering_{key}"].append(0 if gathered is None else int(layer_backward_bytes(
                parameter_bytes[a:b], layer_in, layer_out, **layers, gathered=gathered)))
        copies_of_shared = shared_copies[s]
        stage_parameters = int(sum(parameter_bytes[a:b])) + copies_of_shared
        result["parameter_bytes"].append(stage_parameters)
        result["shared_copy_bytes"].append(copies_of_shared)
        result["first_gradient_bytes"].append(stage_parameters + gradient_moves[s])
        # a tied parameter's copy made on this stage counted at the worst layer; never over the whole stage's
        result["first_weight_bytes"].append(stage_parameters if first_weight is None
                                            else min(stage_parameters, first_weight + copies_of_shared))
        sharded = candidate.sharded
        copy = int(working_copy_bytes(stage_parameters, candidate=candidate))
        result["working_copy_bytes"].append(copy)
        result["gather_unit_bytes"].append(int(min(largest, stage_parameters) * param_factor) if sharded else 0)
        result["shard_units"].append(sum(1 for p in parameter_bytes[a:b] if p) if sharded else 0)
        result["shard_groups"].append(sum(max(1, c.parameter_groups) for c in costs[a:b] if c.parameter_bytes)
                                      if sharded else 0)
        two_units = int(min(2 * largest, stage_parameters) * param_factor)
        result["forward_copy_bytes"].append(two_units if sharded and candidate.reshard_after_forward else 0)
        result["gather_buffer_bytes"].append(int(gather_buffer_bytes(largest, candidate=candidate)))
        unit_copy = working_copy_bytes(largest, candidate=candidate)
        result["reduce_buffer_bytes"].append(int(reduce_buffer_bytes(largest, candidate=candidate) - unit_copy))
        result["unsharded_grad_bytes"].append(int(unsharded_gradient_bytes(stage_parameters, candidate=candidate)))
    return _StageCosts(**result)


def _add_rank_side_costs(dur: list[float], plan: ActionGraph, stages: _StageCosts, link: LinkModel) -> None:
    """What a rank spends beyond its stages' compute: posting each cross-rank send and receive, and each backward's
    slowdown from the activations the rank holds at that moment (walked in the rank's own order, as in
    _peak_memory)."""
    message = link.message_overhead_ms
    if message:
        dur[:] = [d + message * k for d, k in zip(dur, plan.messages)]
    if link.sends_on_rank:  # each send's bytes, on the sender's time (F sends its output, B or I its input's grad)
        send = {"F": stages.output_send, "B": stages.grad_send, "I": stages.grad_send}
        for a, (k, c) in enumerate(zip(plan.messages, plan.cross)):
            if k > int(c):
                dur[a] += (k - int(c)) * send[plan.kind[a]][plan.stage[a]]
    pressure = link.held_activation_ms_per_mib / 2**20
    if pressure:
        held = stages.held_bytes
        for ids in plan.rank_actions:
            live = 0
            for a in ids:
                kind = plan.kind[a]
                if kind == "F":
                    live += held[plan.stage[a]]
                    continue
                dur[a] += pressure * live
                if kind != "I":
                    live -= held[plan.stage[a]]


@dataclass(frozen=True, kw_only=True)
class _ShardWalk:
    """Per action of a sharded candidate, what FSDP2 does around it under torch's pipeline stage (memory_model's
    docstring says why):

        gathers      its stage's parameters are all-gathered before it: the stage's first F of the step, and
                     with reshard_after_forward every F, and every B, I or W after an F, of the stage (the runtime
                     gathers before a W too: compat.unshard_before_split_backward)
        reshards     the working copy is let go of after it: an F with reshard_after_forward, or the stage's last
                     backward (its gradients' reduce-scatter reshards)
        reduces      the stage's last backward (B, I or W): the gradients' reduce-scatter follows it
        first_grad   the stage's first backward making weight gradients (B, or W): they start to accumulate
    """

    gathers: list[bool]
    reshards: list[bool]
    reduces: list[bool]
    first_grad: list[bool]


@functools.lru_cache(maxsize=64)  # the planner simulates many candidates per graph (hashing one is ~1 ms)
def _shard_walk(plan: ActionGraph, reshard_after_forward: bool) -> _ShardWalk:
    n = len(plan.kind)
    gathers, reshards, reduces, first_grad = [False] * n, [False] * n, [False] * n, [False] * n
    last_backward: dict[int, int] = {}
    for a in range(n):  # per stage, index order is time order (a stage lives on one rank)
        if plan.kind[a] != "F":
            last_backward[plan.stage[a]] = a
    gathered: set[int] = set()
    graded: set[int] = set()
    for a in range(n):
        s, kind = plan.stage[a], plan.kind[a]
        if s not in gathered:
            gathers[a] = True
            gathered.add(s)
        if kind in ("B", "W") and s not in graded:
            first_grad[a] = True
            graded.add(s)
        if kind == "F" and reshard_after_forward:
            reshards[a] = True
            gathered.discard(s)
        if last_backward[s] == a:
            reduces[a] = reshards[a] = True
            gathered.discard(s)
    return _ShardWalk(gathers=gathers, reshards=reshards, reduces=reduces, first_grad=first_grad)


def _add_shard_costs(
    dur: list[float], plan: ActionGraph, stages: _StageCosts, walk: _ShardWalk, candidate: Candidate,
    link: LinkModel, n_nodes: int,
) -> tuple[list[float], list[float]]:
    """What sharding adds to a rank's actions, on the link the dp group spans (n_nodes nodes): per gather, one
    FSDP2 unit's all-gather (the largest layer's) that nothing hides, and the rest of the stage's as far as the
    action's compute does not hide it (FSDP2 gathers the next unit while one computes); after the stage's last
    backward, the reduce-scatter of its float32 gradients, which the rank waits for (torch's perform_reduce_grad
    ends with FSDP's final callback, joining the reduce-scatter stream). Returns, per rank, the all-gather and the
    reduce-scatter time of the step (hidden or not)."""
    dp = candidate.data_parallel_degree
    unit = [link.all_gather_ms(b, dp, n_nodes) for b in stages.gather_unit_bytes]
    rest = [link.all_gather_ms(c - b, dp, n_nodes) for c, b in zip(stages.working_copy_bytes,
                                                                     stages.gather_unit_bytes)]
    reduce = [link.reduce_scatter_ms(g, dp, n_nodes) for g in stages.unsharded_grad_bytes]
    hooks = [link.shard_unit_overhead_ms * n + link.shard_unit_overhead_ms_per_mib * p / 2**20
             for n, p in zip(stages.shard_units, stages.parameter_bytes)]
    if link.collective_wake_ms:  # each unit's collective is waited for on its own (LinkModel.collective_wake_ms)
        unit = [u + link.collective_wake_ms * n for u, n in zip(unit, stages.shard_units)]
        reduce = [r + link.collective_wake_ms * n for r, n in zip(reduce, stages.shard_units)]
    gather_ms = [0.0] * candidate.pipeline_degree
    reduce_ms = [0.0] * candidate.pipeline_degree
    for a, s in enumerate(plan.stage):
        dur[a] += hooks[s]
        if walk.gathers[a]:
            dur[a] += unit[s] + max(0.0, rest[s] - dur[a])
            gather_ms[plan.rank[a]] += unit[s] + rest[s]
        if walk.reduces[a]:
            dur[a] += reduce[s]
            reduce_ms[plan.rank[a]] += reduce[s]
    return gather_ms, reduce_ms


def optimizer_ms_per_byte(profile: Profile, link: LinkModel) -> float:
    """Optimizer-step time per parameter byte: the profile's timed steps net of the fixed cost each block's own step
    paid (optimizer_call_ms, charged once per rank instead), else the link model's throughput."""
    if profile.optimizer_step_ms > 0 and profile.parameter_bytes > 0:
        steps = sum(1 for layer in profile.layers if layer.parameter_bytes > 0)
        net = max(0.0, profile.optimizer_step_ms - steps * profile.optimizer_call_ms)
        return net / profile.parameter_bytes
    return 1e3 / link.optimizer_bytes_per_s


def optimizer_call_ms(profile: Profile) -> float:
    """What a rank's one optimizer step costs whatever it updates (Profile.optimizer_call_ms; 0 when the profile
    has no timed step, and the link model's throughput stands for it)."""
    return profile.optimizer_call_ms if profile.optimizer_step_ms > 0 else 0.0


def _ddp_accumulation(plan: ActionGraph, stages: _StageCosts, candidate: Candidate) -> tuple[list[int], list[int]]:
    """Per stage: the gradient bytes DistributedDataParallel holds twice while a step's micro-batches accumulate,
    and the stage's last backward action. torch's stage runs every backward but its last under no_sync, so
    autograd accumulates the gradients in tensors of its own beside DDP's buckets (the gradients proper, views of
    the buckets from the sync on: gradient_as_bucket_view), until the last backward's sync copies them into the
    buckets and lets them go. 0 where the stage does not run under DDP (runtime.overlaps_gradient_sync: replicas,
    whole backwards) or runs one backward a step. Measured on the CPU stand-in: mlp pp 2 x dp 2, 1F1B, 4
    micro-batches, 48.3 MB against 43.6 MB predicted without it."""
    n = candidate.n_stages
    if (candidate.data_parallel_degree == 1 or candidate.sharded
            or SCHEDULES[candidate.schedule].splits_backward):
        return [0] * n, [-1] * n
    backwards = [0] * n
    last = [-1] * n
    for ids in plan.rank_actions:
        for a in ids:
            if plan.kind[a] == "B":
                backwards[plan.stage[a]] += 1
                last[plan.stage[a]] = a
    return [int(stages.parameter_bytes[s]) if backwards[s] > 1 else 0 for s in range(n)], last


def _peak_memory(
    plan: ActionGraph, stages: _StageCosts, candidate: Candidate, state_ratio: float, step_ratio: float = 0.0,
    batch: tuple[int, int] = (0, 0), *, per_tensor: bool = False, shard: _ShardWalk | None = None,
) -> list[int]:
    """Walk each rank's actions in order (a rank runs one at a time, so list order is time order), with
    h = held, o = its output part, g = the input gradient sent back, r = recompute, t = the backward's temporaries
    at its worst layer (memory_model.layer_backward_bytes; the stage's first backward of the step makes the weight
    gradients it keeps), l = the loss's backward on the last stage, which runs before the stage's own (and before a
    checkpointed stage's recompute), s = what the loss saved, let go of after the loss's backward, i = what an I
    holds at most (memory_model.input_backward_bytes), w = a W's fresh weight gradients at its largest layer (a
    first W: the stage's gradients it makes; the first stage's W runs the whole backward: t):

        F: +h                                          B: (+max(l, r + t - s), transient) -h +o* +g* +p**
        I: (+max(l, r + i), transient) +r +g* +k -x    W: (+w, transient) -h -r -k +x +o* +p**

    (k: the gradients an I leaves for its W, kept until the W; x: what the loss saved and the output it read, let go
    of when the I detaches the loss)

    * where the schedule keeps its sends to the end (memory_model.sends_kept_to_the_end) the output (not on the last
    stage) stays after the backward and the gradient sent stays too; under 1F1B the last backward's output and
    gradient linger until the next backward. ** the stage's gradients p, after its first backward touching weights,
    where memory_model.gradients_made_in_step (else they are static). Then the optimizer step, once the pipeline is
    done: its temporaries (step_ratio x the rank's parameter bytes; per_tensor: step_ratio x all parameter bytes x
    the rank's largest layer over the model's, memory_model.optimizer_step_bytes), the gradients and the input
    gradients the I actions left on the receive buffers, on top of the static memory (parameters, optimizer state,
    receive buffers, the batch: batch = one micro-batch's (inputs, targets), memory_model.batch_bytes).

    Sharded (shard: when FSDP2 gathers, reshards and reduces, _ShardWalk), with c = the stage's working copy, u = its
    unsharded gradients, a = a unit's all-gather input, e = a unit's reduce-scatter input less its working copy (let
    go of first), f = a resharding forward's two units:

        kept gathered, the stage's first F: (+a, transient) +c
        resharding, an F: (+f, transient; + a if it gathers), and -c first if a backward left the stage gathered
        resharding, a B that gathers: its layer by layer, the units gathered so far and the next one prefetched
        included (memory_model.layer_backward_bytes' gathered), +c after it (FSDP2 keeps them); an I or W that
        gathers: (+f + a, transient) +c after it
        the first backward making weight gradients: +u after it (they accumulate layer by layer as the activations
        go, counted so in its backward bytes: "accumulated")
        the last backward: (+e, transient) -u -c +u/dp (the gradient shards, kept to the optimizer step)

    and the static memory holds the parameter and optimizer-state shards (memory_model.parameter_memory_bytes);
    the optimizer step's temporaries are the shards' too (/ dp).

    Replicated under DistributedDataParallel, a stage that runs several backwards a step holds a second copy of its
    gradients (u) from its first backward to its last (_ddp_accumulation): +u after the first, -u after the last."""
    peaks = []
    shards = dp_shards(candidate)
    model_parameters = [p - c for p, c in zip(stages.parameter_bytes, stages.shared_copy_bytes)]
    resharding = candidate.reshard_after_forward
    stage_of, kind_of, held, recompute = plan.stage, plan.kind, stages.held_bytes, stages.recompute_bytes
    out, grad = stages.output_held_bytes, stages.sent_grad_bytes
    last = candidate.n_stages - 1
    kept = sends_kept_to_the_end(candidate.schedule)
    # A hand-off between two stages of the same rank (V placement) is no send: torch makes the output the next
    # stage's receive buffer (set_local_fwd_input) and the input gradient the previous stage's (set_local_bwd_input),
    # both counted with the receive buffers.
    owner = plan.stage_rank
    local_out = [s < last and owner[s + 1] == owner[s] for s in range(last + 1)]
    local_in = [s > 0 and owner[s - 1] == owner[s] for s in range(last + 1)]
    held = [h - (o if lo else 0) for h, o, lo in zip(held, out, local_out)]
    out = [0 if lo else o for o, lo in zip(out, local_out)]
    accumulating, last_backward = _ddp_accumulation(plan, stages, candidate)
    grad = [0 if li else g for g, li in zip(grad, local_in)]
    made = gradients_made_in_step(candidate)  # a stage's gradients counted from its first backward on
    for r, ids in enumerate(plan.rank_actions):
        rank_stages = [s for s, owner in enumerate(plan.stage_rank) if owner == r]
        static = batch_bytes(*batch, candidate=candidate, first=0 in rank_stages, last=last in rank_stages) + sum(
            parameter_memory_bytes(stages.parameter_bytes[s], state_ratio, shards, gradients=not made)
            + stages.receive_buffer_bytes[s]
            for s in rank_stages
        )
        live = peak = linger = on_buffers = 0
        started: set[int] = set()  # stages whose weight gradients exist (a backward touching weights ran)
        holding: set[int] = set()  # sharded: stages whose working copy is gathered
        grad_shards = 0  # sharded: the gradient shards of the stages reduced so far
        for a in ids:
            s, kind = stage_of[a], kind_of[a]
            stays = out[s] if s != last else 0  # the output a send keeps after the backward
            during = new = 0  # sharded: what this action alone holds on top; what it leaves (gathered, gradients)
            gathering = False  # sharded, resharding: a B that gathers the stage as it goes
            if shard is not None:
                if resharding and kind == "F":
                    if s in holding:  # a backward left it gathered: the forward lets go of each unit after it
                        live -= stages.working_copy_bytes[s]
                        holding.discard(s)
                        during = stages.forward_copy_bytes[s]
                    elif shard.gathers[a]:
                        during = stages.forward_copy_bytes[s] + stages.gather_buffer_bytes[s]
                elif shard.gathers[a]:
                    if kind == "F":  # kept gathered: the first forward gathers the stage for the step
                        peak = max(peak, live + stages.gather_buffer_bytes[s])
                        live += stages.working_copy_bytes[s]
                    else:  # resharding: a backward gathers unit by unit as it goes, and keeps them
                        gathering = kind == "B"  # (a B's layer by layer, in its backward bytes)
                        during = 0 if gathering else stages.forward_copy_bytes[s] + stages.gather_buffer_bytes[s]
                        new = stages.working_copy_bytes[s]
                    holding.add(s)
                if shard.first_grad[a]:  # they accumulate layer by layer as the activations go
                    new += stages.unsharded_grad_bytes[s]
            if kind == "F":
                live += held[s]
                # the float32 copy of a bfloat16 input stays until the forward returns (arrival_copy_bytes)
                during += stages.arrival_copy_bytes[s]
                if live + during > peak:  # (not max(): this loop runs once per action of every simulated candidate)
                    peak = live + during
                continue
            if gathering:
                temp = stages.gathering_backward_bytes[s] if s in started else stages.gathering_first_backward_bytes[s]
            else:
                temp = stages.backward_bytes[s] if s in started else stages.first_backward_bytes[s]
            loss = stages.loss_backward_bytes[s]  # before the stage's own backward (and its recompute)
            if kind == "B":
                # the loss lets go of what it saved before the stage's backward (and recompute) starts
                peak = max(peak, live + during + max(loss, recompute[s] + temp - stages.loss_saved_bytes[s]))
                if accumulating[s]:
                    if s not in started:
                        new += accumulating[s]
                    elif a == last_backward[s]:
                        live -= accumulating[s]
                if made and s not in started:
                    new += stages.first_gradient_bytes[s]
                started.add(s)
                live -= held[s] - stays
                if kept:
                    live += grad[s]
                else:
                    live += grad[s] - linger
                    linger = stays + grad[s]
            elif kind == "I":
                k = stages.split_kept_bytes[s]
                input_peak = stages.input_backward_bytes[s]
                if input_peak is None:
                    input_peak = max(temp, k + grad[s])
                peak = max(peak, live + during + max(loss, recompute[s] + input_peak))
                # what the I recomputed goes with it (a checkpointed stage's W recomputes again: traced on OPT)
                live += grad[s] + k - stages.input_released_bytes[s]
                on_buffers += grad[s]
            else:  # W: weight gradients only (the first stage's W runs its whole backward)
                if s != 0:  # a first W makes the stage's gradients, kept
                    temp = stages.largest_grad_bytes[s] if s in started else stages.first_weight_bytes[s] if made else 0
                rebuilt = recompute[s] if s == 0 else stages.weight_recompute_bytes[s]
                peak = max(peak, live + during + temp + rebuilt)
                if made and s not in started:
                    new += stages.first_gradient_bytes[s]
                started.add(s)
                live -= held[s] + stages.split_kept_bytes[s] - stages.input_released_bytes[s] - stays
            live += new
            if live > peak:
                peak = live
            if shard is not None and shard.reduces[a]:
                peak = max(peak, live + stages.reduce_buffer_bytes[s])  # a unit's reduce-scatter input
                shard_of = int(gradient_shard_bytes(stages.parameter_bytes[s], candidate=candidate))
                live += shard_of - stages.unsharded_grad_bytes[s]
                grad_shards += shard_of
                if s in holding:
                    live -= stages.working_copy_bytes[s]
                    holding.discard(s)
        step = optimizer_step_bytes(  # the model's parameters: the profile's peak is over each tied tensor once
            step_ratio, [stages.parameter_bytes[s] for s in rank_stages], model_parameters,
            [stages.largest_layer_bytes[s] for s in rank_stages], stages.largest_layer_bytes, per_tensor=per_tensor,
        ) / shards + on_buffers + grad_shards
        if made:  # every stage's gradients, from its backwards
            step += sum(stages.parameter_bytes[s] for s in rank_stages)
        peaks.append(int(static + max(peak, step)))
    return peaks
