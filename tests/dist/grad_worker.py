"""Rank body for the gradient tests: one pipelined forward/backward, gradients saved under whole-model names."""

from __future__ import annotations

import os
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

from autotune.candidate import Candidate
from autotune.model_file import load_model_file, make_batch
from autotune.runtime import RankLayout, build_pipeline, init_groups


def run(rank: int, world_size: int, model: str, candidate: dict, out_dir: str) -> None:
    try:
        torch.set_num_threads(1)
        store = dist.FileStore(str(Path(out_dir) / "store"), world_size)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
        c = Candidate.from_dict(candidate)
        spec = load_model_file(model)
        layout = RankLayout.of(c, rank)
        pp_group, dp_group = init_groups(layout)
        pipe = build_pipeline(spec, c, rank=rank, device=torch.device("cpu"), pp_group=pp_group, dp_group=dp_group)
        inputs, targets = make_batch(spec, c.global_batch_size)
        pipe.forward_backward(inputs, targets)
        grads = {name: p.grad.detach().clone() for name, p in pipe.named_layer_parameters().items()}
        torch.save(grads, Path(out_dir) / f"grads-{rank}.pt")
        dist.destroy_process_group()
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
