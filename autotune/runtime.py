"""Build this rank's pipeline stages and schedule from a candidate or tuned config: used by trials and by your own
training script.

    import torch.distributed as dist
    from autotune.runtime import setup_pipeline

    pipe = setup_pipeline("tuned.yaml", "model.py")      # under torchrun: reads RANK / WORLD_SIZE
    for inputs, targets in batches:                       # the same global batch on every rank
        losses = pipe.step(inputs, targets)               # forward, backward, DP all-reduce, optimizer step

or, with a data loader per replica (its replica_batch_size rows), keeping only what this rank consumes:

        losses = pipe.step(pipe.prepare_batch(inputs, targets, replica_rows=True))
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining import schedules as torch_schedules
from torch.utils.checkpoint import checkpoint

from autotune import compat, sharding
from autotune.candidate import Candidate, WireDtype, stage_bounds
from autotune.errors import InvalidCandidateError
from autotune.model_file import (
    SEED,
    ModelSpec,
    build_blocks,
    build_optimizer,
    build_skeleton,
    input_tensors,
    load_model_file,
    map_inputs,
)
from autotune.models import shared_groups, shared_parameter_ranks
from autotune.models.handoff import handoff
from autotune.models.materialize import release
from autotune.models.tensor_parallel import AppliedTP, apply_tp, plan_for_degree, reduce_partial_gradients
from autotune.process_groups import (  # RankLayout, init_groups: part of this module's interface
    RankLayout,
    device_mesh,
    dp_mesh,
    init_groups,
    new_group,
)
from autotune.schedules import (
    SCHEDULES,
    TIED_ASYNC,
    action_lists,
    one_f_one_b,
    stages_of_rank,
    validate_schedule,
)
from autotune.sharding import local_tensor
from autotune.weight_versions import WeightVersions

if TYPE_CHECKING:
    from autotune.tuned_config import TunedConfig

LoadState = Callable[[list[str]], Mapping[str, torch.Tensor]]
"""names (as in model.state_dict()) -> {name: tensor}: real weights for what a rank holds."""


class CheckpointedStage(nn.Module):
    """Recompute the stage's forward during its backward instead of keeping its activations."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, *args: torch.Tensor, **side: Any) -> Any:
        return checkpoint(self.inner, *args, use_reentrant=False, **side)


class _ContiguousGrad(torch.autograd.Function):
    """Identity forward; makes the gradient contiguous on its way back (it is sent to the previous stage)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


class StageBoundary(nn.Module):
    """What crosses between stages: gloo and NCCL send only contiguous tensors, and torch's stages send outputs and
    input gradients as the model made them (a transpose in a ViT's patch embedding is enough to break a run). So
    outputs and input gradients are made contiguous here, and with `wire_dtype` floating outputs travel in that
    dtype (and so their gradients); with `input_dtype` floating inputs are cast to it on arrival (float32 when a
    float32 stage gets a bfloat16 wire).

    Precision: with `autocast` the stage's forward runs under torch.autocast to that dtype (bf16 over float32
    weights, the unsharded runs); with `float_output` the last stage's floating outputs reach the loss as float32
    (as torchtitan casts its logits .float()). The last stage's output never goes on a wire."""

    def __init__(
        self,
        inner: nn.Module,
        *,
        wire_dtype: torch.dtype | None,
        last: bool,
        input_dtype: torch.dtype | None = None,
        autocast: torch.dtype | None = None,
        float_output: bool = False,
        device_type: str = "cpu",
    ) -> None:
        super().__init__()
        self.inner = inner
        self.wire_dtype = wire_dtype
        self.last = last
        self.input_dtype = input_dtype
        self.autocast = autocast
        self.float_output = float_output
        self.device_type = device_type

    def forward(self, *args: torch.Tensor, **side: Any) -> Any:
        args = tuple(self._arrive(a) for a in args)
        if self.autocast is not None:
            with torch.autocast(self.device_type, dtype=self.autocast):
                out = self.inner(*args, **side)
        else:
            out = self.inner(*args, **side)
        if self.last:
            return loss_input(out) if self.float_output else out
        if isinstance(out, tuple):
            return handoff(tuple(self._leave(t) for t in out), args)
        return handoff(self._leave(out), args) if isinstance(out, torch.Tensor) else out

    def _leave(self, x: Any) -> Any:
        if not isinstance(x, torch.Tensor):
            return x
        if self.wire_dtype is not None and x.is_floating_point():
            x = x.to(self.wire_dtype)
        return x.contiguous()

    def _arrive(self, x: torch.Tensor) -> torch.Tensor:
        if not x.is_floating_point():
            return x  # token ids
        if self.input_dtype is not None:
            x = x.to(self.input_dtype)
        return _ContiguousGrad.apply(x) if x.requires_grad else x


