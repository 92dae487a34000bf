"""Pure: per-layer costs of a model on one device (forward, input-grad and weight-grad time, saved-activation and
output bytes) at several micro-batch sizes, and their interpolation in the micro-batch size. Torch-free: what the
planner, the simulator and the report read; autotune.profiling measures it."""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from autotune.candidate import PRECISIONS, Precision
from autotune.errors import UsageError

PROFILE_VERSION = 1


@dataclass(frozen=True, kw_only=True)
class BackwardBytes:
    """What one layer's backward holds on top of what was alive before it, for one micro-batch (profiled per size:
    profiling._backward_bytes). Each a pair: (the gradient of the layer's output made inside the backward, counted
    and let go of once used, as a later layer of a stage or the loss makes it; that gradient handed in, held
    throughout and not counted, as torch's stage hands a stage's last layer its receive buffer)."""

    first: tuple[int, int]
    """A whole backward with no .grad yet (a stage's first of the step), at its most: its temporaries (an MLP's
    hidden gradients, attention's) and input and weight gradients (the latter kept), less the saved activations it
    lets go of on the way."""
    later: tuple[int, int]
    """The same with .grad there (a later backward: fresh weight gradients added into it and let go of)."""
    input_peak: tuple[int, int]
    """A split backward's I (torch's stage_backward_input), at its most, its input's gradient included: it lets go
    of no saved activation (its W needs them)."""
    input_kept: tuple[int, int]
    """What that I leaves for its W beside its input's gradient: the gradients of the weight ops' outputs."""

    def map(self, fn: Callable[[int], int]) -> BackwardBytes:
        """Each figure through fn (a tp rank's share)."""
        return BackwardBytes(**{f: (fn(a), fn(b)) for f, (a, b) in self.to_dict().items()})

    def to_dict(self) -> dict[str, tuple[int, int]]:
        return {"first": self.first, "later": self.later, "input_peak": self.input_peak,
                "input_kept": self.input_kept}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> BackwardBytes:
        return cls(**{f: (int(data[f][0]), int(data[f][1])) for f in ("first", "later", "input_peak", "input_kept")})

    @classmethod
    def interpolated(cls, per_size: Sequence[BackwardBytes], at: Callable[[Sequence[float]], float]) -> BackwardBytes:
        """Each figure interpolated over the profile's sizes (at: Profile's _Interpolator)."""
        rows = [b.to_dict() for b in per_size]
        return cls(**{f: (math.ceil(at([r[f][0] for r in rows])), math.ceil(at([r[f][1] for r in rows])))
                      for f in rows[0]})


@dataclass(frozen=True, kw_only=True)
class CheckpointPasses:
    """The layer alone as a checkpointed stage under torch's split backward, its W pass by pass (profiling.
    _checkpoint_weight_bytes): how the stage's W composes from its layers (simulate._composed_weight_recompute_bytes).

    Each of the W's autograd passes (one per parameter group, in the parameters' order) recomputes the stage, and
    what it recomputed stays until a pass walks the node that saved it, or until no parameter group left can reach
    that node (the graph lets go of it); what one pass keeps is what every pass before it keeps too (one tensor per
    saving node alive). A triple per pass that recomputes, over what was alive before the W and less the W's weight
    gradients: (its peak while it recomputes, its peak after, while it walks its nodes; what its recompute keeps
    once the pass is done). `free`: the layer as the last of its stage (nothing after it keeps its graph); `held`: a
    later layer there (its graph all kept, only walked nodes let go)."""

    free: tuple[tuple[int, int, int], ...]
    held: tuple[tuple[int, int, int], ...]
    kept: int
    """`held`: what one pass's recompute keeps of the layer once all of its passes ran (later layers' passes)."""
    let_go: int = 0
    """What the W let go of that was alive before it: the gradients its I kept for it, what the I's recompute kept
    for the W's walks (a later layer's passes run without them)."""
    input_kept: bool = True
    """`held`: whether what the layer saves of its input outlives its passes: no pass walks the node that saved it
    (RMSNorm's pow before its weight), against one that does (LayerNorm's, which its weight's pass walks). True
    where not measured (profiles before it): kept."""

    def map(self, fn: Callable[[int], int]) -> CheckpointPasses:
        """Each figure through fn (a tp rank's share)."""
        return CheckpointPasses(free=tuple((fn(a), fn(b), fn(c)) for a, b, c in self.free),
                                held=tuple((fn(a), fn(b), fn(c)) for a, b, c in self.held), kept=fn(self.kept),
                                let_go=fn(self.let_go), input_kept=self.input_kept)

    def to_dict(self) -> dict[str, Any]:
        return {"free": [list(x) for x in self.free], "held": [list(x) for x in self.held], "kept": self.kept,
                "let_go": self.let_go, "input_kept": self.input_kept}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CheckpointPasses:
        return cls(free=tuple((int(a), int(b), int(c)) for a, b, c in data["free"]),
                   held=tuple((int(a), int(b), int(c)) for a, b, c in data["held"]), kept=int(data["kept"]),
                   let_go=int(data.get("let_go", 0)), input_kept=bool(data.get("input_kept", True)))

    @classmethod
    def interpolated(
        cls, per_size: Sequence[CheckpointPasses], at: Callable[[Sequence[float]], float]
    ) -> CheckpointPasses | None:
        """Each figure interpolated over the profile's sizes; None where the sizes ran different numbers of passes."""
        if len({(len(c.free), len(c.held)) for c in per_size}) != 1:
            return None

        def passes(rows: Sequence[tuple[tuple[int, int, int], ...]]) -> tuple[tuple[int, int, int], ...]:
            return tuple(tuple(math.ceil(at([r[i][k] for r in rows])) for k in range(3))  # type: ignore[misc]
                         for i in range(len(rows[0])))

        return cls(free=passes([c.free for c in per_size]), held=passes([c.held for c in per_size]),
                   kept=math.ceil(at([c.kept for c in per_size])), let_go=math.ceil(at([c.let_go for c in per_size])),
                   input_kept=any(c.input_kept for c in per_size))


