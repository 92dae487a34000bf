"""Pure: what one pipeline rank holds in memory, rule by rule. The simulator walks a rank's actions with these rules
(autotune.simulate) and the planner's memory-aware split caps one stage with them (stage_memory_bytes, which keeps
the simpler, larger rules where this says so).

    parameters, optimizer state                     parameter_bytes x (1 + optimizer_state_ratio)   always
    their gradients                                 parameter_bytes                                 1st backward
                                                    (gradients_made_in_step; else always)           -> optimizer
                                                    (sharded: the parameter and optimizer-state      always
                                                    shards, x (1 + ratio) / dp; the gradient shards, reduce ->
                                                    / dp, from the reduce-scatter)                   optimizer
    receive buffers                                 n_microbatches x (stage input + output grad),    always
                                                    as they travel (wire_bytes: a bfloat16 wire
                                                    halves what was made in float32)
    bf16 under autocast, a bfloat16 input           its float32 copy on arrival (arrival_copy_bytes) F, and its
                                                                                                     grad in B
    the batch (batch_bytes)                         n_microbatches x (the inputs on the first        always
                                                    stage's rank, the targets on the last's)
    per in-flight micro-batch                       saved activations (checkpointed: the stage input)
                                                    + the stage output torch keeps until the backward,
                                                    less what of them is the stage's input (the batch
                                                    or a receive buffer: input_held_elsewhere_bytes)
                                                    or its output (output_saved_bytes)
    tensor parallel (tp > 1, on each tp rank)       the plan's sharded parameters (their gradients   as above
                                                    and state) / tp, the rest whole; saved
                                                    activations: the hidden states a block saves
                                                    (tp_saved_bytes) whole, the rest / tp; outputs,
                                                    receive buffers, the batch and the loss whole
    sent tensors                                    each output sent on, each input gradient sent    F / B to the
                                                    back (torch waits for its sends at the end)      step's end
    one backward (transient)                        the loss's gradients (last stage: 2 x output),   during B / I
                                                    or the worst layer's backward (layer_backward_
                                                    bytes: profiled, costs.BackwardBytes)
    a split backward's I, for its W                 what it leaves (input_backward_bytes: profiled)  I to W
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
                                                    a unit's all-gather input (bf16: its shard cast) a gather
                                                    a backward that gathers: the units gathered as   the backward
                                                    it goes, the next one prefetched (per layer,
                                                    layer_backward_bytes' gathered)

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

What a layer's backward holds (its temporaries: an MLP's hidden gradient, attention's; its input and weight
gradients, less the saved activations it lets go of) and what a split backward's I keeps for its W are profiled
per layer (profiling._backward_bytes), each with the output's gradient made inside (a later layer of the stage or
the loss makes it, and it goes once used) and handed in (a stage's last layer, from its receive buffer). Profiles
saved before then fall back to counting a layer's input, output and weight gradients and split_kept_bytes
(bench/models/gpt2block.py: -7 % with 1F1B, up to +10 % with the split backwards). Not counted: side inputs (masks)
every rank gets; under tp, a layer's backward figures are split as its saved activations are (not measured).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from autotune.candidate import Candidate
from autotune.costs import BackwardBytes
from autotune.schedules import SCHEDULES, Schedule


def wire_factor(candidate: Candidate) -> float:
    """Bytes of a tensor sent between stages per byte of the profile's, for profiles without the outputs' bytes on
    a bfloat16 wire (wire_bytes): 0.5 for a bfloat16 wire in fp32; in bf16 the tensors autocast makes, assumed
    bfloat16 (a residual block's float32 output is not: recipes/gpt.py's receive buffers counted twice)."""
    return 0.5 if candidate.wire_dtype == "bfloat16" and candidate.precision == "fp32" else 1.0


def bfloat16_wire(candidate: Candidate) -> bool:
    """Whether stages hand each other bfloat16 (runtime.stage_boundary): always in bf16, in fp32 by wire_dtype."""
    return candidate.precision == "bf16" or candidate.wire_dtype == "bfloat16"


def wire_bytes(nbytes: int, wire_nbytes: int | None, *, candidate: Candidate) -> float:
    """A layer's output as it travels to the next stage: as made (nbytes) on a float32 wire; on a bfloat16 wire
    its floating tensors as bfloat16 (wire_nbytes, profiled: costs.LayerCost.wire_output_bytes), which a float32
    output (fp32, or a bf16 residual stream) is cast to on leaving. Not profiled (None): nbytes x wire_factor."""
    if wire_nbytes is None or not bfloat16_wire(candidate):
        return nbytes * wire_factor(candidate)
    return float(wire_nbytes)


def cast_on_wire(nbytes: int, wire_nbytes: int | None, *, candidate: Candidate) -> bool:
    """Whether a stage's output is cast to go on the wire (float32 leaving on a bfloat16 wire): its gradient comes
    back in bfloat16 and the cast's backward makes it in the output's dtype, so the stage's last layer gets it made
    (as from a later layer) rather than handed in from the receive buffer. recipes/cnn.py in bf16, V-Min: rank 1's
    peak held a 2 MB float32 gradient made so (-15 % where it was taken as handed in)."""
    return bfloat16_wire(candidate) and wire_bytes(nbytes, wire_nbytes, candidate=candidate) < nbytes


def param_dtype_factor(candidate: Candidate) -> float:
    """Bytes of a parameter's compute copy per byte of its float32 master: 0.5 in bf16."""
    return 0.5 if candidate.precision == "bf16" else 1.0