def loss_input(out: Any) -> Any:
    """The last stage's floating output(s) as float32, for the loss (bf16: the stage keeps this copy until its
    backward; the profile measures the loss on it, profiling._loss_bytes)."""
    if isinstance(out, torch.Tensor):
        return out.float() if out.is_floating_point() else out
    if isinstance(out, tuple):
        return tuple(loss_input(t) for t in out)
    return out


def stage_boundary(inner: nn.Module, candidate: Candidate, stage: int, device: torch.device) -> StageBoundary:
    """The StageBoundary of a candidate's stage. bf16 precision: bfloat16 activations, so a bfloat16 wire whatever
    wire_dtype says (its float32 would only widen what the stage computed in bfloat16), autocast unless FSDP2's
    mixed precision casts the parameters (sharded); the loss gets float32. fp32 precision: the wire is wire_dtype,
    and a bfloat16 wire's inputs are cast back to float32 on arrival."""
    bf16 = candidate.precision == "bf16"
    wire = torch.bfloat16 if bf16 or candidate.wire_dtype == "bfloat16" else None
    return StageBoundary(
        inner,
        wire_dtype=wire,
        last=stage == candidate.n_stages - 1,
        # FSDP2's units cast their floating inputs to bfloat16 themselves; autocast keeps float32 between ops
        input_dtype=torch.float32 if wire is not None and not (bf16 and candidate.sharded) else None,
        autocast=torch.bfloat16 if bf16 and not candidate.sharded else None,
        float_output=bf16,
        device_type=device.type,
    )