@dataclass(frozen=True, kw_only=True)
class LayerCost:
    """One layer's cost for one micro-batch of a given size (what the partitioner and the simulator consume)."""

    forward_ms: float
    """Forward time."""
    backward_input_ms: float
    """Backward time for the gradient w.r.t. the layer's input (zero-bubble "B"/"I")."""
    backward_weight_ms: float
    """Backward time for the gradients w.r.t. the layer's parameters (zero-bubble "W")."""
    saved_bytes: int
    """Activation bytes autograd keeps from the forward until the backward."""
    output_bytes: int
    """Bytes of the layer's output as the layer makes it: what a stage cut after this layer sends (and its
    gradient, back) on a float32 wire."""
    parameter_bytes: int
    """Bytes of the layer's parameters."""
    checkpointed_forward_ms: float | None = None
    """Forward time inside an activation-checkpointed stage (saves nothing, pays the checkpoint's bookkeeping);
    None: forward_ms."""
    recompute_ms: float | None = None
    """What a checkpointed stage's backward adds for this layer: its forward again, plus bookkeeping; None:
    forward_ms."""
    parameter_groups: int = 0
    """Modules holding parameters of their own (see LayerProfile.parameter_groups)."""
    autocast_copy_bytes: int = 0
    """bf16: the bfloat16 copies torch.autocast makes of the layer's parameters in one forward, which that forward's
    graph keeps until its backward (not part of saved_bytes); 0 in fp32."""
    saved_input_bytes: int | None = None
    """Of saved_bytes, the layer's input (a Linear's, a LayerNorm's; not a ReLU's): a stage starting here saves the
    tensor it received, held already. None: not profiled."""
    saved_output_bytes: int = 0
    """Of saved_bytes, the layer's output (a ReLU's): a stage ending here saves the tensor it sends. 0: none, or not
    profiled."""
    checkpoint_weight_bytes: int | None = None
    """The layer alone as a checkpointed stage, torch's split backward: what its W holds at its peak over what was
    alive before it, less the weight gradients it makes (LayerProfile.checkpoint_weight_bytes). None: not
    profiled."""
    checkpoint_passes: CheckpointPasses | None = None
    """The same W pass by pass (CheckpointPasses); None: not profiled."""
    saved_handoff_bytes: int = 0
    """What the layer saves of its input that the layer before saves as its output (one storage inside a stage,
    counted with that layer, not in saved_bytes): a stage starting here on a wire that casts saves a copy of its own
    (memory_model.boundary_shared). 0: none, or not profiled."""
    wire_output_bytes: int | None = None
    """Bytes of the layer's output on a bfloat16 wire (its floating tensors as bfloat16): what a stage cut after
    this layer sends in bf16, or in fp32 with a bfloat16 wire (memory_model.wire_bytes). None: not profiled."""
    backward_bytes: BackwardBytes | None = None
    """What the layer's backward holds on top of what was alive before it; None: not profiled."""
    split_input_extra_ms: float = 0.0
    """What torch's split backward adds to the layer's I (stage_backward_input walks the graph for the W's parameter
    groups); 0: not profiled."""
    split_weight_extra_ms: float = 0.0
    """What it adds to the layer's W (one autograd pass per parameter group, each with its own set-up); 0: not
    profiled."""

    @property
    def backward_ms(self) -> float:
        """A full backward: input grad and weight grad."""
        return self.backward_input_ms + self.backward_weight_ms