def dp_shards(candidate: Candidate) -> int:
    """What the float32 state (parameters, gradients, optimizer state) is split into per rank: dp when sharded."""
    return candidate.data_parallel_degree if candidate.sharded else 1


def parameter_memory_bytes(
    parameter_bytes: float, optimizer_state_ratio: float, shards: int = 1, *, gradients: bool = True
) -> float:
    """What a stage holds for the whole step: its parameters, their gradients (not with gradients=False:
    gradients_made_in_step) and the optimizer state (optimizer_state_ratio x the parameters; AdamW: 2), float32.
    Sharded over `shards` ranks (dp_shards > 1): the parameter and optimizer-state shards only; the gradients are
    unsharded until the stage's reduce-scatter (unsharded_gradient_bytes) and sharded after it, until the optimizer
    step (gradient_shard_bytes: the runtime sets them to None before each step)."""
    if shards == 1:
        return parameter_bytes * (1 + int(gradients) + optimizer_state_ratio)
    return parameter_bytes * (1 + optimizer_state_ratio) / shards


def gradients_made_in_step(candidate: Candidate) -> bool:
    """Whether a stage's gradients exist only from its first backward of the step on (counted then, not with the
    parameters): torch's zero_grad(set_to_none=True) lets them go after each optimizer step (runtime.RankPipeline.
    step). One replica, unsharded, synchronous only: DistributedDataParallel's buckets (the gradients are views of
    them) stay, sharded stages walk their unsharded gradients apart (unsharded_gradient_bytes), and 2BW's window
    was not measured (counted with the parameters, as before). recipes/gpt.py, GPipe over 2 ranks: the last stage's
    peak, in its first backward's loss, held no gradient (0.73 MB, 1.9 %, counted before)."""
    synchronous = not SCHEDULES[candidate.schedule].asynchronous
    return not candidate.sharded and candidate.data_parallel_degree == 1 and synchronous


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
    """Sharded: what an all-gather holds beside its output (the unit's gathered size, counted with the working
    copy): in bf16 the rank's shard of one FSDP unit (unit_bytes of float32 parameters) cast to bfloat16
    (FSDPParam.all_gather_inputs) and copied into the output; in fp32 nothing, the shard itself is copied in and
    the all-gather's input is a view of its output (fsdp.all_gather_copy_in). 0 replicated."""
    if not candidate.sharded or candidate.precision != "bf16":
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


def arrival_copy_bytes(stage_in: int, wire_in: float, *, candidate: Candidate, first: bool) -> float:
    """What a bf16 stage under autocast makes of a received input beyond what the profile fed its first layer: the
    runtime casts every input arriving on the bfloat16 wire to float32 (runtime.stage_boundary, to restore a
    residual stream's float32), so an input made in bfloat16 (a convolution's or a Linear's output: the wire did
    not halve it) gets a float32 copy, alive through the stage's forward, and the backward a float32 gradient of
    that copy beside the bfloat16 one it sends. recipes/cnn.py in bf16, V-Min, rank 1 at its second stage's
    backward: a 2 MB float32 gradient (_to_copy) at the peak; GPipe, rank 1 in a forward: the 1 MB copy. 0 where
    the input was float32 (the cast restores what the profile saw: stage_in = 2 x wire_in), on the first stage (the
    batch) and sharded (FSDP2 computes on what arrives)."""
    if first or candidate.precision != "bf16" or candidate.sharded:
        return 0.0
    return max(0.0, 4 * wire_in - 2 * stage_in)