@dataclass(frozen=True, kw_only=True)
class RankBatch:
    """The part of a batch one rank consumes, on its device (RankPipeline.prepare_batch): its replica's rows of the
    first stage's arguments (on the rank holding it), of the side inputs (every stage gets them) and of the targets
    (on the rank holding the last stage). torch's schedule cuts them into this rank's micro-batches."""

    args: tuple[torch.Tensor, ...]
    """The first stage's positional arguments; empty on a rank without the first stage."""
    side: dict[str, torch.Tensor]
    """Side inputs every stage gets as keyword arguments (attention masks, position ids); empty for most models."""
    target: torch.Tensor | None
    """The loss's targets; None on a rank without the last stage."""

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor this rank holds of the batch."""
        return [*self.args, *self.side.values(), *([] if self.target is None else [self.target])]

    def head(self, rows: int) -> RankBatch:
        """The first `rows` rows (views: no copy), e.g. the first micro-batches."""
        return RankBatch(args=tuple(t[:rows] for t in self.args), side={k: t[:rows] for k, t in self.side.items()},
                         target=None if self.target is None else self.target[:rows])

    @staticmethod
    def concat(batches: Sequence[RankBatch]) -> RankBatch:
        """Several batches as one, each one's rows after the previous one's (a window of 2BW steps)."""
        if len(batches) == 1:
            return batches[0]
        targets = [b.target for b in batches if b.target is not None]
        return RankBatch(args=tuple(torch.cat(parts) for parts in zip(*(b.args for b in batches))),
                         side={k: torch.cat([b.side[k] for b in batches]) for k in batches[0].side},
                         target=torch.cat(targets) if targets else None)


@dataclass(kw_only=True)
class RankPipeline:
    """One rank's share of a pipelined training step."""

    spec: ModelSpec
    """The model file the stages come from (make_batch gives the global batch)."""
    candidate: Candidate
    layout: RankLayout
    stage_indices: list[int]
    """Stages this rank holds, in increasing order."""
    modules: list[nn.Module]
    """The module of each held stage (wrapped for checkpointing / wire casts)."""
    schedule: Any
    """The torch schedule object (PipelineScheduleSingle or PipelineScheduleMulti), built with scale_grads=False:
    step() divides each gradient once (torch's per-stage division would hit a parameter shared by two stages of
    this rank twice)."""
    optimizer: torch.optim.Optimizer
    dp_group: dist.ProcessGroup | None
    device: torch.device
    pp_group: dist.ProcessGroup | None = None
    """The group of this replica's pipeline (None: the default group, one replica)."""
    replicated: bool = False
    """Each stage runs under torch's DistributedDataParallel over dp_group: its gradients are averaged over the
    replicas in buckets during the stage's last backward (overlapped with it), not after the schedule."""
    sharded: bool = False
    """Each stage is FSDP2-sharded over dp_group (autotune.sharding): parameters and gradients are DTensors holding
    this replica's shard, and FSDP2 averages the gradients over the replicas (reduce-scatter) when torch's schedule
    ends each stage's backwards."""
    unsharded: list[nn.Parameter] = field(default_factory=list)
    """sharded: the parameters FSDP2 leaves out (held by two of this rank's FSDP units: a tied embedding on the rank
    holding both its uses), whole on every replica and averaged over them after the schedule."""
    parameter_names: dict[int, str] = field(default_factory=dict)
    """id(parameter) -> its name in the user's model (the first, for a tied one)."""
    shared_groups: list[tuple[list[nn.Parameter], dist.ProcessGroup]] = field(default_factory=list)
    """Parameters shared with other ranks of this pipeline (tied embeddings) and the group of the ranks holding
    them: their gradients are summed over it before the data-parallel average."""
    split_inputs: Callable[[Any], tuple[tuple[torch.Tensor, ...], dict[str, torch.Tensor]]] | None = None
    """make_batch's inputs -> (first stage's arguments, side inputs every stage gets); None: one tensor."""
    stages: list[PipelineStage] = field(default_factory=list)
    """torch's stage of each held stage, in stage_indices order (the schedule runs them)."""
    tensor_parallel: AppliedTP = field(default_factory=AppliedTP)
    """tp > 1: what the model's tensor-parallel plan did to this rank's stages (autotune.models.apply_tp): the
    modules parallelized over tp_group, and the parameters whose gradients are summed over it after the backward."""
    tp_group: dist.ProcessGroup | None = None
    """The ranks holding the other shards of this rank's stages (tp > 1); None without tensor parallelism."""
    weight_versions: WeightVersions | None = None
    """2BW (asynchronous): the stages' two weight versions; their updates are made inside the schedule's steps."""
    windows: dict[int, Any] = field(default_factory=dict)
    """2BW: torch's schedule of a window of n steps' micro-batches as one 1F1B, by n (1: `schedule`)."""

    @property
    def holds_first(self) -> bool:
        return 0 in self.stage_indices

    @property
    def holds_last(self) -> bool:
        return self.candidate.n_stages - 1 in self.stage_indices

    def parameters(self) -> list[nn.Parameter]:
        """This rank's parameters, each once (a tied parameter in two of its stages is one)."""
        return _unique_parameters(self.modules)

    def named_layer_parameters(self) -> dict[str, nn.Parameter]:
        """This rank's parameters under their name in the user's model (model.named_parameters(); for an
        nn.Sequential "<layer index>.<name in layer>"), for comparisons with the unpipelined model."""
        return {self.parameter_names.get(id(p), f"?{i}"): p for i, p in enumerate(self.parameters())}

    def replica_slice(self, tensor: torch.Tensor) -> torch.Tensor:
        """This replica's rows of a global batch."""
        rows = self.candidate.replica_batch_size
        return tensor[self.layout.dp_rank * rows : (self.layout.dp_rank + 1) * rows]

    def prepare_batch(self, inputs: Any, targets: torch.Tensor, *, replica_rows: bool = False) -> RankBatch:
        """What this rank consumes of a batch, copied to its device as a data loader would (from pinned memory on
        CUDA), so a step copies nothing: the first stage's arguments only where it is held, the targets only where
        the last stage is, the side inputs everywhere. Nothing of it shares storage with `inputs` or `targets`: the
        caller's batch can be freed, and the rank keeps only its replica's rows.

        inputs, targets: make_batch's, the global batch (this rank's replica's rows are taken), or with
        replica_rows its replica's rows already (a per-replica data loader's batch of replica_batch_size)."""
        rows = self.candidate.replica_batch_size if replica_rows else self.candidate.global_batch_size
        for _, t in [*(input_tensors(inputs) or []), ("targets", targets)]:
            if t.dim() == 0 or t.shape[0] != rows:
                from autotune.errors import ConfigError

                which, fix = (("replica_batch_size", "replica_rows=False for the global batch") if replica_rows
                              else ("global_batch_size", "replica_rows=True for a replica's batch"))
                raise ConfigError(
                    f"prepare_batch got a batch of {t.shape[0] if t.dim() else 0} rows; this rank expects {rows} "
                    f"({which}): pass {fix}"
                )
        mine = (lambda t: t) if replica_rows else self.replica_slice
        if self.split_inputs is not None:
            first, side = self.split_inputs(map_inputs(inputs, mine))
        else:
            first, side = (mine(inputs),), {}
        return RankBatch(
            args=tuple(self._to_device(t) for t in first) if self.holds_first else (),
            side={k: self._to_device(t) for k, t in side.items()},
            target=self._to_device(mine(targets)) if self.holds_last else None,
        )

    def _to_device(self, tensor: torch.Tensor) -> torch.Tensor:
        """A copy of its own on this rank's device (a view of the caller's batch would keep all of it alive)."""
        if self.device.type == "cuda":
            return tensor.pin_memory().to(self.device, non_blocking=True)
        return tensor.to(self.device, copy=True, memory_format=torch.contiguous_format)

    def step(self, inputs: Any, targets: torch.Tensor | None = None) -> list[torch.Tensor]:
        """One optimizer step on the global batch (inputs, targets), or on a RankBatch (prepare_batch); returns this
        rank's micro-batch losses (empty unless it holds the last stage). inputs: make_batch's (a tensor, tuple or
        dict of tensors). 2BW: a window of one step (train_steps), so its pipeline fills and drains."""
        if self.weight_versions is not None:
            return self.train_steps([self._rank_batch(inputs, targets)])[0]
        losses = self.forward_backward(inputs, targets)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return losses

    def train_steps(self, batches: Sequence[RankBatch]) -> list[list[torch.Tensor]]:
        """Optimizer steps on these batches (prepare_batch's), in order; each step's micro-batch losses. A
        synchronous schedule runs step() for each. 2BW runs them as one window: one 1F1B over all their
        micro-batches, filled and drained once, each step on the weights one step older and its update made inside
        the window when a stage ends the step's last backward (autotune.weight_versions). Windows follow each other
        with the same semantics; only the fill and drain are paid once per window. Memory: torch's runtime keeps a
        receive buffer per micro-batch of the longest window run so far (activations in, gradients back), so a
        window of n steps holds n times one step's."""
        versions = self.weight_versions
        if versions is None:
            return [self.step(batch) for batch in batches]
        n, m, pp = len(batches), self.candidate.n_microbatches, self.candidate.pipeline_degree
        if n not in self.windows:
            order = [one_f_one_b(r, pp, n * m) for r in range(pp)]
            self.windows[n] = compat.runtime_schedule(
                self.stages, n_microbatches=n * m, loss_fn=self.spec.loss_fn,
                order=[[(a.stage, a.kind, a.microbatch) for a in actions] for actions in order],
            )
        window = RankBatch.concat(batches)
        losses: list[torch.Tensor] = []
        try:
            if window.target is not None:
                self.windows[n].step(*window.args, target=window.target, losses=losses, return_outputs=False,
                                     **window.side)
            else:
                self.windows[n].step(*window.args, return_outputs=False, **window.side)
            versions.finish()  # the window's last update
        finally:
            versions.restore()
        versions.first_step += n
        return [losses[i * m : (i + 1) * m] for i in range(n)]

    def _start_update(self) -> Callable[[], None]:
        """2BW: a step's gradient is complete on this rank: start averaging it over the replicas; the returned call
        waits for that and steps the optimizer (WeightVersions calls it when the new weights are first needed)."""
        finish = self.start_reduce(async_op=True)

        def update() -> None:
            self.finish_reduce(finish)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)

        return update

    def _rank_batch(self, inputs: Any, targets: torch.Tensor | None) -> RankBatch:
        if isinstance(inputs, RankBatch):
            return inputs
        if targets is None:
            raise TypeError("step(inputs, targets): targets missing (or pass a RankBatch alone)")
        return self.prepare_batch(inputs, targets)

    def forward_backward(self, inputs: Any, targets: torch.Tensor | None = None) -> list[torch.Tensor]:
        """Run the schedule on the global batch (inputs, targets) or a RankBatch, and average gradients over
        micro-batches and replicas (tied ones summed over their holders first), leaving them in .grad (no
        optimizer step). Not for 2BW, whose updates are made inside its steps."""
        if self.weight_versions is not None:
            from autotune.errors import ConfigError

            raise ConfigError("2BW updates its weights inside its steps, so there is no step's gradient to leave in "
                              ".grad; call step() or train_steps()")
        if isinstance(inputs, RankBatch):
            batch = inputs
        elif targets is None:
            raise TypeError("forward_backward(inputs, targets): targets missing (or pass a RankBatch alone)")
        else:
            batch = self.prepare_batch(inputs, targets)
        losses: list[torch.Tensor] = []
        if batch.target is not None:
            self.schedule.step(*batch.args, target=batch.target, losses=losses, return_outputs=False, **batch.side)
        else:
            self.schedule.step(*batch.args, return_outputs=False, **batch.side)
        self.reduce_gradients()
        return losses

    def reduce_gradients(self) -> None:
        """start_reduce, then finish_reduce at once."""
        self.finish_reduce(self.start_reduce())

    def start_reduce(self, *, async_op: bool = False) -> Callable[[], None] | None:
        """Sum tied gradients over the ranks holding them, then average every gradient over micro-batches and
        replicas: replicated, DistributedDataParallel averaged them over the replicas during the backward; sharded,
        FSDP2 did (reduce-scatter, in float32), except for the parameters it leaves whole (unsharded); the rest in
        one flat all-reduce over this rank's replicas. Sums of a tied parameter's shards are sums of its gradient:
        both holders shard it alike (same shape, same replicas). With tensor parallelism, the gradients each tp rank
        holds only its part of (per-head norms) are summed over the tp group first; a DTensor's gradient is averaged
        as its local shard (every replica holds the same shard of it).

        With async_op the flat all-reduce is only started (2BW overlaps it with the next step's micro-batches).
        Returns what completes the reduction (finish_reduce runs it); None when nothing is left to do."""
        if self.tp_group is not None:
            reduce_partial_gradients(self.tensor_parallel, self.tp_group)
        for params, group in self.shared_groups:
            for p in params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                dist.all_reduce(local_tensor(p.grad), group=group)
        if self.dp_group is None or self.replicated:
            by_hand: list[nn.Parameter] = []
        else:
            by_hand = self.unsharded if self.sharded else self.parameters()
        mine = {id(p) for p in by_hand}
        for p in self.parameters():
            if p.grad is not None and id(p) not in mine:
                local_tensor(p.grad).mul_(1.0 / self.candidate.n_microbatches)
        grads = [local_tensor(p.grad) for p in by_hand if p.grad is not None]
        if not grads:
            return None
        flat = torch.cat([grad.reshape(-1) for grad in grads])
        work = dist.all_reduce(flat, group=self.dp_group, async_op=async_op)
        scale = 1.0 / (self.candidate.n_microbatches * self.candidate.data_parallel_degree)

        def finish() -> None:
            if work is not None:
                work.wait()
            flat.mul_(scale)
            for grad, reduced in zip(grads, flat.split([grad.numel() for grad in grads])):
                grad.copy_(reduced.view_as(grad))

        return finish

    @staticmethod
    def finish_reduce(finish: Callable[[], None] | None) -> None:
        """Complete what start_reduce started."""
        if finish is not None:
            finish()


