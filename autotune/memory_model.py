"""Pure: what one pipeline rank holds in memory, rule by rule. The simulator walks a rank's actions with these rules
(autotune.simulate) and the planner's memory-aware split caps one stage with them (stage_memory_bytes), so both
count the same bytes.

    parameters, their gradients, optimizer state   parameter_bytes x (2 + optimizer_state_ratio)   always
                                                    (sharded: the parameter and optimizer-state      always
                                                    shards, x (1 + ratio) / dp; the gradient shards, reduce ->
                                                    / dp, from the reduce-scatter)                   optimizer
    receive buffers                                 n_microbatches x (stage input + output grad)     always
    the global batch's inputs                       n_microbatches x the model input                 always
    per in-flight micro-batch                       saved activations (checkpointed: the stage input)
                                                    + the stage output torch keeps until the backward
    tensor parallel (tp > 1, on each tp rank)       the plan's sharded parameters (their gradients   as above
                                                    and state) / tp, the rest whole; saved
                                                    activations: the hidden states a block saves
                                                    (tp_saved_bytes) whole, the rest / tp; outputs,
                                                    receive buffers, the batch and the loss whole
    sent tensors                                    each output sent on, each input gradient sent    F / B to the
                                                    back (torch waits for its sends at the end)      step's end
    one backward (transient)                        the loss's gradients (last stage: 2 x output),   during B / I
                                                    or a layer's weight, input and output gradients
    a split backward's I, for its W                 the weight ops' output gradients                 I to W
    checkpointed backward                           the stage's saved activations, rebuilt for one micro-batch
    optimizer step                                  its temporaries (optimizer_step_bytes)           after the
                                                    + split schedules' input gradients (on buffers)  pipeline
    bf16, replicated (torch.autocast)               the bfloat16 copies of the stage's weights each  per in-flight
                                                    forward casts and its graph keeps (profiled)     micro-batch
    sharded (FSDP2 fully_shard over dp)             the unsharded working copy, in the param dtype   gathered ->
                                                    (bf16: 2 B per parameter, fp32: 4 B)             resharded
                                                    the unsharded float32 gradients                  1st backward
                                                                                                     -> reduce
                                                    a unit's reduce-scatter input (float32)          the reduce
                                                    a unit's all-gather input (its shard)            a gather

Sharded, torch's pipeline stage runs every backward without gradient sync and without resharding after it
(stage.backward_maybe_with_nosync) and reduce-scatters once after the stage's last backward (perform_reduce_grad,
which also reshards). So the stage's gradients accumulate unsharded, in float32 (MixedPrecisionPolicy's reduce
dtype) from its first backward to the reduce-scatter, and its parameters, once gathered by a backward, stay
gathered until the next forward (reshard_after_forward: each FSDP unit lets go of its parameters after its own
forward) or, without resharding after forward, until the step's reduce-scatter. A forward that gathers under
reshard_after_forward holds two units at a time (the one computing and the next, prefetched). The reduce works unit
by unit (FSDPParamGroup.post_backward: reshard the unit, copy its gradients into the reduce-scatter's flat input,
let them go), so it holds one unit's input on top at most, less that unit's working copy. Each block is an FSDP
unit (as the runtime shards a stage), the stage's largest standing for any.

Sent tensors: torch's send works hold their tensor until they are waited, and ScheduleGPipe and the runtime of the
multi-stage schedules (_PipelineScheduleRuntime) wait for every send only when the pipeline ends; Schedule1F1B
waits for each send before the next, and its last output and input gradient sent linger until the next backward.
A split backward's I also leaves the input gradient on the receive buffer's .grad until the next step starts, so it
is still there during the optimizer step. Between two stages of one rank (V placement) nothing is sent: the output
becomes the next stage's receive buffer and the input gradient the previous stage's, counted with those.

What the profile cannot tell, and so is counted one way: the tensor between two stages is saved either by the stage
after (a Linear or LayerNorm saves its input: then it is that stage's float32 receive buffer) or by the stage before
(a ReLU saves its output: then it is the output that stage keeps); both sides count it, over by one boundary tensor
per micro-batch held, on one of the two ranks (recipes/cnn.py: +2 % to +22 %). What a layer allocates inside its own
backward (an MLP's hidden gradient, attention's gradients) is not measured, so not counted (a 2-block GPT: down to
-7 % on the rank where a full backward's first layer sets the peak). Both need the profile to record them per layer.
"""

from __future__ import annotations

from collections.abc import Sequence

from autotune.candidate import Candidate
from autotune.schedules import SCHEDULES, Schedule