def receive_buffer_bytes(wire_in: float, wire_out: float, *, candidate: Candidate, first: bool, last: bool) -> float:
    """What a stage's receive buffers hold for a whole step: one input activation per micro-batch (not on the first
    stage) and one output gradient per micro-batch (not on the last), each as it travels (wire_bytes)."""
    m = candidate.n_microbatches
    return (m * wire_in if not first else 0) + (m * wire_out if not last else 0)


def held_per_microbatch(saved: int, stage_in: int, kept_out: float, *, candidate: Candidate) -> float:
    """Bytes one in-flight micro-batch keeps on a stage between its F and its B: the saved activations (only the
    stage input, with checkpointing), and the stage's output, which torch's stage keeps (fwd_cache) until that
    backward: kept_out, as it travels on (wire_bytes), or on the last stage as the loss gets it."""
    return (stage_in if candidate.activation_checkpointing else saved) + int(kept_out)


def recompute_bytes(saved: int, *, candidate: Candidate, input_saved: int = 0) -> int:
    """What a checkpointed backward rebuilds for the micro-batch it works on: the stage's saved activations but what
    its first layer saves of the stage input (input_saved: the recompute saves the input the checkpoint kept, no
    copy); 0 without checkpointing."""
    return max(0, saved - input_saved) if candidate.activation_checkpointing else 0


def boundary_shared(candidate: Candidate) -> bool:
    """Whether the receive buffer of a stage is the tensor its first layer computes on (no cast on arrival). True in
    fp32 with a float32 wire, and sharded in bf16 (FSDP2 computes on the bfloat16 that arrives); False where the
    runtime casts what arrives on a bfloat16 wire to float32 (runtime.stage_boundary: fp32 with a bfloat16 wire,
    bf16 under autocast). The sending side is shared unless the output is cast to go (cast_on_wire)."""
    if not bfloat16_wire(candidate):
        return True
    return candidate.precision == "bf16" and candidate.sharded


def input_held_elsewhere_bytes(
    stage_in: int, first_layer_saved: int, first_layer_saved_input: int | None, *, candidate: Candidate, first: bool
) -> int:
    """What a stage keeps of its input per in-flight micro-batch that is held already, so not again: the first
    stage's input is a view of the batch (batch_bytes); a later stage's is its receive buffer (receive_buffer_bytes;
    from a stage of the same rank, the previous stage's output, which becomes that buffer) where boundary_shared.
    Kept is the checkpoint's input (checkpointed), or what the stage's first layer saves of it: first_layer_saved_
    input, profiled (a Linear, Conv or LayerNorm saves its input, a ReLU or an add does not; None in profiles
    before it was: on the first stage up to the layer's saved bytes, on a later one nothing). Measured on
    recipes/gpt.py's stages (LayerNorm first): their saved input was the receive buffer's storage, counted twice
    before."""
    if not first and not boundary_shared(candidate):
        return 0
    if candidate.activation_checkpointing:
        return stage_in
    if first_layer_saved_input is None:
        return min(stage_in, first_layer_saved) if first else 0
    return min(stage_in, first_layer_saved_input)