@dataclass(frozen=True, kw_only=True)
class LayerProfile:
    """One layer measured at each of the profile's micro-batch sizes (medians over repeats)."""

    name: str
    """Class name of the layer."""
    parameter_bytes: int
    """Bytes of the layer's parameters."""
    forward_ms: tuple[float, ...]
    """Forward time, one entry per Profile.micro_batch_sizes."""
    backward_input_ms: tuple[float, ...]
    """Input-grad backward time, per micro-batch size."""
    backward_weight_ms: tuple[float, ...]
    """Weight-grad backward time (full backward minus input-grad backward, floored at 0), per micro-batch size."""
    saved_bytes: tuple[int, ...]
    """Saved-activation bytes of one micro-batch, per micro-batch size."""
    output_bytes: tuple[int, ...]
    """Output bytes of one micro-batch, per micro-batch size."""
    parameter_groups: int | None = None
    """Modules in the layer that hold parameters of their own: torch's split backward (W) runs one autograd pass per
    such group, and under activation checkpointing each pass recomputes the stage. None: 1 if it has parameters."""
    autocast_copy_bytes: int = 0
    """bf16 profiles: bytes of the bfloat16 copies torch.autocast made of the layer's parameters for one forward
    (matmul and convolution weights; autograd saves them for the backward), kept out of saved_bytes because only
    the autocast runtime (replicate) makes them: a sharded bf16 stage computes on bfloat16 parameters already."""
    saved_input_bytes: tuple[int, ...] = ()
    """Of saved_bytes, the layer's input, per micro-batch size; () in profiles saved before it was recorded."""
    saved_output_bytes: tuple[int, ...] = ()
    """Of saved_bytes, the layer's output, per micro-batch size; () as above."""
    checkpoint_weight_bytes: tuple[int, ...] = ()
    """The layer alone as a checkpointed stage under torch's split backward, per micro-batch size: what its W holds
    at its peak beyond what was alive before it and the weight gradients it makes (each of the W's autograd passes,
    one per parameter group, recomputes the stage and keeps what it does not use until the W ends); () as above."""
    checkpoint_passes: tuple[CheckpointPasses, ...] = ()
    """LayerCost.checkpoint_passes per micro-batch size; () as above."""
    saved_handoff_bytes: tuple[int, ...] = ()
    """LayerCost.saved_handoff_bytes per micro-batch size; () as above (0)."""
    wire_output_bytes: tuple[int, ...] = ()
    """LayerCost.wire_output_bytes per micro-batch size: a bf16 profile's residual block returns float32 (autocast
    adds in the dtype of the residual stream) that travels as bfloat16; () as above."""
    backward_bytes: tuple[BackwardBytes, ...] = ()
    """LayerCost.backward_bytes per micro-batch size; () as above."""
    split_input_extra_ms: tuple[float, ...] = ()
    """LayerCost.split_input_extra_ms per micro-batch size: the layer as a stage, torch's I (stage_backward_input)
    against its share of a whole backward; () as above (0)."""
    split_weight_extra_ms: tuple[float, ...] = ()
    """LayerCost.split_weight_extra_ms per micro-batch size: torch's W (stage_backward_weight) against the weight
    gradients' share; () as above (0)."""


@dataclass(frozen=True, kw_only=True)
class TensorParallelLayer:
    """What the model's tensor-parallel plan does to one layer (autotune.models.tensor_parallel.tp_layer_terms),
    recorded by the profile so the simulator prices tp without the model file (autotune.tp_costs)."""

    sharded_parameter_bytes: int
    """Parameter bytes the plan splits over tp (the column- and row-wise projections, a vocabulary-parallel
    embedding); the rest (norms, anything the plan leaves whole) stays whole on every tp rank."""
    forward_all_reduces: int = 0
    """All-reduces of the layer's output per micro-batch in forward (one per row-wise module or vocabulary-parallel
    embedding)."""
    backward_all_reduces: int = 0
    """All-reduces of an input-sized gradient per micro-batch in backward (one per column-wise module reading a
    replicated input: torch's DTensor makes each projection's input gradient whole by itself)."""
    forward_all_gathers: int = 0
    """All-gathers of the layer's output per micro-batch in forward (a column-wise module whose output is gathered:
    a language model's head)."""

    def to_dict(self) -> dict[str, int]:
        return {"sharded_parameter_bytes": self.sharded_parameter_bytes,
                "forward_all_reduces": self.forward_all_reduces,
                "backward_all_reduces": self.backward_all_reduces,
                "forward_all_gathers": self.forward_all_gathers}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TensorParallelLayer:
        keys = ("sharded_parameter_bytes", "forward_all_reduces", "backward_all_reduces", "forward_all_gathers")
        return cls(**{key: int(data.get(key, 0)) for key in keys})


def shared_copy_bytes(shared: Sequence[tuple[Sequence[int], int]], start: int, stop: int) -> int:
    """Bytes of the shared parameters (layers holding each, its bytes) that layers [start, stop) hold while the
    parameter's first holder is elsewhere: that stage keeps a copy of its own."""
    return sum(
        nbytes for layers, nbytes in shared
        if not start <= min(layers) < stop and any(start <= layer < stop for layer in layers)
    )


def stage_gradient_moves(
    shared: Sequence[tuple[Sequence[int], int]], bounds: Sequence[int], owner: Sequence[int]
) -> list[int]:
    """Per stage: bytes to add to (or, negative, take from) its parameter bytes to get the gradients its first
    backward makes. A rank's one Parameter for a shared parameter gets its gradient from the first of the rank's
    stages to run a backward, the highest of them (backwards run in reverse stage order), not from the stage whose
    layer counts its bytes (V placement: a tied head on the last stage, its embedding on the first)."""
    moves = [0] * (len(bounds) - 1)
    for layers, nbytes in shared:
        holders = [s for s in range(len(moves)) if any(bounds[s] <= layer < bounds[s + 1] for layer in layers)]
        if not holders:
            continue
        counted = holders[0]
        same_rank = [s for s in holders if owner[s] == owner[counted]]
        if same_rank[-1] != counted:
            moves[counted] -= nbytes
            moves[same_rank[-1]] += nbytes
    return moves


def stage_shared_copy_bytes(
    shared: Sequence[tuple[Sequence[int], int]], bounds: Sequence[int], owner: Sequence[int]
) -> list[int]:
    """Per stage (layers bounds[s]:bounds[s + 1], held by rank owner[s]): bytes of the shared parameters it keeps a
    copy of. A rank keeps one Parameter for a shared parameter whichever of its stages hold it (models.shared:
    under V placement the first and last stages, a tied embedding and head, are on one rank): the copy is the first
    of the rank's stages holding it, and none where the rank holds the parameter's first layer (counted there)."""
    n = len(bounds) - 1
    copies = [0] * n
    for layers, nbytes in shared:
        holders = [s for s in range(n) if any(bounds[s] <= layer < bounds[s + 1] for layer in layers)]
        if not holders:
            continue
        seen = {owner[holders[0]]}  # the first holder: its layer's bytes count the parameter
        for s in holders[1:]:
            if owner[s] not in seen:
                seen.add(owner[s])
                copies[s] += nbytes
    return copies