def wire_factor(candidate: Candidate) -> float:
    """Bytes of a tensor sent between stages per byte of the profile's: 0.5 for a bfloat16 wire in fp32. A bf16
    profile measured the tensors autocast makes (bfloat16 where a matmul made them): sent as they are."""
    return 0.5 if candidate.wire_dtype == "bfloat16" and candidate.precision == "fp32" else 1.0


def param_dtype_factor(candidate: Candidate) -> float:
    """Bytes of a parameter's compute copy per byte of its float32 master: 0.5 in bf16."""
    return 0.5 if candidate.precision == "bf16" else 1.0


def dp_shards(candidate: Candidate) -> int:
    """What the float32 state (parameters, gradients, optimizer state) is split into per rank: dp when sharded."""
    return candidate.data_parallel_degree if candidate.sharded else 1


def parameter_memory_bytes(parameter_bytes: float, optimizer_state_ratio: float, shards: int = 1) -> float:
    """What a stage holds for the whole step: its parameters, their gradients and the optimizer state
    (optimizer_state_ratio x the parameters; AdamW: 2), float32. Sharded over `shards` ranks (dp_shards > 1): the
    parameter and optimizer-state shards only; the gradients are unsharded until the stage's reduce-scatter
    (unsharded_gradient_bytes) and sharded after it, until the optimizer step (gradient_shard_bytes: the runtime
    sets them to None before each step)."""
    if shards == 1:
        return parameter_bytes * (2 + optimizer_state_ratio)
    return parameter_bytes * (1 + optimizer_state_ratio) / shards


def weight_version_bytes(parameter_bytes: float, *, candidate: Candidate) -> float:
    """Asynchronous (2BW): the second version of the stage's weights (autotune.weight_versions); 0 otherwise."""
    return parameter_bytes if SCHEDULES[candidate.schedule].asynchronous else 0.0


def gradient_shard_bytes(parameter_bytes: float, *, candidate: Candidate) -> float:
    """Sharded: the stage's float32 gradient shards, from its reduce-scatter to the optimizer step; 0 replicated
    (counted with the parameters)."""
    return parameter_bytes / candidate.data_parallel_degree if candidate.sharded else 0.0


def working_copy_bytes(parameter_bytes: float, *, candidate: Candidate) -> float:
    """Sharded: the unsharded parameters FSDP2 gathers for compute, in the param dtype (param_dtype_factor); 0
    replicated (the parameters themselves are computed on)."""
    return parameter_bytes * param_dtype_factor(candidate) if candidate.sharded else 0.0


def gather_buffer_bytes(unit_bytes: float, *, candidate: Candidate) -> float:
    """Sharded: an all-gather's input while it runs, the rank's shard of one FSDP unit (unit_bytes of float32
    parameters) copied in the param dtype."""
    if not candidate.sharded:
        return 0.0
    return unit_bytes * param_dtype_factor(candidate) / candidate.data_parallel_degree


def reduce_buffer_bytes(unit_bytes: float, *, candidate: Candidate) -> float:
    """Sharded: a reduce-scatter's flat input, one FSDP unit's gradients in float32 (the reduce dtype)."""
    return float(unit_bytes) if candidate.sharded else 0.0


def unsharded_gradient_bytes(parameter_bytes: float, *, candidate: Candidate) -> float:
    """Sharded: the stage's gradients as torch's pipeline stage accumulates them, unsharded and float32 (the reduce
    dtype), from its first backward to its reduce-scatter. 0 replicated (counted with the parameters)."""
    return float(parameter_bytes) if candidate.sharded else 0.0


def weight_gradient_factor(candidate: Candidate) -> float:
    """Bytes of a backward's fresh weight gradient per float32 parameter byte: 0.5 for a sharded bf16 stage (the
    gradient of a bfloat16 working copy, accumulated into the float32 one), 1 otherwise (autocast keeps the
    parameters, so their gradients, float32)."""
    return 0.5 if candidate.sharded and candidate.precision == "bf16" else 1.0


def autocast_copy_bytes(copies: int, *, candidate: Candidate) -> int:
    """What the profiled autocast weight copies (costs.LayerCost.autocast_copy_bytes) cost this candidate per
    forward: all of them when bf16 runs under torch.autocast (replicated), none sharded (FSDP2 gathers bfloat16
    parameters, nothing to cast) or in fp32."""
    return copies if candidate.precision == "bf16" and not candidate.sharded else 0