def output_saved_bytes(
    stage_out: int, last_layer_saved_output: int, *, candidate: Candidate, last: bool, cast_out: bool = False
) -> int:
    """What a stage's saved activations hold of its output per in-flight micro-batch (a ReLU saves its output):
    the tensor torch's stage keeps until the backward and sends (held_per_microbatch counts it), so not again.
    Not checkpointed (the checkpoint saves nothing inside), and only where the output kept is the one saved: not
    cast for the wire (cast_out: cast_on_wire; a bfloat16 output on a bfloat16 wire is sent as it is), or on the
    last stage not made float32 for the loss (bf16). recipes/cnn.py in bf16 (its blocks end in a bfloat16 ReLU):
    GPipe's first rank +8.8 % while its kept outputs were counted twice."""
    if candidate.activation_checkpointing:
        return 0
    if not (candidate.precision == "fp32" if last else not cast_out):
        return 0
    return min(stage_out, last_layer_saved_output)


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
    wire_in: float | None = None,
    wire_out: float | None = None,
) -> float:
    """One stage alone at its worst: its parameter memory, receive buffers, `in_flight` micro-batches held, what its
    sends keep, and one checkpointed backward's rebuilt activations (the planner's per-stage cap; the simulator's
    per-rank peak walks the actions instead, and adds the batch and each backward's temporaries). Sharded: its
    float32 parameter and optimizer-state shards, the gathered working copy and the unsharded gradients. `saved`
    includes the autocast weight copies where they count (autocast_copy_bytes). stage_out: on the last stage the
    loss's input. wire_in, wire_out: the input and output as they travel (wire_bytes; None: not profiled)."""
    if wire_in is None:
        wire_in = wire_bytes(stage_in, None, candidate=candidate)
    if wire_out is None:
        wire_out = wire_bytes(stage_out, None, candidate=candidate)
    held = held_per_microbatch(saved, stage_in, stage_out if last else wire_out, candidate=candidate)
    sent = 0.0
    if sends_kept_to_the_end(candidate.schedule):  # outputs of finished micro-batches, gradients sent back
        out, grad = sent_bytes(wire_in, wire_out, first=first, last=last)
        sent = max(0, candidate.n_microbatches - in_flight) * out + candidate.n_microbatches * grad
    return (
        parameter_memory_bytes(parameter_bytes, optimizer_state_ratio, dp_shards(candidate))
        + weight_version_bytes(parameter_bytes, candidate=candidate)
        + working_copy_bytes(parameter_bytes, candidate=candidate)
        + unsharded_gradient_bytes(parameter_bytes, candidate=candidate)
        + in_flight * held
        + sent
        + recompute_bytes(saved, candidate=candidate)
        + receive_buffer_bytes(wire_in, wire_out, candidate=candidate, first=first, last=last)
    )


def sends_kept_to_the_end(schedule: Schedule) -> bool:
    """Whether torch keeps every tensor a rank sends (outputs forward, input gradients back) until the pipeline
    ends: all schedules but 1F1B, which waits for each send before its next (see the module docstring)."""
    return schedule != Schedule.ONE_F_ONE_B


def sent_bytes(wire_in: float, wire_out: float, *, first: bool, last: bool) -> tuple[float, float]:
    """Per micro-batch, what a stage sends, as it travels (wire_bytes): (its output, not on the last stage; the
    gradient of its input, not on the first)."""
    return (0.0 if last else float(wire_out)), (0.0 if first else float(wire_in))


def loss_backward_bytes(output_bytes: int) -> int:
    """What the loss's backward allocates on the last stage: cross-entropy's gradient of its log-probabilities and
    then of the logits, each the size of the model's output (traced: nll_loss_backward, _log_softmax_backward)."""
    return 2 * output_bytes


WeightGradients = Literal["fresh", "kept", "accumulated", "elsewhere"]
"""What becomes of the weight gradients a backward makes: added into .grad and let go of (a stage's later backward
of the step: "fresh"); kept as .grad, counted from then on (its first, gradients_made_in_step: "kept"); kept layer
by layer as the unsharded float32 gradients FSDP2 accumulates, counted by the caller after the backward (a sharded
stage's first: "accumulated"; in bf16 each layer's are made in bfloat16, then copied into float32 once the layer
is done, FSDPParam.to_accumulated_grad_if_needed, both held for a moment); or kept and counted by the caller with
the parameters (its first otherwise, replicated: "elsewhere")."""