def _release_others(model: nn.Module, modules: list[nn.Module]) -> None:
    """Free the buffers this rank does not run (its parameters outside its stages are on the meta device already).
    The model object itself stays (split_inputs reads its forward's signature)."""
    mine = {id(t) for m in modules for t in (*m.parameters(), *m.buffers())}
    for t in (*model.parameters(), *model.buffers()):
        if id(t) not in mine:
            release(t)


def _load_state(
    spec: ModelSpec, model: nn.Module, modules: list[nn.Module], load_state: LoadState, names: dict[int, str]
) -> None:
    """Copy real weights into this rank's parameters and buffers, asking load_state for exactly their names (a
    parameter by its first name in the model, names[id]; a sharded one gets its shard of the value)."""
    from autotune.errors import ModelFileError

    mine = {id(t) for m in modules for t in (*m.parameters(), *m.buffers())}
    wanted: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, t in model.state_dict(keep_vars=True).items():
        if id(t) in mine and id(t) not in seen:  # a tied parameter once, under its first name
            seen.add(id(t))
            wanted[names.get(id(t), name)] = t
    try:
        state = load_state(sorted(wanted))
    except Exception as exc:  # the user's loader can raise anything
        raise ModelFileError(f"{spec.path}: load_state raised {type(exc).__name__}: {exc}") from exc
    missing = [name for name in wanted if name not in state]
    if missing:
        raise ModelFileError(
            f"{spec.path}: load_state did not return {', '.join(missing[:3])}"
            f"{f' and {len(missing) - 3} more' if len(missing) > 3 else ''}; return a tensor for every name asked for"
        )
    with torch.no_grad():
        for name, t in wanted.items():
            value = state[name]
            if tuple(value.shape) != tuple(t.shape):
                raise ModelFileError(
                    f"{spec.path}: load_state returned {name} of shape {tuple(value.shape)}; the model's is "
                    f"{tuple(t.shape)}"
                )
            sharding.copy_full(t, value)


