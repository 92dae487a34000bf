"""Rank body for the tensor-parallel tests: one forward/backward of a model whose stages are tensor-parallel, the
gradients saved whole (DTensor shards gathered) under the model's parameter names.

A job is pp 1 (the whole model one module: tp over a 1-D mesh, plain forward/backward over the micro-batches) or
pp > 1 (a (pp, tp) mesh, tp innermost: ranks 0,1 one stage's tp group; each stage parallelized, then wrapped in torch's
PipelineStage and run by the candidate's schedule, as runtime.build_pipeline would)."""

from __future__ import annotations

import os
import sys
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.pipelining import PipelineStage

from autotune import compat
from autotune.candidate import Candidate, stage_bounds
from autotune.model_file import build_blocks, load_model_file, make_batch
from autotune.models.tensor_parallel import AppliedTP, apply_tp, full_value, reduce_partial_gradients, tp_plan_of
from autotune.runtime import StageBoundary, make_schedule
from autotune.schedules import stages_of_rank


def run_jobs(rank: int, world_size: int, jobs: list[dict[str, Any]], store_dir: str) -> None:
    """jobs: dicts of model (path), candidate (Candidate.to_dict(), dp 1) and out (folder); writes grads-{rank}.pt
    (whole gradients by name), shards-{rank}.pt (local parameter shapes by name) and applied-{rank}.pt into out."""
    try:
        torch.set_num_threads(1)
        store = dist.FileStore(str(Path(store_dir) / "store"), world_size)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
        for job in jobs:
            _job(rank, Candidate.from_dict(job["candidate"]), job["model"], Path(job["out"]))
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - any failure: print it and leave at once (no hanging peers)
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)


def _job(rank: int, c: Candidate, model: str, out: Path) -> None:
    spec = load_model_file(model)
    plan, why = tp_plan_of(spec)
    if plan is None:
        raise RuntimeError(why)
    pp, tp = c.pipeline_degree, c.tensor_parallel_degree
    mesh = init_device_mesh("cpu", (pp, tp), mesh_dim_names=("pp", "tp"))
    tp_mesh = mesh["tp"]
    pp_rank = rank // tp
    stage_indices = stages_of_rank(c.schedule, pp, c.n_stages, pp_rank)
    bounds = stage_bounds(c.layers_per_stage)
    mine = [b for s in stage_indices for b in range(bounds[s], bounds[s + 1])]
    blocks = build_blocks(spec, only=mine)
    applied = AppliedTP()
    for s in stage_indices:
        applied += apply_tp(blocks, bounds[s], bounds[s + 1], plan, tp_mesh)
    inputs, targets = make_batch(spec, c.global_batch_size)
    args, side = blocks.split_inputs(inputs)
    m = c.n_microbatches
    if pp == 1:
        stage = blocks.stage(0, blocks.n_blocks)
        firsts = list(zip(*(t.chunk(m) for t in args)))
        sides = [dict(zip(side, parts)) for parts in zip(*(t.chunk(m) for t in side.values()))] or [{}] * m
        loss = sum(spec.loss_fn(stage(*x, **kw), y) for x, kw, y in zip(firsts, sides, targets.chunk(m)))
        (loss / m).backward()
    else:
        stages = []
        for s in stage_indices:
            module = StageBoundary(blocks.stage(bounds[s], bounds[s + 1]), wire_dtype=None, last=s == c.n_stages - 1)
            stages.append(compat.prepare_stage(
                PipelineStage(module, s, c.n_stages, torch.device("cpu"), group=mesh["pp"].get_group())))
        schedule = make_schedule(c, stages, loss_fn=spec.loss_fn)  # scale_grads=False: divided by m below
        first_args = args if 0 in stage_indices else ()
        if c.n_stages - 1 in stage_indices:
            schedule.step(*first_args, target=targets, losses=[], return_outputs=False, **side)
        else:
            schedule.step(*first_args, return_outputs=False, **side)
        for p in blocks.model.parameters():
            if p.grad is not None:
                p.grad.div_(m)
    reduce_partial_gradients(applied, tp_mesh.get_group())
    held = {id(p) for s in stage_indices for p in blocks.stage(bounds[s], bounds[s + 1]).parameters()}
    named = [(name, p) for name, p in blocks.model.named_parameters() if id(p) in held]
    # full_value is a collective over the tp group: every rank of it walks the same names in the same order
    grads = {name: full_value(p.grad).detach().clone() for name, p in named}
    torch.save(grads, out / f"grads-{rank}.pt")
    torch.save({name: (tuple(_local(p).shape), type(p).__name__) for name, p in named}, out / f"shards-{rank}.pt")
    torch.save({"modules": applied.modules, "partial": len(applied.partial_gradients)}, out / f"applied-{rank}.pt")


def _local(p: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return p.to_local() if isinstance(p, DTensor) else p