def layer_backward_bytes(
    parameter_bytes: Sequence[int], input_bytes: Sequence[int], output_bytes: Sequence[int], *, first: bool,
    last: bool, weights: WeightGradients = "fresh", profiled: Sequence[BackwardBytes | None] | None = None,
    grad_factor: float = 1.0, freed: Sequence[int] | None = None, gathered: Sequence[float] | None = None,
    cast_out: bool = False, arrival_grad: float = 0.0, recomputed_output: float = 0.0,
) -> int:
    """What one backward of a stage allocates on top of what it holds, at its worst layer (the layers of the stage
    in order, their float32 parameter bytes, input and output bytes for one micro-batch): what the layer's backward
    holds at most, with the gradient of its output where a later layer of the stage (or on the last stage the loss)
    made it (the stage's last layer reads it from the receive buffer, or where cast_out, gets it made by the wire
    cast's backward: cast_on_wire), less what the layers after it let go of once done (freed: per layer, its saved
    activations but what outlives the backward). weights: what becomes of the weight gradients it makes
    (WeightGradients). arrival_grad: the first layer's input gradient made again in float32 (arrival_copy_bytes).

    What the layer's backward holds: profiled (costs.BackwardBytes; its fresh weight gradients scaled to
    grad_factor, weight_gradient_factor). Where not profiled (None): its weight gradients and the gradients of its
    input (none for the model's input) and output, without what it allocates inside itself: bench/models/
    gpt2block.py, 1F1B, rank 0's peak in the first backward of its second block held 4.26 MB made by that backward
    (the MLP's hidden gradient, 4 MiB) against the 1.05 MB counted then (-7 % in all). A layer's output gradient
    made inside the stage is let go of once used, before the rest of the layer's backward (a ReLU's backward reads
    it, then GroupNorm's makes its own): recipes/cnn.py's first block holds 2 x its output at most with that
    gradient made inside, where the gradient beside the peak measured with it handed in counts 3 x; and what the
    layers after it saved is gone by then (its second block's 2 MiB, at micro-batch 64).

    recomputed_output: checkpointed, what the last layer saved of the stage's output (a ReLU's), which the recompute
    made again: the layer's first backward op lets go of that copy, so the rest of its backward runs without it,
    and that op holds at least the gradient it makes (the output's size). recipes/cnn.py 1F1B m2 [3, 5]
    checkpointed, rank 0: 9.45 MB measured in its first backward, 10.49 counted with the copy held throughout.

    gathered: a sharded backward that gathers (reshard_after_forward), per layer its working copy: FSDP2 gathers
    each layer's unit as the backward reaches it and keeps it (the stage runs its backwards without resharding),
    and prefetches the one before it, whose all-gather output (a flat tensor, the unit's size; the all-gather's
    input is a view into it: fsdp.all_gather_copy_in) is held while the layer computes. Reaching that unit copies
    the output out into the unit's parameters, two copies for a moment. So a layer's backward holds its own copy,
    the later layers' and the next one's. The caller counts the whole stage's copy after the backward.
    recipes/cnn.py over pp 2 x dp 2, 1F1B, resharding: the last stage's peak came in its first layer's backward,
    every unit gathered, 8.4 % over the two units counted before at the backward's start; recipes/mlp.py, one
    stage over dp 2: 21.9 MB over the static memory measured, 21.9 MB counted this way."""
    worst = 0.0
    gone = 0.0  # what the layers after this one let go of
    made = 0.0  # "kept", "accumulated": the weight gradients the layers after this one made
    n = len(parameter_bytes)
    for i in reversed(range(n)):
        handed = int(i == n - 1 and not last and not cast_out)
        measured = profiled[i] if profiled is not None else None
        in_grad = 0 if first and i == 0 else input_bytes[i]
        arrival = arrival_grad if i == 0 else 0.0
        let_go = freed[i] if freed is not None else 0
        if measured is None:
            grads = {"fresh": parameter_bytes[i] * grad_factor, "kept": parameter_bytes[i],
                     "accumulated": parameter_bytes[i] * grad_factor, "elsewhere": 0}[weights]
            own = grads + in_grad + (0 if handed else output_bytes[i])
        elif weights == "fresh":
            own = measured.later[handed] - parameter_bytes[i] * (1.0 - grad_factor)
        elif weights == "kept":
            own = measured.first[handed]
        elif weights == "accumulated":
            own = measured.first[handed] - parameter_bytes[i] * (1.0 - grad_factor)
        else:
            own = max(0, measured.first[handed] - parameter_bytes[i])
        if i == n - 1 and recomputed_output:
            own = max(own - recomputed_output, min(own, output_bytes[i]))
        if weights == "accumulated" and grad_factor < 1.0:
            # once done: its bfloat16 weight gradients beside their float32 copy, and its input's gradient for the
            # layer before
            worst = max(worst, made + parameter_bytes[i] * (1.0 + grad_factor) + in_grad - gone - let_go)
        copies = 0.0
        if gathered is not None:  # its own copy (twice while the all-gather's output is copied out) and the next
            worst = max(worst, made + 2 * gathered[i] - gone)
            copies = gathered[i] + (gathered[i - 1] if i > 0 else 0.0)
        worst = max(worst, own + arrival + made + copies - gone)
        gone += let_go
        made += parameter_bytes[i] if weights in ("kept", "accumulated") else 0
        made += gathered[i] if gathered is not None else 0
    return int(worst)


