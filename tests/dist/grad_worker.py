"""Rank body for the gradient tests: one pipelined forward/backward, gradients saved under whole-model names.

run_jobs runs several (model, candidate) jobs one after the other in one process group (every rank the same list),
so a test module pays for the process start and the imports once; a job with steps > 0 also takes that many
optimizer steps and saves the losses, the parameters after them (whole: a sharded one gathered), the optimizer's
entries and the lowered actions of a multi-stage schedule."""

from __future__ import annotations

import gc
import json
import os
import sys
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from autotune.candidate import Candidate
from autotune.model_file import load_model_file, make_batch
from autotune.process_groups import GROUPS
from autotune.runtime import RankLayout, build_pipeline, init_groups
from autotune.sharding import full_tensor, local_tensor


def run(rank: int, world_size: int, model: str, candidate: dict, out_dir: str) -> None:
    """One job: writes grads-{rank}.pt into out_dir."""
    run_jobs(rank, world_size, [{"model": model, "candidate": candidate, "out": out_dir}], out_dir)


def run_jobs(rank: int, world_size: int, jobs: list[dict[str, Any]], store_dir: str) -> None:
    """jobs: dicts of model (path), candidate (Candidate.to_dict()), out (folder) and optionally steps (int), or
    windows (list of int) for an asynchronous schedule (_windows_job).
    Writes groups-{rank}.json into store_dir: process_groups.GROUPS.created after each job."""
    try:
        torch.set_num_threads(1)
        store = dist.FileStore(str(Path(store_dir) / "store"), world_size)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
        created = []
        for job in jobs:
            c = Candidate.from_dict(job["candidate"])
            if "windows" in job:
                _windows_job(rank, c, job["model"], Path(job["out"]), job["windows"])
            else:
                _job(rank, c, job["model"], Path(job["out"]), job.get("steps", 0))
            created.append(GROUPS.created)
        (Path(store_dir) / f"groups-{rank}.json").write_text(json.dumps(created))
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - any failure: print it and leave at once (no hanging peers)
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)


def _job(rank: int, c: Candidate, model: str, out: Path, steps: int) -> None:
    spec = load_model_file(model)
    layout = RankLayout.of(c, rank)
    pp_group, dp_group = init_groups(layout)
    pipe = build_pipeline(spec, c, rank=rank, device=torch.device("cpu"), pp_group=pp_group, dp_group=dp_group)
    inputs, targets = make_batch(spec, c.global_batch_size)
    losses = [[float(loss) for loss in pipe.forward_backward(inputs, targets)]]
    # a sharded parameter's gradient whole (full_tensor: a collective over its replicas, who list it alike)
    grads = {name: full_tensor(p.grad).detach().clone() for name, p in pipe.named_layer_parameters().items()}
    torch.save(grads, out / f"grads-{rank}.pt")
    if not steps:
        return
    pipe.optimizer.step()
    pipe.optimizer.zero_grad(set_to_none=True)
    for _ in range(steps - 1):
        losses.append([float(loss) for loss in pipe.step(inputs, targets)])
    names = {id(p): name for name, p in pipe.named_layer_parameters().items()}
    torch.save(
        {
            "losses": losses,
            "params": {name: full_tensor(p).detach().clone() for name, p in pipe.named_layer_parameters().items()},
            "optimizer": [names.get(id(p), "?") for g in pipe.optimizer.param_groups for p in g["params"]],
            "actions": _actions(pipe.schedule),
        },
        out / f"steps-{rank}.pt",
    )


def _windows_job(rank: int, c: Candidate, model: str, out: Path, windows: list[int]) -> None:
    """2BW: optimizer steps run as windows of that many steps each (RankPipeline.train_steps), step i on rows
    [i*B, (i+1)*B) of make_batch(steps x B), so every step sees other data. Writes steps-{rank}.pt: each step's
    losses and the parameters after the last step, whole, by name."""
    spec = load_model_file(model)
    pp_group, dp_group = init_groups(RankLayout.of(c, rank))
    pipe = build_pipeline(spec, c, rank=rank, device=torch.device("cpu"), pp_group=pp_group, dp_group=dp_group)
    b = c.global_batch_size
    inputs, targets = make_batch(spec, sum(windows) * b)
    batches = [pipe.prepare_batch(inputs[i * b : (i + 1) * b], targets[i * b : (i + 1) * b])
               for i in range(sum(windows))]
    losses: list[list[float]] = []
    for n in windows:
        losses += [[float(loss) for loss in step] for step in pipe.train_steps(batches[len(losses) : len(losses) + n])]
    params = {name: p.detach().clone() for name, p in pipe.named_layer_parameters().items()}
    torch.save({"losses": losses, "params": params}, out / f"steps-{rank}.pt")


def _actions(schedule: Any) -> list[str]:
    """This rank's lowered actions as "stage:KIND" (torch's runtime schedules; empty for single-stage ones)."""
    lowered = getattr(schedule, "pipeline_order_with_comms", None)
    if not lowered:
        return []
    return [f"{a.stage_index}:{a.computation_type.name}" for a in lowered[schedule.rank]]


def run_loaded(rank: int, world_size: int, model: str, candidate: dict, state_file: str, out_dir: str) -> None:
    """build_pipeline with a load_state that serves a saved state_dict: writes loaded-{rank}.pt with the names asked
    for, this rank's parameters (by name, whole), the elements of parameters with storage that are not this rank's
    and the elements this rank stores of its own (a sharded one's local shard)."""
    try:
        torch.set_num_threads(1)
        store = dist.FileStore(str(Path(out_dir) / "store"), world_size)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
        c = Candidate.from_dict(candidate)
        spec = load_model_file(model)
        state = torch.load(state_file)
        asked: list[str] = []

        def load_state(names: list[str]) -> dict[str, torch.Tensor]:
            asked.extend(names)
            return {name: state[name] for name in names}

        pp_group, dp_group = init_groups(RankLayout.of(c, rank))
        pipe = build_pipeline(spec, c, rank=rank, device=torch.device("cpu"), pp_group=pp_group, dp_group=dp_group,
                              load_state=load_state)
        gc.collect()
        mine = {id(p) for p in pipe.parameters()}
        real_elsewhere = sum(  # parameters with storage in this process that are not this rank's
            o.numel() for o in gc.get_objects()
            if isinstance(o, torch.nn.Parameter) and o.device.type != "meta" and id(o) not in mine
        )
        torch.save(
            {
                "asked": asked,
                "params": {name: full_tensor(p).detach().clone() for name, p in pipe.named_layer_parameters().items()},
                "real_elsewhere": real_elsewhere,
                "stored_numel": sum(local_tensor(p).numel() for p in pipe.parameters()),
            },
            Path(out_dir) / f"loaded-{rank}.pt",
        )
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - any failure: print it and leave at once (no hanging peers)
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
