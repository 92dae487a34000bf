"""The process groups of a pipeline: its pp x dp grid as one DeviceMesh, and the groups of ranks sharing a tied
parameter; made once per layout and default group in a process, then reused."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

import torch.distributed as dist

from autotune.placement import RankOrder, global_rank, grid_position

if TYPE_CHECKING:
    import torch
    from torch.distributed.device_mesh import DeviceMesh

    from autotune.candidate import Candidate

__all__ = ["GROUPS", "RankLayout", "dp_mesh", "init_groups", "new_group"]


@dataclass(frozen=True, kw_only=True)
class RankLayout:
    """Where a global rank sits in the pp x dp grid: rank = dp_rank * pp + pp_rank (pp-inner), or
    pp_rank * dp + dp_rank (dp-inner; autotune.placement)."""

    rank: int
    pipeline_degree: int
    data_parallel_degree: int
    rank_order: RankOrder = "pp-inner"

    @property
    def pp_rank(self) -> int:
        return grid_position(self.rank, self.pipeline_degree, self.data_parallel_degree, self.rank_order)[0]

    @property
    def dp_rank(self) -> int:
        return grid_position(self.rank, self.pipeline_degree, self.data_parallel_degree, self.rank_order)[1]

    def pipeline_ranks(self, dp_rank: int) -> list[int]:
        pp, dp = self.pipeline_degree, self.data_parallel_degree
        return [global_rank(p, dp_rank, pp, dp, self.rank_order) for p in range(pp)]

    def replica_ranks(self, pp_rank: int) -> list[int]:
        pp, dp = self.pipeline_degree, self.data_parallel_degree
        return [global_rank(pp_rank, d, pp, dp, self.rank_order) for d in range(dp)]

    @classmethod
    def of(cls, candidate: Candidate, rank: int) -> RankLayout:
        """The layout of a global rank under a candidate (its pp, dp and rank order)."""
        return cls(rank=rank, pipeline_degree=candidate.pipeline_degree,
                   data_parallel_degree=candidate.data_parallel_degree, rank_order=candidate.rank_order)


@dataclass
class _GroupCache:
    """The process groups this process made, for the default group they were made under: one DeviceMesh (its pp and
    dp sub-groups) per layout, one group per set of ranks sharing a tied parameter. A process that runs several
    pipelines under one init_process_group (several jobs, a training script rebuilding its pipeline) makes each
    once; a new default group (destroy + init) starts afresh."""

    default: Any = None
    meshes: dict[tuple[int, int, str], tuple[dist.ProcessGroup, dist.ProcessGroup]] = field(default_factory=dict)
    groups: dict[tuple[int, ...], dist.ProcessGroup] = field(default_factory=dict)
    created: int = 0
    """Process-group creations so far in this process (a DeviceMesh counts once, each new_group once)."""

    def current(self) -> _GroupCache:
        default = dist.distributed_c10d._get_default_group()
        if default is not self.default:
            self.default, self.meshes, self.groups = default, {}, {}
        return self


GROUPS = _GroupCache()
"""This process's cache of process groups (GROUPS.created counts what it made)."""


def new_group(ranks: list[int]) -> dist.ProcessGroup:
    """dist.new_group, once per set of ranks under the current default group (every rank makes the same calls in the
    same order, so every rank hits or misses the cache alike); typed as what every rank keeps of it (a non-member's
    handle is never used)."""
    cache = GROUPS.current()
    key = tuple(ranks)
    if key not in cache.groups:
        cache.groups[key] = cast(dist.ProcessGroup, dist.new_group(ranks))
        cache.created += 1
    return cache.groups[key]


def init_groups(layout: RankLayout) -> tuple[dist.ProcessGroup | None, dist.ProcessGroup | None]:
    """This rank's pipeline group and data-parallel group: the two dimensions of one DeviceMesh over the pp x dp grid
    (under NCCL with a bound device, torch makes each dimension's groups with one communicator split rather than
    one new_group per group). Made once per layout and default group, then reused (GROUPS). Every rank calls this,
    in the same order."""
    pp, dp = layout.pipeline_degree, layout.data_parallel_degree
    if dp == 1:
        return None, None
    from torch.distributed.device_mesh import init_device_mesh

    cache = GROUPS.current()
    key = (pp, dp, layout.rank_order)
    if key not in cache.meshes:
        # placement: pp-inner puts rank dp_rank * pp + pp_rank, i.e. a (dp, pp) grid in row-major order; dp-inner
        # pp_rank * dp + dp_rank, a (pp, dp) grid.
        shape, names = ((dp, pp), ("dp", "pp")) if layout.rank_order == "pp-inner" else ((pp, dp), ("pp", "dp"))
        device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
        mesh = init_device_mesh(device_type, shape, mesh_dim_names=names)
        cache.meshes[key] = (mesh["pp"].get_group(), mesh["dp"].get_group())
        cache.created += 1
    return cache.meshes[key]


def dp_mesh(dp_group: dist.ProcessGroup, device: torch.device) -> DeviceMesh:
    """The 1-D DeviceMesh of a data-parallel group, for FSDP2 (autotune.sharding): the group's own ranks, no new
    process group."""
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh.from_group(dp_group, device.type)