@contextmanager
def _renamed(modules: list[nn.Module], names: dict[int, str]) -> Iterator[None]:
    """Keep `names` (id(parameter) -> its name in the model) true across a block that replaces the modules'
    parameters under the same names (fully_shard registers DTensors in place of the originals). The originals are
    kept alive until the new ones are named, and their entries dropped after: a freed original's id could be
    reused by a new parameter, which would then take the original's name (seen with tensor parallelism's DTensors
    replaced by FSDP2's)."""
    held = [{key: names[id(p)] for key, p in module.named_parameters(remove_duplicate=False) if id(p) in names}
            for module in modules]
    originals = {id(p): p for module in modules for p in module.parameters()}
    yield
    current = {id(p) for module in modules for p in module.parameters()}
    for key in originals.keys() - current:
        names.pop(key, None)
    for module, known in zip(modules, held):
        for key, p in module.named_parameters(remove_duplicate=False):
            if key in known:
                names.setdefault(id(p), known[key])
    del originals


def _unique_parameters(modules: list[nn.Module]) -> list[nn.Parameter]:
    """The parameters of the modules, each once, in order."""
    seen: dict[int, nn.Parameter] = {}
    for module in modules:
        for p in module.parameters():
            seen.setdefault(id(p), p)
    return list(seen.values())


