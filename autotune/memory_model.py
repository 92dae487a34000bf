"""Pure: what one pipeline rank holds in memory, rule by rule. The simulator walks a rank's actions with these rules
(autotune.simulate) and the planner's memory-aware split caps one stage with them (stage_memory_bytes), so both
count the same bytes.

    parameters, their gradients, optimizer state   parameter_bytes x (2 + optimizer_state_ratio)   always
    receive buffers                                 n_microbatches x (stage input + output grad)     always
    per in-flight micro-batch                       saved activations (checkpointed: the stage input)
                                                    + the stage output torch keeps until the backward
    checkpointed backward                           the stage's saved activations, rebuilt for one micro-batch
"""

from __future__ import annotations

from autotune.candidate import Candidate


def wire_factor(candidate: Candidate) -> float:
    """Bytes of a tensor sent between stages per byte of its float32 original: 0.5 for a bfloat16 wire."""
    return 0.5 if candidate.wire_dtype == "bfloat16" else 1.0


def parameter_memory_bytes(parameter_bytes: float, optimizer_state_ratio: float) -> float:
    """Parameters, their gradients and the optimizer state (optimizer_state_ratio x the parameters; AdamW: 2)."""
    return parameter_bytes * (2 + optimizer_state_ratio)


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
    """One stage alone at its worst: its parameter memory, receive buffers, `in_flight` micro-batches held and one
    checkpointed backward's rebuilt activations (the planner's per-stage cap; the simulator's per-rank peak walks the
    actions instead)."""
    held = held_per_microbatch(saved, stage_in, stage_out, candidate=candidate, last=last)
    return (
        parameter_memory_bytes(parameter_bytes, optimizer_state_ratio)
        + in_flight * held
        + recompute_bytes(saved, candidate=candidate)
        + receive_buffer_bytes(stage_in, stage_out, candidate=candidate, first=first, last=last)
    )
