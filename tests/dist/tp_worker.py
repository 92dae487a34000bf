"""Rank body for the tensor-parallel tests: runtime.build_pipeline of a candidate with tensor_parallel_degree > 1 (the
layout's mesh from process_groups, tp innermost: ranks 0,1 one stage's tp group), one forward/backward through torch's
schedule, the gradients saved whole (DTensor shards gathered) under the model's parameter names."""

from __future__ import annotations

import os
import sys
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from autotune.candidate import Candidate
from autotune.model_file import load_model_file, make_batch
from autotune.models.tensor_parallel import full_value
from autotune.runtime import RankLayout, build_pipeline, init_groups


def run_jobs(rank: int, world_size: int, jobs: list[dict[str, Any]], store_dir: str) -> None:
    """jobs: dicts of model (path), candidate (Candidate.to_dict()) and out (folder); writes grads-{rank}.pt (whole
    gradients by name), shards-{rank}.pt (local parameter shapes by name) and applied-{rank}.pt (what apply_tp
    parallelized, the rank's losses, whether DDP / FSDP2 ran) into out."""
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
    pp_group, dp_group = init_groups(RankLayout.of(c, rank))
    pipe = build_pipeline(spec, c, rank=rank, device=torch.device("cpu"), pp_group=pp_group, dp_group=dp_group)
    inputs, targets = make_batch(spec, c.global_batch_size)
    losses = [float(loss) for loss in pipe.forward_backward(inputs, targets)]
    named = list(pipe.named_layer_parameters().items())
    # full_value is a collective over the parameter's mesh (tp, or dp x tp when sharded): every rank of it walks the
    # same names in the same order
    grads = {name: full_value(p.grad).detach().clone() for name, p in named}
    torch.save(grads, out / f"grads-{rank}.pt")
    torch.save({name: (tuple(_local(p).shape), type(p).__name__) for name, p in named}, out / f"shards-{rank}.pt")
    applied = pipe.tensor_parallel
    torch.save({"modules": applied.modules, "partial": len(applied.partial_gradients), "losses": losses,
                "replicated": pipe.replicated, "sharded": pipe.sharded}, out / f"applied-{rank}.pt")


def _local(p: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return p.to_local() if isinstance(p, DTensor) else p