def build_pipeline(
    spec: ModelSpec,
    candidate: Candidate,
    *,
    rank: int,
    device: torch.device,
    pp_group: dist.ProcessGroup | None = None,
    dp_group: dist.ProcessGroup | None = None,
    load_state: LoadState | None = None,
    overlap_gradient_sync: bool = True,
) -> RankPipeline:
    """Build this rank's stages only: the model on the meta device, the blocks of this rank's stages materialised on
    `device` with their per-block initialisation (autotune.models.materialize: every rank holding a tied parameter
    gets the same values), then, with `load_state`, real weights for them; wrapped in torch's schedule. Every rank
    calls this (it creates the process groups of tied parameters, on every rank). A sharded candidate's stages are
    FSDP2-sharded over dp_group on the meta device first, and only this rank's shards get storage and values
    (autotune.sharding); its bf16 is FSDP2's mixed precision, an unsharded one's torch.autocast (stage_boundary).

    Tensor parallel (tensor_parallel_degree > 1): the model's plan (autotune.models.tensor_parallel) is applied to
    each held stage over the "tp" dimension of the layout's DeviceMesh (process_groups.device_mesh) once its blocks
    are materialised (sharded: still on the meta device, then FSDP2 shards over the mesh's "dp" dimension, as
    torchtitan does: 2-D (dp, tp) parameters); the parameter names, the optimizer and load_state see the new
    (DTensor) parameters. pp_group and dp_group default to the mesh's. A model without a plan, or a degree its plan
    does not allow, is refused (InvalidCandidateError). No DistributedDataParallel with tp (the replicas' gradients
    are averaged after the schedule).

    load_state(names) -> {name: tensor}: the state_dict names of the parameters and buffers this rank holds; every
    one must be returned (copied into the rank's tensors, cast to their dtype).

    overlap_gradient_sync: with replicas, run each stage under DistributedDataParallel where it can
    (overlaps_gradient_sync); False: one flat all-reduce after the schedule (for comparisons)."""
    layout = RankLayout.of(candidate, rank)
    stage_indices = stages_of_rank(candidate.schedule, candidate.pipeline_degree, candidate.n_stages, layout.pp_rank)
    if spec.n_layers != sum(candidate.layers_per_stage):
        from autotune.errors import ConfigError

        raise ConfigError(
            f"the split has {sum(candidate.layers_per_stage)} layers but {spec.path.name} cuts into "
            f"{spec.n_layers} blocks; the model changed since it was tuned: run autotune search again"
        )
    bounds = stage_bounds(candidate.layers_per_stage)
    mine = [b for s in stage_indices for b in range(bounds[s], bounds[s + 1])]
    tp_plan = plan_for_degree(spec, candidate.tensor_parallel_degree) if candidate.tensor_parallel_degree > 1 else None
    mesh = device_mesh(layout) if tp_plan is not None else None
    if mesh is not None:
        pp_group = pp_group if pp_group is not None else mesh["pp"].get_group()
        if dp_group is None and candidate.data_parallel_degree > 1:
            dp_group = mesh["dp"].get_group()
    if candidate.sharded and dp_group is None:
        from autotune.errors import ConfigError

        raise ConfigError("a sharded candidate needs its data-parallel group: pass dp_group (runtime.init_groups)")
    # Sharded: every block stays on the meta device until FSDP2 has sharded it (autotune.sharding).
    blocks = build_skeleton(spec) if candidate.sharded else build_blocks(spec, only=mine, device=device)
    modules: list[nn.Module] = []
    stages: list[PipelineStage] = []
    for s in stage_indices:
        module: nn.Module = blocks.stage(bounds[s], bounds[s + 1])
        if candidate.activation_checkpointing:
            module = CheckpointedStage(module)
        module = stage_boundary(module, candidate, s, device)
        if not candidate.sharded:
            module.to(device)
        modules.append(module)
    applied = AppliedTP()
    if tp_plan is not None and mesh is not None:
        blocks.shared_parameters()  # which parameters are tied, read (and kept) while the blocks hold the originals
        for s in stage_indices:
            applied += apply_tp(blocks, bounds[s], bounds[s + 1], tp_plan, mesh["tp"])
    names = {id(p): name for name, p in reversed(list(blocks.model.named_parameters(remove_duplicate=False)))}
    unsharded: list[nn.Parameter] = []
    if candidate.sharded:
        # which parameters are tied is read (and kept: a cached property) while every block still holds the
        # originals: fully_shard replaces them in this rank's blocks only
        blocks.shared_parameters()
        ignored = sharding.tied_on_rank(blocks.blocks, mine)
        unsharded = list(ignored)
        # with tp, FSDP2 needs the dp and tp meshes to be slices of one mesh (it combines them per parameter)
        shard_mesh = mesh["dp"] if mesh is not None else dp_mesh(cast(dist.ProcessGroup, dp_group), device)
        with _renamed(modules, names):
            for s, module in zip(stage_indices, modules):
                sharding.shard_stage(module, blocks.blocks[bounds[s]:bounds[s + 1]], mesh=shard_mesh,
                                     candidate=candidate, ignored=ignored)
        sharding.materialize_shards(spec, blocks.blocks, mine, modules, device=device, seed=SEED)
    if SCHEDULES[candidate.schedule].asynchronous and blocks.shared_parameters():
        from autotune.errors import ConfigError

        raise ConfigError(TIED_ASYNC)  # every rank alike, before any group is made
    groups = _shared_groups(blocks, candidate, layout, modules)
    split = None if blocks.family == "sequential" else blocks.split_inputs
    _release_others(blocks.model, modules)
    if load_state is not None:
        _load_state(spec, blocks.model, modules, load_state, names)
    del blocks
    replicated = overlap_gradient_sync and dp_group is not None and overlaps_gradient_sync(candidate, modules)
    for s, module in zip(stage_indices, modules):
        submod = _replicate(module, dp_group, device) if replicated else module
        stage = compat.prepare_stage(PipelineStage(submod, s, candidate.n_stages, device, group=pp_group))
        if candidate.reshard_after_forward and candidate.sharded and SCHEDULES[candidate.schedule].splits_backward:
            stage = compat.unshard_before_split_backward(stage)
        stages.append(stage)
    schedule = make_schedule(candidate, stages, loss_fn=spec.loss_fn)
    pipe = RankPipeline(
        spec=spec,
        candidate=candidate,
        layout=layout,
        stage_indices=stage_indices,
        modules=modules,
        schedule=schedule,
        optimizer=build_optimizer(spec, _unique_parameters(modules)),
        dp_group=dp_group,
        pp_group=pp_group,
        replicated=replicated,
        sharded=candidate.sharded,
        unsharded=unsharded,
        device=device,
        parameter_names=names,
        shared_groups=groups,
        split_inputs=split,
        stages=stages,
        tensor_parallel=applied,
        tp_group=mesh["tp"].get_group() if mesh is not None and tp_plan is not None else None,
        windows={1: schedule},
    )
    if SCHEDULES[candidate.schedule].asynchronous:
        pipe.weight_versions = WeightVersions(modules, pipe.parameters(), candidate.n_microbatches)
        for stage in stages:
            pipe.weight_versions.wrap(stage, pipe._start_update)
    return pipe