def input_backward_bytes(
    profiled: Sequence[BackwardBytes], *, first: bool, last: bool, cast_out: bool = False, arrival_grad: float = 0.0
) -> tuple[int, int]:
    """A split backward's I on a stage (its layers' profiled costs.BackwardBytes, in order): (what it holds at most
    on top, its input's gradient included; what it leaves for its W beside that gradient). It goes through the
    layers in reverse, each leaving the gradients of its weight ops' outputs (and of its output, where the layer
    after it made that gradient and a weight op reads it) and letting go of nothing saved. The first stage's I
    does nothing (its input needs no gradient: its W runs the whole backward). bench/models/gpt2block.py, a block
    at micro-batch 16: 2.5 MiB left for W, measured, where split_kept_bytes counts 3.8 MiB. cast_out, arrival_grad:
    as in layer_backward_bytes."""
    if first:
        return 0, 0
    peak = kept = 0
    n = len(profiled)
    for i in reversed(range(n)):
        handed = int(i == n - 1 and not last and not cast_out)
        peak = max(peak, kept + profiled[i].input_peak[handed] + (int(arrival_grad) if i == 0 else 0))
        kept += profiled[i].input_kept[handed]
    return peak, kept


def first_weight_bytes(parameter_bytes: Sequence[int], kept: Sequence[int]) -> int:
    """What a stage's first split-backward W of the step (torch's stage_backward_weight) holds at most on top of
    what was alive as it started, its weight gradients made as .grad included (gradients_made_in_step): it runs the
    stage's parameter groups in the stage's parameter order (its layers in order, per layer its float32 parameter
    bytes), each making its weight gradients, which stay, and letting go of the output gradients its I kept for it
    (kept: per layer, costs.BackwardBytes.input_kept). So the worst is at a layer: the gradients of the layers before
    it less what they let go of, and its own.

    bench/models/mlp13.py, VHalf m1 [3-5-1-4] at batch 64, rank 1's stage of five 256-wide layers (`python
    bench/memory_breakdown.py bench/models/mlp13.py --candidates "VHalf/m1/[3-5-1-4]" --phase 1W0`): at the W's
    peak, in its last group, four layers' gradients and the fifth's in the making were alive, and four of the five
    kept gradients gone, 857 KB over its start where the whole stage's gradients on top of everything kept counted
    1.32 MB (+6.5 % on the rank's peak). The W also lets go of each weight op's saved input where nothing else
    saved it (three 64 KiB activations there), not counted: the profile does not say which."""
    worst = made = 0
    for nbytes, freed in zip(parameter_bytes, kept):
        worst = max(worst, made + nbytes)
        made += nbytes - freed
    return int(worst)


def split_kept_bytes(saved_bytes: Sequence[int], input_bytes: Sequence[int], *, first: bool) -> int:
    """For profiles without backward bytes (input_backward_bytes measures it), what a split backward's I keeps for
    its W, for one micro-batch, on top of the activations (which the W
    still needs, all but what the loss saved: the I detaches the loss): the gradient of every weight op's output
    (torch's stage_backward_input keeps them in param_groups). Per layer, about what the layer saves beyond its
    input: a Linear + GELU layer saves its input and the Linear's output, and W needs the gradient of the latter.
    Traced on recipes/gpt.py, whose attention keeps more (the q, k and v gradients and their copies): 29.4 MB kept
    against 31.7 MB by this rule on one stage, 22 MB against 15.9 MB on another. 0 on the first stage, whose I does
    nothing (its W runs the whole backward)."""
    if first:
        return 0
    return sum(max(0, saved - into) for saved, into in zip(saved_bytes, input_bytes))


def batch_bytes(input_bytes: int, target_bytes: int = 0, *, candidate: Candidate, first: bool, last: bool) -> int:
    """What of the batch a rank holds for the whole step (runtime.prepare_batch, as a data loader per replica
    would): its micro-batches' inputs where it holds the first stage, their targets where it holds the last, none
    elsewhere (side inputs, which every rank gets, are not profiled). recipes/cnn.py, VMin over 2 ranks: the rank
    holding the middle stages held no image; counting the batch there put it 7.5 % over."""
    return candidate.n_microbatches * ((input_bytes if first else 0) + (target_bytes if last else 0))


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