@dataclass(frozen=True, kw_only=True)
class Profile:
    """Per-layer costs of a model on one device at several micro-batch sizes.

    layer_costs(M) interpolates piecewise linearly in M between profiled sizes and extrapolates along the nearest
    segment, so a fixed per-micro-batch cost (the intercept) survives as M shrinks: that is why B/M has an optimum."""

    micro_batch_sizes: tuple[int, ...]
    """Profiled micro-batch sizes, increasing."""
    layers: tuple[LayerProfile, ...]
    """Per layer, in model order."""
    input_bytes: tuple[int, ...]
    """Bytes of the model's input for one micro-batch, per micro-batch size."""
    target_bytes: tuple[int, ...] = ()
    """Bytes of the loss's targets for one micro-batch, per micro-batch size; () in profiles saved before it was
    recorded (0)."""
    loss_forward_ms: tuple[float, ...] = ()
    """loss_fn forward time per micro-batch size (charged to the last layer by layer_costs); () means 0."""
    loss_backward_ms: tuple[float, ...] = ()
    """loss_fn backward time per micro-batch size (charged to the last layer's input-grad time); () means 0."""
    loss_saved_bytes: tuple[int, ...] = ()
    """Bytes loss_fn saves for its backward, per micro-batch size (charged to the last layer); () means 0."""
    loss_input_bytes: tuple[int, ...] = ()
    """Bytes of the last layer's output as loss_fn gets it, per micro-batch size: float32 in bf16 (the last stage
    keeps that copy); () in profiles saved before it was recorded (the output's bytes)."""
    loss_backward_bytes: tuple[int, ...] = ()
    """The peak loss_fn's backward holds over what was alive before it (its input and what it saved), per
    micro-batch size; () in profiles saved before it was recorded (memory_model.loss_backward_bytes)."""
    checkpoint_forward_ratio: tuple[float, ...] = ()
    """Per micro-batch size: the model's forward checkpointed as one unit (as a stage is) over its plain forward;
    () means 1."""
    checkpoint_recompute_ratio: tuple[float, ...] = ()
    """Per micro-batch size: what checkpointing adds to the backward, over the plain forward (1 would be exactly
    one forward again); () means 1."""
    optimizer_step_ms: float = 0.0
    """The optimizer steps of every block summed (each block is stepped on its own); the simulator charges each
    rank optimizer_call_ms once and the rest by parameter bytes (optimizer_ms)."""
    optimizer_state_bytes: int | None = None
    """Optimizer state of the whole model after a step; None: assume AdamW (2 x parameter bytes)."""
    optimizer_peak_bytes: int | None = None
    """Most bytes one optimizer step over the whole model allocates on top of what it keeps (temporaries); the
    simulator charges each rank its share by parameter bytes. None: not measured (0)."""
    device: str = "cpu"
    """Where it was measured: cpu (one thread) or cuda."""
    model: str = ""
    """Path of the model file."""
    batch_size: int | None = None
    """The global batch size the sizes were chosen for."""
    repeats: int = 0
    """Timed repeats per size (medians are kept)."""
    torch_version: str = ""
    """torch.__version__ when measured."""
    shared_parameters: tuple[tuple[tuple[int, ...], int], ...] = ()
    """Parameters held by several layers (tied embeddings): (the layers holding it, its bytes). A layer's
    parameter_bytes count it in the first holder only; a stage holding a later holder but not the first keeps a
    copy of its own (shared_copy_bytes)."""
    infeasible_micro_batch_sizes: tuple[int, ...] = ()
    """Sizes the profiler was asked for that ran out of device memory (or past --memory-limit) for a block on its
    own, increasing: no candidate can use them or anything larger. Not in micro_batch_sizes."""
    too_small_micro_batch_sizes: tuple[int, ...] = ()
    """Sizes the profiler was asked for at which a block's training step failed, for another reason than memory,
    while larger sizes ran (BatchNorm needs more than one value per channel: a batch of 1 reaching a 1 x 1 feature
    map), increasing: no candidate can use them or anything smaller. Not in micro_batch_sizes."""
    precision: Precision = "fp32"
    """What it was measured in (Precision): times, saved-activation and output bytes are bf16's in a bf16 profile.
    parameter_bytes stay the float32 master weights' either way. Profiles saved before it was recorded: fp32."""
    device_workspace_bytes: int = 0
    """What a rank's allocator holds for its libraries once it has run a forward and a backward, whatever the model:
    cuBLAS's workspaces (one per thread and stream: the forward's and autograd's backward thread; 2 x 32 MiB on an
    H100/H200). Measured by the profiler on CUDA as what stays allocated after every block is released; 0 on CPU
    and in profiles saved before it was recorded. The simulator adds it to every rank's peak."""
    optimizer_call_ms: float = 0.0
    """What one optimizer step costs whatever it updates: a step over a one-element parameter, measured by the
    profiler. On CUDA a foreach/fused step launches the same kernels for one tensor as for a block's, so a rank's
    one step over its stages pays it once where the per-block steps summed in optimizer_step_ms paid it per block.
    0 in profiles saved before it was recorded."""
    host_call_ms: float = 0.0
    """How fast this host runs Python and torch's dispatch: the median of HOST_CALL_REPEATS steps of a plain
    torch.optim.AdamW over a one-element parameter (whatever the model's own optimizer), measured by the CPU
    profiler at several moments of the profile and the lowest kept (profiling.HostProbe; one probe at its end in
    profiles taken before 2026-12-07 16:00). The simulator scales the CPU stand-in's per-action overhead by it
    (LinkModel.for_profile). 0 on CUDA and in profiles saved before it was recorded (the defaults as measured)."""
    idle_resume_ms: tuple[tuple[float, float], ...] = ()
    """How much longer torch's compute takes on this host right after its thread slept: (gap ms, extra ms) for a
    small MLP's forward and backward of idle_resume_window_ms, the gaps rising (profiling.idle_resume_probe). The
    simulator charges a rank's action what its gap before it costs (LinkModel.idle_resume_ms). () on CUDA and in
    profiles saved before it was recorded (no such charge)."""
    idle_resume_window_ms: float = 0.0
    """The idle probe's workload back to back (idle_resume_ms): an action shorter than it pays its share."""
    tensor_parallel_layers: tuple[TensorParallelLayer, ...] = ()
    """Per layer, what the model's tensor-parallel plan shards and which collectives it adds (measured at tp 1, the
    profile itself knows nothing of tp); () for a model without a plan, or a profile saved before it was recorded:
    the simulator then assumes a transformer's pattern by position (autotune.tp_costs)."""

    def __post_init__(self) -> None:
        if self.precision not in PRECISIONS:
            raise UsageError(f"profile precision {self.precision!r} is not one of fp32, bf16; profile the model again")
        sizes = self.micro_batch_sizes
        if not sizes or list(sizes) != sorted(set(sizes)) or sizes[0] < 1:
            raise UsageError(f"profile micro-batch sizes must be distinct, increasing and >= 1, got {list(sizes)}")
        if not self.layers:
            raise UsageError("a profile needs at least one layer")
        per_size = [self.input_bytes, *(getattr(layer, f) for layer in self.layers for f in _SERIES)]
        per_size += [getattr(layer, f) for layer in self.layers for f in (*_MEMORY_SERIES, *_SPLIT_SERIES)
                     if getattr(layer, f)]
        per_size += [layer.backward_bytes for layer in self.layers if layer.backward_bytes]
        per_size += [layer.checkpoint_passes for layer in self.layers if layer.checkpoint_passes]
        per_size += [
            s
            for s in (self.target_bytes, self.loss_forward_ms, self.loss_backward_ms, self.loss_saved_bytes,
                      self.loss_input_bytes, self.loss_backward_bytes, self.checkpoint_forward_ratio,
                      self.checkpoint_recompute_ratio)
            if s
        ]
        if any(len(series) != len(sizes) for series in per_size):
            raise UsageError(f"every per-size series of a profile needs {len(sizes)} entries, one per micro-batch size")
        if set(self.infeasible_micro_batch_sizes) & set(sizes):
            raise UsageError("a micro-batch size cannot be both profiled and infeasible")
        if self.too_small_micro_batch_sizes and self.too_small_micro_batch_sizes[-1] >= sizes[0]:
            raise UsageError("a micro-batch size that failed as too small must be below every profiled size")
        if self.tensor_parallel_layers and len(self.tensor_parallel_layers) != len(self.layers):
            raise UsageError(f"a profile's tensor-parallel terms need one entry per layer ({len(self.layers)}), got "
                             f"{len(self.tensor_parallel_layers)}; profile the model again")

    def fits_micro_batch(self, micro_batch_size: float) -> bool:
        """False when the profiler found micro-batches this large run out of memory on one block, or this small fail
        to train (too_small_micro_batch_sizes)."""
        if self.too_small_micro_batch_sizes and micro_batch_size <= self.too_small_micro_batch_sizes[-1]:
            return False
        return not self.infeasible_micro_batch_sizes or micro_batch_size < self.infeasible_micro_batch_sizes[0]

    @property
    def n_layers(self) -> int:
        return len(self.layers)

    def shared_copy_bytes(self, start: int, stop: int) -> int:
        """Bytes of the copies of shared parameters that layers [start, stop) hold without their first holder."""
        return shared_copy_bytes(self.shared_parameters, start, stop)

    @property
    def parameter_bytes(self) -> int:
        """Parameter bytes of the whole model."""
        return sum(layer.parameter_bytes for layer in self.layers)

    @property
    def optimizer_peak_ratio(self) -> float:
        """Optimizer-step temporaries per parameter byte (0 when not measured)."""
        if not self.optimizer_peak_bytes or self.parameter_bytes == 0:
            return 0.0
        return self.optimizer_peak_bytes / self.parameter_bytes

    @property
    def optimizer_state_ratio(self) -> float:
        """Optimizer state bytes per parameter byte (AdamW: 2)."""
        if self.optimizer_state_bytes is None or self.parameter_bytes == 0:
            return 2.0
        return self.optimizer_state_bytes / self.parameter_bytes

    def layer_costs(self, micro_batch_size: float) -> list[LayerCost]:
        """Each layer's cost at micro-batch size M; the loss is charged to the last layer (the last stage runs it)."""
        at = _Interpolator(self.micro_batch_sizes, micro_batch_size)
        forward_ratio = at(self.checkpoint_forward_ratio) if self.checkpoint_forward_ratio else 1.0
        recompute_ratio = at(self.checkpoint_recompute_ratio) if self.checkpoint_recompute_ratio else 1.0
        costs = []
        for i, layer in enumerate(self.layers):
            last = i == len(self.layers) - 1
            own_forward = at(layer.forward_ms)
            loss_forward = at(self.loss_forward_ms) if last and self.loss_forward_ms else 0.0
            forward = own_forward + loss_forward
            backward_input = at(layer.backward_input_ms) + (
                at(self.loss_backward_ms) if last and self.loss_backward_ms else 0.0
            )
            saved = at(layer.saved_bytes) + (at(self.loss_saved_bytes) if last and self.loss_saved_bytes else 0.0)
            costs.append(
                LayerCost(
                    forward_ms=forward,
                    backward_input_ms=backward_input,
                    backward_weight_ms=at(layer.backward_weight_ms),
                    saved_bytes=math.ceil(saved),
                    output_bytes=math.ceil(at(layer.output_bytes)),
                    parameter_bytes=layer.parameter_bytes,
                    checkpointed_forward_ms=own_forward * forward_ratio + loss_forward,  # the loss is outside
                    recompute_ms=own_forward * recompute_ratio,
                    parameter_groups=(
                        int(layer.parameter_bytes > 0) if layer.parameter_groups is None else layer.parameter_groups
                    ),
                    autocast_copy_bytes=layer.autocast_copy_bytes,
                    saved_input_bytes=math.ceil(at(layer.saved_input_bytes)) if layer.saved_input_bytes else None,
                    saved_output_bytes=math.ceil(at(layer.saved_output_bytes)) if layer.saved_output_bytes else 0,
                    checkpoint_weight_bytes=(math.ceil(at(layer.checkpoint_weight_bytes))
                                             if layer.checkpoint_weight_bytes else None),
                    wire_output_bytes=math.ceil(at(layer.wire_output_bytes)) if layer.wire_output_bytes else None,
                    saved_handoff_bytes=(math.ceil(at(layer.saved_handoff_bytes)) if layer.saved_handoff_bytes
                                         else 0),
                    backward_bytes=(BackwardBytes.interpolated(layer.backward_bytes, at) if layer.backward_bytes
                                    else None),
                    checkpoint_passes=(CheckpointPasses.interpolated(layer.checkpoint_passes, at)
                                       if layer.checkpoint_passes else None),
                    split_input_extra_ms=max(0.0, at(layer.split_input_extra_ms)) if layer.split_input_extra_ms
                    else 0.0,
                    split_weight_extra_ms=max(0.0, at(layer.split_weight_extra_ms)) if layer.split_weight_extra_ms
                    else 0.0,
                )
            )
        return costs

    def loss_saved_bytes_at(self, micro_batch_size: float) -> int:
        """Bytes loss_fn saves for its backward for one micro-batch of size M (0 when not profiled); layer_costs
        charges them to the last layer's saved_bytes."""
        if not self.loss_saved_bytes:
            return 0
        return math.ceil(_Interpolator(self.micro_batch_sizes, micro_batch_size)(self.loss_saved_bytes))

    def loss_input_bytes_at(self, micro_batch_size: float) -> int | None:
        """Bytes of the last layer's output as loss_fn gets it for one micro-batch of size M (None when not
        profiled: the output's bytes)."""
        if not self.loss_input_bytes:
            return None
        return math.ceil(_Interpolator(self.micro_batch_sizes, micro_batch_size)(self.loss_input_bytes))

    def loss_backward_bytes_at(self, micro_batch_size: float) -> int | None:
        """The peak loss_fn's backward holds for one micro-batch of size M (None when not profiled)."""
        if not self.loss_backward_bytes:
            return None
        return math.ceil(_Interpolator(self.micro_batch_sizes, micro_batch_size)(self.loss_backward_bytes))

    def loss_forward_ms_at(self, micro_batch_size: float) -> float:
        """loss_fn's forward time for one micro-batch of size M (0 when not profiled), part of the last layer's
        forward_ms in layer_costs."""
        if not self.loss_forward_ms:
            return 0.0
        return _Interpolator(self.micro_batch_sizes, micro_batch_size)(self.loss_forward_ms)

    def loss_backward_ms_at(self, micro_batch_size: float) -> float:
        """loss_fn's backward time for one micro-batch of size M (0 when not profiled), part of the last layer's
        backward_input_ms in layer_costs."""
        if not self.loss_backward_ms:
            return 0.0
        return _Interpolator(self.micro_batch_sizes, micro_batch_size)(self.loss_backward_ms)

    def target_bytes_at(self, micro_batch_size: float) -> int:
        """Bytes of the loss's targets for one micro-batch of size M (0 when not profiled)."""
        if not self.target_bytes:
            return 0
        return math.ceil(_Interpolator(self.micro_batch_sizes, micro_batch_size)(self.target_bytes))

    def input_bytes_at(self, micro_batch_size: float) -> int:
        """Bytes of the model's input for one micro-batch of size M."""
        return math.ceil(_Interpolator(self.micro_batch_sizes, micro_batch_size)(self.input_bytes))

    @classmethod
    def from_layer_costs(
        cls,
        costs: Sequence[LayerCost],
        *,
        micro_batch_size: int = 1,
        input_bytes: int = 0,
        names: Sequence[str] | None = None,
        optimizer_step_ms: float = 0.0,
        device: str = "cpu",
        precision: Precision = "fp32",
    ) -> Profile:
        """A one-size profile from given costs (tests, benchmarks, what-if studies): other sizes scale in
        proportion, as one size says nothing about a fixed per-micro-batch cost. precision: what the costs are of."""
        return cls(
            micro_batch_sizes=(micro_batch_size,),
            layers=tuple(
                LayerProfile(
                    name=names[i] if names else f"layer{i}",
                    parameter_bytes=c.parameter_bytes,
                    forward_ms=(c.forward_ms,),
                    backward_input_ms=(c.backward_input_ms,),
                    backward_weight_ms=(c.backward_weight_ms,),
                    saved_bytes=(c.saved_bytes,),
                    output_bytes=(c.output_bytes,),
                    parameter_groups=c.parameter_groups or None,
                    autocast_copy_bytes=c.autocast_copy_bytes,
                    saved_input_bytes=() if c.saved_input_bytes is None else (c.saved_input_bytes,),
                    saved_output_bytes=(c.saved_output_bytes,) if c.saved_output_bytes else (),
                    wire_output_bytes=() if c.wire_output_bytes is None else (c.wire_output_bytes,),
                    saved_handoff_bytes=(c.saved_handoff_bytes,) if c.saved_handoff_bytes else (),
                    backward_bytes=() if c.backward_bytes is None else (c.backward_bytes,),
                    checkpoint_passes=() if c.checkpoint_passes is None else (c.checkpoint_passes,),
                    split_input_extra_ms=(c.split_input_extra_ms,) if c.split_input_extra_ms else (),
                    split_weight_extra_ms=(c.split_weight_extra_ms,) if c.split_weight_extra_ms else (),
                )
                for i, c in enumerate(costs)
            ),
            input_bytes=(input_bytes,),
            optimizer_step_ms=optimizer_step_ms,
            device=device,
            precision=precision,
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "version": PROFILE_VERSION,
            "model": self.model,
            "device": self.device,
            "precision": self.precision,
            "batch_size": self.batch_size,
            "repeats": self.repeats,
            "torch_version": self.torch_version,
            "micro_batch_sizes": list(self.micro_batch_sizes),
            "input_bytes": list(self.input_bytes),
            **({"target_bytes": list(self.target_bytes)} if self.target_bytes else {}),
            "loss_forward_ms": list(self.loss_forward_ms),
            "loss_backward_ms": list(self.loss_backward_ms),
            "loss_saved_bytes": list(self.loss_saved_bytes),
            **({"loss_input_bytes": list(self.loss_input_bytes)} if self.loss_input_bytes else {}),
            **({"loss_backward_bytes": list(self.loss_backward_bytes)} if self.loss_backward_bytes else {}),
            "checkpoint_forward_ratio": list(self.checkpoint_forward_ratio),
            "checkpoint_recompute_ratio": list(self.checkpoint_recompute_ratio),
            "optimizer_step_ms": self.optimizer_step_ms,
            "optimizer_state_bytes": self.optimizer_state_bytes,
            "optimizer_peak_bytes": self.optimizer_peak_bytes,
            "parameter_bytes": self.parameter_bytes,
            "shared_parameters": [
                {"layers": list(layers), "bytes": nbytes} for layers, nbytes in self.shared_parameters
            ],
            "infeasible_micro_batch_sizes": list(self.infeasible_micro_batch_sizes),
            "too_small_micro_batch_sizes": list(self.too_small_micro_batch_sizes),
            **({"device_workspace_bytes": self.device_workspace_bytes} if self.device_workspace_bytes else {}),
            **({"optimizer_call_ms": self.optimizer_call_ms} if self.optimizer_call_ms else {}),
            **({"host_call_ms": self.host_call_ms} if self.host_call_ms else {}),
            **({"idle_resume_ms": [list(p) for p in self.idle_resume_ms],
                "idle_resume_window_ms": self.idle_resume_window_ms} if self.idle_resume_ms else {}),
            **({"tensor_parallel_layers": [t.to_dict() for t in self.tensor_parallel_layers]}
               if self.tensor_parallel_layers else {}),
            "layers": [
                {"name": layer.name, "parameter_bytes": layer.parameter_bytes,
                 "parameter_groups": layer.parameter_groups,
                 **({"autocast_copy_bytes": layer.autocast_copy_bytes} if layer.autocast_copy_bytes else {}),
                 **{field: list(getattr(layer, field)) for field in _SERIES},
                 **{field: list(getattr(layer, field)) for field in (*_MEMORY_SERIES, *_SPLIT_SERIES)
                    if getattr(layer, field)},
                 **({"backward_bytes": [b.to_dict() for b in layer.backward_bytes]} if layer.backward_bytes else {}),
                 **({"checkpoint_passes": [c.to_dict() for c in layer.checkpoint_passes]}
                    if layer.checkpoint_passes else {})}
                for layer in self.layers
            ],
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Profile:
        version = data.get("version", PROFILE_VERSION)
        if version != PROFILE_VERSION:
            raise UsageError(f"profile version {version} is not supported (this autotune reads {PROFILE_VERSION}); "
                             f"profile the model again")
        try:
            return cls(
                micro_batch_sizes=tuple(int(m) for m in data["micro_batch_sizes"]),
                layers=tuple(
                    LayerProfile(
                        name=str(layer["name"]),
                        parameter_bytes=int(layer["parameter_bytes"]),
                        forward_ms=tuple(float(x) for x in layer["forward_ms"]),
                        backward_input_ms=tuple(float(x) for x in layer["backward_input_ms"]),
                        backward_weight_ms=tuple(float(x) for x in layer["backward_weight_ms"]),
                        saved_bytes=tuple(int(x) for x in layer["saved_bytes"]),
                        output_bytes=tuple(int(x) for x in layer["output_bytes"]),
                        parameter_groups=(
                            None if layer.get("parameter_groups") is None else int(layer["parameter_groups"])
                        ),
                        autocast_copy_bytes=int(layer.get("autocast_copy_bytes", 0)),
                        **{field: tuple(int(x) for x in layer.get(field, ())) for field in _MEMORY_SERIES},
                        **{field: tuple(float(x) for x in layer.get(field, ())) for field in _SPLIT_SERIES},
                        backward_bytes=tuple(BackwardBytes.from_dict(b) for b in layer.get("backward_bytes", ())),
                        checkpoint_passes=tuple(CheckpointPasses.from_dict(c)
                                                for c in layer.get("checkpoint_passes", ())),
                    )
                    for layer in data["layers"]
                ),
                input_bytes=tuple(int(x) for x in data["input_bytes"]),
                target_bytes=tuple(int(x) for x in data.get("target_bytes", ())),
                shared_parameters=tuple(
                    (tuple(int(i) for i in p["layers"]), int(p["bytes"])) for p in data.get("shared_parameters", ())
                ),
                loss_forward_ms=tuple(float(x) for x in data.get("loss_forward_ms", ())),
                loss_backward_ms=tuple(float(x) for x in data.get("loss_backward_ms", ())),
                loss_saved_bytes=tuple(int(x) for x in data.get("loss_saved_bytes", ())),
                loss_input_bytes=tuple(int(x) for x in data.get("loss_input_bytes", ())),
                loss_backward_bytes=tuple(int(x) for x in data.get("loss_backward_bytes", ())),
                checkpoint_forward_ratio=tuple(float(x) for x in data.get("checkpoint_forward_ratio", ())),
                checkpoint_recompute_ratio=tuple(float(x) for x in data.get("checkpoint_recompute_ratio", ())),
                optimizer_step_ms=float(data.get("optimizer_step_ms", 0.0)),
                optimizer_state_bytes=(
                    None if data.get("optimizer_state_bytes") is None else int(data["optimizer_state_bytes"])
                ),
                optimizer_peak_bytes=(
                    None if data.get("optimizer_peak_bytes") is None else int(data["optimizer_peak_bytes"])
                ),
                device=str(data.get("device", "cpu")),
                precision=data.get("precision", "fp32"),  # saved before precision was recorded: fp32
                model=str(data.get("model", "")),
                batch_size=None if data.get("batch_size") is None else int(data["batch_size"]),
                repeats=int(data.get("repeats", 0)),
                torch_version=str(data.get("torch_version", "")),
                infeasible_micro_batch_sizes=tuple(int(m) for m in data.get("infeasible_micro_batch_sizes", ())),
                too_small_micro_batch_sizes=tuple(int(m) for m in data.get("too_small_micro_batch_sizes", ())),
                device_workspace_bytes=int(data.get("device_workspace_bytes", 0)),
                optimizer_call_ms=float(data.get("optimizer_call_ms", 0.0)),
                host_call_ms=float(data.get("host_call_ms", 0.0)),
                idle_resume_ms=tuple((float(g), float(ms)) for g, ms in data.get("idle_resume_ms", ())),
                idle_resume_window_ms=float(data.get("idle_resume_window_ms", 0.0)),
                tensor_parallel_layers=tuple(
                    TensorParallelLayer.from_dict(t) for t in data.get("tensor_parallel_layers", ())
                ),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise UsageError(f"cannot read profile: {type(exc).__name__}: {exc}; profile the model again") from exc


def load_profile(path: Path) -> Profile:
    """A profile saved by `autotune profile --output` (JSON); any problem is one UsageError naming the fix."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise UsageError(f"no profile at {path}; write one with `autotune profile MODEL --output {path}`") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UsageError(f"cannot read profile {path}: {exc}; write it again with `autotune profile --output`") \
            from None
    if not isinstance(data, dict):
        raise UsageError(f"{path} is not a profile (a JSON object); write one with `autotune profile --output`")
    return Profile.from_dict(data)


_SERIES = ("forward_ms", "backward_input_ms", "backward_weight_ms", "saved_bytes", "output_bytes")
_MEMORY_SERIES = ("saved_input_bytes", "saved_output_bytes", "checkpoint_weight_bytes", "wire_output_bytes",
                  "saved_handoff_bytes")
"""Per-size series a profile may lack (saved before they were recorded): () there (and so backward_bytes)."""
_SPLIT_SERIES = ("split_input_extra_ms", "split_weight_extra_ms")
"""Per-size times a profile may lack (saved before they were recorded: 0)."""


class _Interpolator:
    """Piecewise-linear in M through the profiled points; beyond them, the nearest segment continued.

    Below the smallest size the value never drops under plain proportional scaling (v_min * M / M_min), above the
    largest never under v_max: measurement noise must not make a cost negative or shrink with M."""

    def __init__(self, sizes: Sequence[int], m: float) -> None:
        if m <= 0:
            raise UsageError(f"micro-batch size must be positive, got {m}")
        self.sizes, self.m = sizes, m

    def __call__(self, values: Sequence[float]) -> float:
        sizes, m = self.sizes, self.m
        if len(sizes) == 1:
            return float(values[0]) * m / sizes[0]
        if m <= sizes[0]:
            i = 0
        elif m >= sizes[-1]:
            i = len(sizes) - 2
        else:
            i = next(k for k in range(len(sizes) - 1) if sizes[k] <= m <= sizes[k + 1])
        x0, x1, y0, y1 = sizes[i], sizes[i + 1], float(values[i]), float(values[i + 1])
        value = y0 + (y1 - y0) * (m - x0) / (x1 - x0)
        if m < sizes[0]:
            return max(value, float(values[0]) * m / sizes[0])
        if m > sizes[-1]:
            return max(value, float(values[-1]))
        return value