def receive_buffer_bytes(stage_in: int, stage_out: int, *, candidate: Candidate, first: bool, last: bool) -> float:
    """What a stage's receive buffers hold for a whole step: one input activation per micro-batch (not on the first
    stage) and one output gradient per micro-batch (not on the last), in the wire dtype."""
    m = candidate.n_microbatches
    receive = (m * stage_in if not first else 0) + (m * stage_out if not last else 0)
    return receive * wire_factor(candidate)


def held_per_microbatch(saved: int, stage_in: int, stage_out: int, *, candidate: Candidate, last: bool) -> float:
    """Bytes one in-flight micro-batch keeps on a stage between its F and its B: the saved activations (only the
    stage input, with checkpointing), and the stage's output, which torch's stage keeps (fwd_cache) until that
    backward, in the wire dtype where it travels on (the last stage's output keeps its dtype for the loss)."""
    wire = wire_factor(candidate) if not last else 1.0
    return (stage_in if candidate.activation_checkpointing else saved) + int(stage_out * wire)


def recompute_bytes(saved: int, *, candidate: Candidate) -> int:
    """What a checkpointed backward rebuilds for the micro-batch it works on: the stage's saved activations (0
    without checkpointing)."""
    return saved if candidate.activation_checkpointing else 0


def stage_memory_bytes(
    *,
    parameter_bytes: float,
    saved: int,
    stage_in: int,
    stage_out: int,
    in_flight: int,
    candidate: Candidate,
    first: bool,
    last: bool,
    optimizer_state_ratio: float,
) -> float:
    """One stage alone at its worst: its parameter memory, receive buffers, `in_flight` micro-batches held, what its
    sends keep, and one checkpointed backward's rebuilt activations (the planner's per-stage cap; the simulator's
    per-rank peak walks the actions instead, and adds the batch and each backward's temporaries). Sharded: its
    float32 parameter and optimizer-state shards, the gathered working copy and the unsharded gradients. `saved`
    includes the autocast weight copies where they count (autocast_copy_bytes)."""
    held = held_per_microbatch(saved, stage_in, stage_out, candidate=candidate, last=last)
    sent = 0.0
    if sends_kept_to_the_end(candidate.schedule):  # outputs of finished micro-batches, gradients sent back
        out, grad = sent_bytes(stage_in, stage_out, candidate=candidate, first=first, last=last)
        sent = max(0, candidate.n_microbatches - in_flight) * out + candidate.n_microbatches * grad
    return (
        parameter_memory_bytes(parameter_bytes, optimizer_state_ratio, dp_shards(candidate))
        + weight_version_bytes(parameter_bytes, candidate=candidate)
        + working_copy_bytes(parameter_bytes, candidate=candidate)
        + unsharded_gradient_bytes(parameter_bytes, candidate=candidate)
        + in_flight * held
        + sent
        + recompute_bytes(saved, candidate=candidate)
        + receive_buffer_bytes(stage_in, stage_out, candidate=candidate, first=first, last=last)
    )


def sends_kept_to_the_end(schedule: Schedule) -> bool:
    """Whether torch keeps every tensor a rank sends (outputs forward, input gradients back) until the pipeline
    ends: all schedules but 1F1B, which waits for each send before its next (see the module docstring)."""
    return schedule != Schedule.ONE_F_ONE_B


def sent_bytes(stage_in: int, stage_out: int, *, candidate: Candidate, first: bool, last: bool) -> tuple[float, float]:
    """Per micro-batch, what a stage sends: (its output, not on the last stage; the gradient of its input, not on
    the first), in the wire dtype."""
    wire = wire_factor(candidate)
    return (0.0 if last else stage_out * wire), (0.0 if first else stage_in * wire)


def loss_backward_bytes(output_bytes: int) -> int:
    """What the loss's backward allocates on the last stage: cross-entropy's gradient of its log-probabilities and
    then of the logits, each the size of the model's output (traced: nll_loss_backward, _log_softmax_backward)."""
    return 2 * output_bytes


def layer_backward_bytes(
    parameter_bytes: Sequence[int], input_bytes: Sequence[int], output_bytes: Sequence[int], *, first: bool,
    last: bool, weights: bool = True,
) -> int:
    """What one backward of a stage allocates on top of what it holds, at its worst layer (the layers of the stage
    in order, their parameter bytes, input and output bytes for one micro-batch): the layer's fresh weight gradients
    (added into .grad after the first micro-batch), the gradient of its input (none for the model's input), and the
    gradient of its output where a later layer of the stage made it (the stage's last layer reads its output
    gradient from the receive buffer, or on the last stage from the loss). weights=False for a stage's first
    backward of the step, whose weight gradients become .grad (counted with the parameters). What a layer allocates
    inside itself (an MLP's hidden gradients, attention's scores) the profile does not see."""
    worst = 0
    n = len(parameter_bytes)
    for i in range(n):
        in_grad = 0 if first and i == 0 else input_bytes[i]
        out_grad = output_bytes[i] if i < n - 1 or last else 0
        worst = max(worst, (parameter_bytes[i] if weights else 0) + in_grad + out_grad)
    return worst


