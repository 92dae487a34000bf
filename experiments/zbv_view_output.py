"""torch 2.13 / 2.14: ScheduleZBVZeroBubble fails when a stage's output is a view (nn.Linear on a 3-D activation
returns one): stage_backward_input (torch/distributed/pipelining/_backward.py) ends with `t.detach_()` on every
stage output, and "Can't detach views in-place". The runtime's StageBoundary (.contiguous()) does not help: the
view is contiguous. autotune.models.handoff passes such outputs on as same-memory aliases.

    python experiments/zbv_view_output.py          # rank 1 fails
    python experiments/zbv_view_output.py handoff  # both ranks ok
"""

import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.pipelining import PipelineStage, schedules

from autotune.models.handoff import handoff


class Handoff(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        return handoff(self.inner(*args), args)


def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(out.reshape(-1, 10), target.reshape(-1))


def run(rank: int, use_handoff: bool, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.manual_seed(0)
    mods: list[nn.Module] = [nn.Sequential(nn.Embedding(10, 8), nn.Linear(8, 8)), nn.Linear(8, 8), nn.Linear(8, 8),
                             nn.Linear(8, 10)]
    if use_handoff:
        mods = [Handoff(m) for m in mods]
    ids, target = torch.randint(0, 10, (4, 5)), torch.randint(0, 10, (4, 5))
    mine = [0, 3] if rank == 0 else [1, 2]
    stages = [PipelineStage(mods[s], s, 4, torch.device("cpu")) for s in mine]
    schedule = schedules.ScheduleZBVZeroBubble(stages, n_microbatches=2, loss_fn=loss_fn)
    try:
        if rank == 0:
            schedule.step(ids, target=target)
        else:
            schedule.step()
        print(f"rank {rank}: ok", flush=True)
    except RuntimeError as exc:
        print(f"rank {rank}: failed: {' '.join(str(exc).split())[:160]}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    mp.spawn(run, args=(sys.argv[1:] == ["handoff"], 29650 + os.getpid() % 300), nprocs=2)
