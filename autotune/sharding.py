"""Sharded data parallel for a rank's stages: torch's FSDP2 (`fully_shard`) over the data-parallel replicas, applied
on the meta device, then each rank's shards materialised with the values an unsharded build would have.

    stage module   StageBoundary( [CheckpointedStage(] stage( block, block, ... ) [)] )   <- FSDP root (one per stage)
    FSDP units       each block holding parameters is its own unit; the root holds what no block does

As torchtitan builds a PP x FSDP run: each pipeline stage is `fully_shard`ed block by block, then the stage module as
the root, and torch's pipelining drives it (PipelineStage.backward_maybe_with_nosync defers the gradient
reduce-scatter to the stage's last backward; perform_reduce_grad runs it; the multi-stage schedules' runtime
inserts UNSHARD / RESHARD / REDUCE_GRAD actions). Nothing here all-gathers by hand.

Materialising: `fully_shard` on the meta device leaves every parameter a DTensor with a meta local shard. Each block
is then materialised in full, one at a time, on a second skeleton of the model (models.materialize: the per-block
deterministic initialisation every rank and the reference share) and this rank's chunk of every parameter is
copied into its shard: at most one block is ever whole on the device.

A parameter two FSDP units of this rank would both hold (a tied embedding on a rank holding the embedding and the
head: pp = 1, or V placement) is left out of FSDP (`ignored_params`): it stays whole on every replica and its
gradient is averaged after the step (runtime.RankPipeline.reduce_gradients).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from autotune import compat
from autotune.models.materialize import materialize, release

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from autotune.candidate import Candidate
    from autotune.model_file import ModelSpec

__all__ = ["copy_full", "full_tensor", "local_tensor", "materialize_shards", "shard_stage", "tied_on_rank"]


def tied_on_rank(blocks: Sequence[nn.Module], mine: Iterable[int]) -> set[nn.Parameter]:
    """The parameters that two or more of this rank's blocks hold (FSDP2 gives a parameter one unit)."""
    seen: dict[int, int] = {}
    params: dict[int, nn.Parameter] = {}
    for i in mine:
        for p in blocks[i].parameters():
            seen[id(p)] = seen.get(id(p), 0) + 1
            params[id(p)] = p
    return {params[key] for key, count in seen.items() if count > 1}


def shard_stage(
    module: nn.Module,
    blocks: Sequence[nn.Module],
    *,
    mesh: DeviceMesh,
    candidate: Candidate,
    ignored: set[nn.Parameter],
) -> nn.Module:
    """fully_shard each of the stage's blocks that holds parameters, then the stage module (the root), over `mesh`
    (the replicas of this stage), with the candidate's reshard_after_forward and, for bf16, FSDP2's mixed precision
    (bfloat16 parameters in compute, float32 gradient reduction). Parameters in `ignored` stay out of FSDP. Works
    on the meta device. Returns the module (now also an FSDPModule)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
              if candidate.precision == "bf16" else MixedPrecisionPolicy())
    options: dict[str, Any] = dict(mesh=mesh, reshard_after_forward=candidate.reshard_after_forward,
                                   mp_policy=policy, ignored_params=set(ignored))
    # BatchNorm keeps float32 statistics, and torch's kernels take no bfloat16 weight beside them ("expected scalar
    # type BFloat16 but found Float": a timm ResNet's every sharded bf16 trial failed): its own unit keeps float32
    # parameters and takes its bfloat16 input as it is (torch's mixed-dtype batch norm, as under autocast: what it
    # saves is what the profile measured; cast to float32, its input was saved at 2x: a ResNet-18's rank 7 % more)
    norm_options = dict(options, mp_policy=MixedPrecisionPolicy(
        param_dtype=torch.float32, reduce_dtype=torch.float32, cast_forward_inputs=False))
    for block in blocks:
        if candidate.precision == "bf16":
            for holder in [m for m in block.modules() if any(p in ignored for p in m.parameters(recurse=False))]:
                _forward_in_bfloat16(holder)
            for norm in [m for m in block.modules() if compat.is_batch_norm(m)]:
                if any(p not in ignored for p in norm.parameters(recurse=False)):
                    fully_shard(norm, **norm_options)
        if not compat.is_batch_norm(block) and any(p not in ignored for p in block.parameters()):
            fully_shard(block, **options)
    fully_shard(module, **options)
    return module


def _forward_in_bfloat16(module: nn.Module) -> None:
    """Run the module's forward under torch.autocast(bfloat16): it holds a parameter left out of FSDP (a tied
    embedding and LM head), which stays float32 while FSDP2's mixed precision hands it bfloat16 activations ("expected
    m1 and m2 to have the same dtype": every sharded bf16 trial of a tied model failed). Autocast casts it per use,
    as in the unsharded bf16 runs (what the profile measured)."""
    active: list[Any] = []

    def enter(_: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        device = next((a.device.type for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)), "cpu")
        context = torch.autocast(device, dtype=torch.bfloat16)
        context.__enter__()
        active.append(context)

    def leave(*_: Any) -> None:
        if active:
            active.pop().__exit__(None, None, None)

    module.register_forward_pre_hook(enter, with_kwargs=True)
    module.register_forward_hook(leave, always_call=True)


def materialize_shards(
    spec: ModelSpec, blocks: Sequence[nn.Module], mine: Sequence[int], modules: Sequence[nn.Module], *,
    device: torch.device, seed: int,
) -> None:
    """Give the sharded stages' parameters storage on `device` (FSDP2's own shards, in place; the parameters it
    leaves out whole) and this rank's chunk of the values the unsharded model has: block by block, each
    materialised whole on a second skeleton of the model and released again. `blocks` are this build's (sharded)
    blocks, `mine` the indices of this rank's."""
    from autotune.model_file import build_skeleton

    for module in modules:
        compat.give_shards_storage(module, device)
    for p in {id(p): p for m in modules for p in m.parameters()}.values():
        if p.is_meta:  # left out of FSDP: whole; swapped in place too (a tie is one object in two modules)
            _swap(p, torch.empty_like(p, device=device))
    reference = build_skeleton(spec)
    done: set[int] = set()
    for i in mine:
        materialize(reference.model, reference.blocks, reference.names, [i], device=device,
                    init_weights=spec.init_weights, seed=seed)
        source = dict(reference.blocks[i].named_parameters())
        for name, p in blocks[i].named_parameters():
            if id(p) not in done:
                copy_full(p, source[name])
                done.add(id(p))
        _real_buffers(blocks[i], reference.blocks[i], device)
        for p in source.values():
            release(p)