def split_kept_bytes(saved_bytes: Sequence[int], input_bytes: Sequence[int], *, first: bool) -> int:
    """What a split backward's I keeps for its W, for one micro-batch, on top of the activations (which the W
    still needs, all but what the loss saved: the I detaches the loss): the gradient of every weight op's output
    (torch's stage_backward_input keeps them in param_groups). Per layer, about what the layer saves beyond its
    input: a Linear + GELU layer saves its input and the Linear's output, and W needs the gradient of the latter.
    Traced on recipes/gpt.py, whose attention keeps more (the q, k and v gradients and their copies): 29.4 MB kept
    against 31.7 MB by this rule on one stage, 22 MB against 15.9 MB on another. 0 on the first stage, whose I does
    nothing (its W runs the whole backward)."""
    if first:
        return 0
    return sum(max(0, saved - into) for saved, into in zip(saved_bytes, input_bytes))


def first_layer_batch_view_bytes(stage_in: int, first_layer_saved: int, *, candidate: Candidate) -> int:
    """What the first stage saves of its input per micro-batch, which is a view of the batch (batch_bytes) and so
    not held again: the checkpoint's saved input, or without checkpointing the input the first layer saves (the
    profile does not say whether it does; Linear, Conv and Embedding do, so up to the layer's saved bytes)."""
    return stage_in if candidate.activation_checkpointing else min(stage_in, first_layer_saved)


def batch_bytes(input_bytes: int, *, candidate: Candidate) -> int:
    """The global batch's inputs, which every rank of a trial holds for the whole step (targets are not profiled)."""
    return input_bytes * candidate.n_microbatches



WHOLE_SAVED_PER_OUTPUT = 4
"""Tensor parallel without sequence parallel: what a block saves whole on every tp rank, in units of its output (the
hidden state): each norm's input and each normed input of the column-wise projections after it (two of each in a
Llama or GPT block). Everything else it saves (queries, keys, values, attention's outputs, the MLP's hidden
activations) is split over tp with the heads and the intermediate size."""


def tp_parameter_bytes(parameter_bytes: float, sharded_bytes: float, tp: int) -> float:
    """A layer's parameter bytes on one tp rank: the plan's sharded part / tp, the rest whole."""
    sharded = min(sharded_bytes, parameter_bytes)
    return parameter_bytes - sharded + sharded / tp


def tp_saved_bytes(saved: int, output_bytes: int, *, sharded_fraction: float, tp: int) -> int:
    """A layer's saved activations on one tp rank: up to WHOLE_SAVED_PER_OUTPUT x its output whole, the rest split
    over tp in the proportion of the layer the plan shards (sharded_fraction of its parameter bytes: 0 leaves a layer
    the plan does not touch whole). A head's saved logits (the loss's) are at most a few times its output: whole."""
    whole = min(saved, WHOLE_SAVED_PER_OUTPUT * output_bytes)
    split = (saved - whole) * sharded_fraction
    return round(saved - split + split / tp)


def optimizer_step_bytes(
    peak_ratio: float,
    rank_parameter_bytes: Sequence[int],
    all_parameter_bytes: Sequence[int],
    rank_largest_layer_bytes: Sequence[int],
    all_largest_layer_bytes: Sequence[int],
    *,
    per_tensor: bool,
) -> float:
    """The optimizer step's temporaries on one rank, from the profile's whole-model peak (peak_ratio x all
    parameter bytes). A foreach step (torch's default on CUDA) allocates them for all of a rank's tensors at once:
    its share by parameter bytes. A per-tensor step (the default on CPU: AdamW's sqrt and division of one tensor
    at a time, traced) allocates them for one tensor at a time: the whole-model peak scaled by the rank's largest
    layer over the model's (layers stand in for tensors)."""
    if not per_tensor:
        return peak_ratio * sum(rank_parameter_bytes)
    largest = max(all_largest_layer_bytes, default=0)
    if largest <= 0:
        return 0.0
    return peak_ratio * sum(all_parameter_bytes) * max(rank_largest_layer_bytes, default=0) / largest