def rewired_pipeline(pipe: RankPipeline, *, wire_dtype: WireDtype, n_microbatches: int) -> RankPipeline:
    """The same stages over the same modules (parameters and .grad shared, no copy) with another wire dtype and a
    schedule of n_microbatches micro-batches of the same size: torch stage objects and a schedule only, no
    parameters, no process groups (the pipeline's own are reused). For a comparison on the first micro-batches
    (trial.worker's wire error); it has no optimizer step of its own (the pipeline's optimizer is shared). Not for a
    sharded pipeline: its stage modules are FSDP2's roots, which a new boundary around them cannot replace."""
    if pipe.sharded:
        from autotune.errors import ConfigError

        raise ConfigError("rewired_pipeline cannot rewire FSDP2-sharded stages; compare wires on a replicate layout")
    base = pipe.candidate
    candidate = replace(base, wire_dtype=wire_dtype, n_microbatches=n_microbatches,
                        global_batch_size=n_microbatches * base.micro_batch_size * base.data_parallel_degree)
    modules: list[nn.Module] = []
    stages: list[PipelineStage] = []
    for s, old in zip(pipe.stage_indices, pipe.modules):
        inner = old.inner if isinstance(old, StageBoundary) else old
        module = stage_boundary(inner, candidate, s, pipe.device)
        modules.append(module)
        stages.append(compat.prepare_stage(
            PipelineStage(module, s, candidate.n_stages, pipe.device, group=pipe.pp_group)))
    schedule = make_schedule(candidate, stages, loss_fn=pipe.spec.loss_fn)
    return replace(pipe, candidate=candidate, modules=modules, stages=stages, replicated=False, schedule=schedule,
                   weight_versions=None, windows={1: schedule})


def overlaps_gradient_sync(candidate: Candidate, modules: list[nn.Module]) -> bool:
    """Whether the stages run under DistributedDataParallel (their data-parallel sync bucketed and overlapped with
    the last backward): where the candidate allows it (Candidate.under_ddp) and no parameter is in two of this
    rank's stages (two reducers would each average it). Otherwise the gradients are averaged after the schedule, in
    one flat all-reduce."""
    if not candidate.under_ddp:
        return False
    seen: set[int] = set()
    for module in modules:
        mine = {id(p) for p in module.parameters()}
        if mine & seen:
            return False
        seen |= mine
    return True


def _replicate(module: nn.Module, dp_group: dist.ProcessGroup | None, device: torch.device) -> nn.Module:
    """torch's DistributedDataParallel around a stage: replicas start equal (same per-block initialisation or
    load_state), so no initial broadcast; gradients become views of its buckets (no second copy of them)."""
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(
        module, process_group=dp_group, device_ids=[device] if device.type == "cuda" else None,
        broadcast_buffers=False, init_sync=False, find_unused_parameters=True, gradient_as_bucket_view=True,
    )


def fewest_microbatches(candidate: Candidate) -> int:
    """The fewest micro-batches (of the candidate's size) its schedule runs on its stages."""
    for m in range(1, candidate.n_microbatches):
        try:
            validate_schedule(candidate.schedule, pipeline_degree=candidate.pipeline_degree, n_microbatches=m,
                              n_stages=candidate.n_stages)
        except InvalidCandidateError:
            continue
        return m
    return candidate.n_microbatches


