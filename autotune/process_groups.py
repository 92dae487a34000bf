"""The process groups of a pipeline: its pp x dp x tp grid as one DeviceMesh, and the groups of ranks sharing a tied
parameter; made once per layout and default group in a process, then reused.

tp is innermost: the tp ranks of a stage are consecutive global ranks (one node), and the pp x dp grid
(autotune.placement) is laid over rank // tp:

    rank = grid_rank * tp + tp_rank      grid_rank = placement.global_rank(pp_rank, dp_rank, pp, dp, order)

    pp 2 x dp 1 x tp 2:   rank  0  1  2  3          the mesh: (dp, pp, tp) pp-inner, (pp, dp, tp) dp-inner
                          pp    0  0  1  1
                          tp    0  1  0  1
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

import torch.distributed as dist

from autotune.placement import RankOrder, global_rank, grid_position

if TYPE_CHECKING:
    import torch
    from torch.distributed.device_mesh import DeviceMesh

    from autotune.candidate import Candidate

__all__ = ["GROUPS", "RankLayout", "device_mesh", "dp_mesh", "init_groups", "new_group"]


@dataclass(frozen=True, kw_only=True)
class RankLayout:
    """Where a global rank sits in the pp x dp x tp grid: its pp x dp position is that of rank // tp (grid_rank =
    dp_rank * pp + pp_rank pp-inner, pp_rank * dp + dp_rank dp-inner; autotune.placement), its tp rank rank % tp."""

    rank: int
    pipeline_degree: int
    data_parallel_degree: int
    rank_order: RankOrder = "pp-inner"
    tensor_parallel_degree: int = 1

    @property
    def grid_rank(self) -> int:
        """The rank's place in the pp x dp grid (its tp group's)."""
        return self.rank // self.tensor_parallel_degree

    @property
    def pp_rank(self) -> int:
        return grid_position(self.grid_rank, self.pipeline_degree, self.data_parallel_degree, self.rank_order)[0]

    @property
    def dp_rank(self) -> int:
        return grid_position(self.grid_rank, self.pipeline_degree, self.data_parallel_degree, self.rank_order)[1]

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tensor_parallel_degree

    def global_rank(self, pp_rank: int, dp_rank: int, tp_rank: int = 0) -> int:
        """The global rank at (pp_rank, dp_rank, tp_rank)."""
        pp, dp, tp = self.pipeline_degree, self.data_parallel_degree, self.tensor_parallel_degree
        return global_rank(pp_rank, dp_rank, pp, dp, self.rank_order) * tp + tp_rank

    def pipeline_ranks(self, dp_rank: int, tp_rank: int = 0) -> list[int]:
        """The global ranks of replica dp_rank's pipeline, tp rank tp_rank of each stage."""
        return [self.global_rank(p, dp_rank, tp_rank) for p in range(self.pipeline_degree)]

    def replica_ranks(self, pp_rank: int, tp_rank: int = 0) -> list[int]:
        """The global ranks holding pipeline rank pp_rank's stages (tp rank tp_rank of them) in every replica."""
        return [self.global_rank(pp_rank, d, tp_rank) for d in range(self.data_parallel_degree)]

    @classmethod
    def of(cls, candidate: Candidate, rank: int) -> RankLayout:
        """The layout of a global rank under a candidate (its pp, dp, tp and rank order)."""
        return cls(rank=rank, pipeline_degree=candidate.pipeline_degree,
                   data_parallel_degree=candidate.data_parallel_degree, rank_order=candidate.rank_order,
                   tensor_parallel_degree=candidate.tensor_parallel_degree)


@dataclass
class _GroupCache:
    """The process groups this process made, for the default group they were made under: one DeviceMesh (its pp, dp
    and tp sub-groups) per layout, one group per set of ranks sharing a tied parameter. A process that runs several
    pipelines under one init_process_group (several jobs, a training script rebuilding its pipeline) makes each
    once; a new default group (destroy + init) starts afresh."""

    default: Any = None
    meshes: dict[tuple[int, int, int, str], DeviceMesh] = field(default_factory=dict)
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
    """This rank's pipeline group and data-parallel group: dimensions of one DeviceMesh over the pp x dp x tp grid
    (device_mesh); (None, None) for one pipeline without tp (the default group is the pipeline's). Every rank calls
    this, in the same order."""
    mesh = device_mesh(layout)
    if mesh is None:
        return None, None
    return mesh["pp"].get_group(), mesh["dp"].get_group()


def device_mesh(layout: RankLayout) -> DeviceMesh | None:
    """The DeviceMesh of the layout's pp x dp x tp grid, dimensions named "pp", "dp" and "tp" (under NCCL with a bound
    device, torch makes each dimension's groups with one communicator split rather than one new_group per group);
    None for one pipeline without tp. Made once per layout and default group, then reused (GROUPS). Its "tp"
    dimension is what autotune.models.apply_tp shards over, its "dp" one what FSDP2 shards over when tp > 1 (both
    slices of one mesh, as FSDP2 needs to combine them into its 2-D (dp, tp) parameters). Every rank calls this, in
    the same order."""
    pp, dp, tp = layout.pipeline_degree, layout.data_parallel_degree, layout.tensor_parallel_degree
    if dp == 1 and tp == 1:
        return None
    from torch.distributed.device_mesh import init_device_mesh

    cache = GROUPS.current()
    key = (pp, dp, tp, layout.rank_order)
    if key not in cache.meshes:
        # placement: pp-inner puts the grid rank dp_rank * pp + pp_rank, i.e. a (dp, pp) grid in row-major order;
        # dp-inner pp_rank * dp + dp_rank, a (pp, dp) grid; tp innermost (rank = grid rank * tp + tp rank). Without
        # tp the mesh stays 2-D, as it was.
        shape, names = ((dp, pp), ("dp", "pp")) if layout.rank_order == "pp-inner" else ((pp, dp), ("pp", "dp"))
        if tp > 1:
            shape, names = (*shape, tp), (*names, "tp")
        device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
        cache.meshes[key] = init_device_mesh(device_type, shape, mesh_dim_names=names)
        cache.created += 1
    return cache.meshes[key]


def dp_mesh(dp_group: dist.ProcessGroup, device: torch.device) -> DeviceMesh:
    """The 1-D DeviceMesh of a data-parallel group, for FSDP2 (autotune.sharding): the group's own ranks, no new
    process group."""
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh.from_group(dp_group, device.type)