def _real_buffers(block: nn.Module, source: nn.Module, device: torch.device) -> None:
    """Buffers the block's code made on its parameters' device (the meta device while the model was built: timm's
    Swin makes its attention mask so) take the values the block's own initialiser gave them on the materialised
    `source` (models.materialize runs reset_parameters, which makes them again)."""
    made = dict(source.named_modules())
    for name, module in block.named_modules():
        for key, buffer in module._buffers.items():
            real = made[name]._buffers.get(key) if name in made else None
            if buffer is not None and buffer.is_meta and real is not None and not real.is_meta:
                module._buffers[key] = real.to(device)


def _swap(p: nn.Parameter, data: torch.Tensor) -> None:
    """Give a parameter new data in place: the same Python object (and attributes), as every module holding it
    sees it."""
    attributes = dict(p.__dict__)
    torch.utils.swap_tensors(p, nn.Parameter(data, requires_grad=p.requires_grad))
    p.__dict__.update(attributes)


def copy_full(param: torch.Tensor, full: torch.Tensor) -> None:
    """Copy a whole (unsharded) value into a parameter: into its local shard when it is a DTensor (FSDP2's Shard(0)
    in torch.chunk's pieces, tensor parallelism's shards, or both on a (dp, tp) mesh: the piece DTensor's own
    distribute_tensor cuts for this rank, with no communication), else all of it."""
    from torch.distributed.tensor import distribute_tensor

    with torch.no_grad():
        if not isinstance(param, DTensor):
            param.copy_(full)
            return
        local = param.to_local()
        piece = distribute_tensor(full.to(local.device, local.dtype), param.device_mesh, param.placements,
                                  src_data_rank=None).to_local()
        if tuple(piece.shape) != tuple(local.shape):
            raise RuntimeError(f"shard of shape {tuple(local.shape)} for a {tuple(full.shape)} value placed "
                               f"{param.placements} on {param.device_mesh}: sharded otherwise than DTensor cuts it")
        local.copy_(piece)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """What this rank stores of a tensor: a DTensor's local shard, else the tensor."""
    return t.to_local() if isinstance(t, DTensor) else t


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole value of a tensor: a DTensor's all-gathered (a collective: every replica calls it, in the same
    order), else the tensor."""
    return t.full_tensor() if isinstance(t, DTensor) else t