def _shared_groups(
    blocks: Any, candidate: Candidate, layout: RankLayout, modules: list[nn.Module]
) -> list[tuple[list[nn.Parameter], dist.ProcessGroup]]:
    """Process groups of the ranks holding a copy of a tied parameter, one per replica's pipeline; every rank
    creates every group in the same order. Returns this rank's (parameters, group) pairs."""
    shared = blocks.shared_parameters()
    if not shared:
        return []
    n_stages = candidate.n_stages
    stage_ranks = [
        next(r for r in range(candidate.pipeline_degree)
             if s in stages_of_rank(candidate.schedule, candidate.pipeline_degree, n_stages, r))
        for s in range(n_stages)
    ]
    holders = shared_parameter_ranks(shared, candidate.layers_per_stage, stage_ranks)
    by_id = {id(p): p for m in modules for p in m.parameters()}
    params_of = {id(p): p for block in blocks.blocks for p in block.parameters()}
    named = dict(blocks.model.named_parameters(remove_duplicate=False))
    mine: list[tuple[list[nn.Parameter], dist.ProcessGroup]] = []
    # one group per replica and tp rank (tensor parallelism leaves a tied parameter whole on every tp rank)
    replicas = [(d, t) for d in range(candidate.data_parallel_degree) for t in range(candidate.tensor_parallel_degree)]
    for ranks in shared_groups(holders):
        for d, t in replicas:
            group = new_group([layout.pipeline_ranks(d, t)[r] for r in ranks])
            if (d, t) != (layout.dp_rank, layout.tp_rank) or layout.pp_rank not in ranks:
                continue
            params: list[nn.Parameter] = []
            for parameter, held in zip(shared, holders):
                # the first name's module may hold the original: sharded, only this rank's blocks hold the DTensor
                p = next((named[n] for n in parameter.names if n in named and id(named[n]) in by_id), None)
                if held == ranks and p is not None and id(p) in params_of:
                    params.append(p)
            mine.append((params, group))
    return mine


def make_schedule(candidate: Candidate, stages: list[PipelineStage], *, loss_fn: Callable[..., torch.Tensor]) -> Any:
    """torch's schedule object for the candidate's schedule over this rank's stages."""
    torch_class = SCHEDULES[candidate.schedule].torch_class
    if torch_class is None:
        return _run_own_order(candidate, stages, loss_fn=loss_fn)
    cls = getattr(torch_schedules, torch_class)
    if issubclass(cls, torch_schedules.PipelineScheduleSingle):
        return cls(stages[0], n_microbatches=candidate.n_microbatches, loss_fn=loss_fn, scale_grads=False)
    return cls(stages, n_microbatches=candidate.n_microbatches, loss_fn=loss_fn, scale_grads=False)


def _run_own_order(candidate: Candidate, stages: list[PipelineStage], *, loss_fn: Callable[..., torch.Tensor]) -> Any:
    """A schedule torch does not ship (VHalf, VMin; 2BW's window of one step): our action lists, the ones the
    simulator replays, on torch's runtime."""
    lists = action_lists(candidate.schedule, candidate.pipeline_degree, candidate.n_microbatches, candidate.n_stages)
    order = [[(a.stage, a.kind, a.microbatch) for a in actions] for actions in lists]
    return compat.runtime_schedule(stages, n_microbatches=candidate.n_microbatches, loss_fn=loss_fn, order=order)


def setup_pipeline(
    config: str | Path | TunedConfig,
    model: str | Path | None = None,
    *,
    device: str | None = None,
    load_state: LoadState | None = None,
) -> RankPipeline:
    """For your training script under torchrun: init the process group if needed and build this rank's pipeline
    from a tuned config. `model` defaults to the config's model path.

    Only this rank's stages are built (the rest of the model stays on the meta device). Their weights come from
    `load_state(names) -> {name: tensor}`, or the model file's own `load_state(names)`: it gets the state_dict
    names of what this rank holds and returns those tensors (e.g. read lazily from safetensors files); without
    either, the blocks keep their deterministic per-block initialisation."""
    from autotune.config_file import load_config
    from autotune.tuned_config import TunedConfig

    tuned = config if isinstance(config, TunedConfig) else load_config(Path(config))
    spec = load_model_file(Path(model) if model is not None else Path(tuned.model), split_at=tuned.split_at)
    candidate = tuned.candidate
    if not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() and device != "cpu" else "gloo"
        dist.init_process_group(backend)
    rank = dist.get_rank()
    if dist.get_world_size() != candidate.world_size:
        from autotune.errors import ConfigError

        raise ConfigError(
            f"the config is for {candidate.world_size} ranks but {dist.get_world_size()} were launched; "
            f"run torchrun --nproc-per-node {candidate.world_size}"
        )
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        torch_device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
    else:
        torch_device = torch.device(device)
    if torch_device.type == "cuda":
        torch.cuda.set_device(torch_device)
    pp_group, dp_group = init_groups(RankLayout.of(candidate, rank))
    return build_pipeline(spec, candidate, rank=rank, device=torch_device, pp_group=pp_group, dp_group=dp_group,
                          load_state=load_state if load_state is not None else spec.load_state)
