"""Pure: where the ranks of a pp x dp grid sit on nodes, and so which of a candidate's transfers cross nodes.

Ranks fill nodes in order (node of a global rank = rank // gpus_per_node). Two rank orders:

    pp-inner  rank = dp_rank * pp + pp_rank   a pipeline's ranks are consecutive: its sends stay inside a node,
                                              a stage's replicas (its DP all-reduce) spread over nodes
    dp-inner  rank = pp_rank * dp + dp_rank   a stage's replicas are consecutive: the all-reduce stays inside a
                                              node, the pipeline's sends cross nodes (Megatron's and torchtitan's
                                              mesh order, pp outermost)

    pp 4 x dp 2 on 2 nodes of 4:     node 0          node 1
        pp-inner                  p0 p1 p2 p3 | p0 p1 p2 p3     (replica 0 | replica 1)
        dp-inner                  p0 p0 p1 p1 | p2 p2 p3 p3     (one boundary, p1 -> p2, crosses)

With one node, or pp = 1 or dp = 1, the order changes nothing that costs: such candidates keep pp-inner.
"""

from __future__ import annotations

import functools
import typing
from typing import Literal

RankOrder = Literal["pp-inner", "dp-inner"]
RANK_ORDERS: tuple[RankOrder, ...] = typing.get_args(RankOrder)


def global_rank(pp_rank: int, dp_rank: int, pipeline_degree: int, data_parallel_degree: int, order: RankOrder) -> int:
    """The global rank at (pp_rank, dp_rank) of the grid."""
    if order == "dp-inner":
        return pp_rank * data_parallel_degree + dp_rank
    return dp_rank * pipeline_degree + pp_rank


def grid_position(rank: int, pipeline_degree: int, data_parallel_degree: int, order: RankOrder) -> tuple[int, int]:
    """(pp_rank, dp_rank) of a global rank: the inverse of global_rank."""
    if order == "dp-inner":
        return rank // data_parallel_degree, rank % data_parallel_degree
    return rank % pipeline_degree, rank // pipeline_degree


def order_matters(pipeline_degree: int, data_parallel_degree: int, gpus_per_node: int | None) -> bool:
    """Both rank orders are worth planning: a pipeline and replicas, over more than one node."""
    return (
        gpus_per_node is not None
        and pipeline_degree > 1
        and data_parallel_degree > 1
        and pipeline_degree * data_parallel_degree > gpus_per_node
    )


def crossing_boundaries(
    stage_ranks: list[int], data_parallel_degree: int, gpus_per_node: int, order: RankOrder
) -> tuple[bool, ...]:
    """Per stage s: does the hand-off from stage s-1 to stage s cross nodes in some replica (index 0: False)?
    stage_ranks: the pipeline rank of each stage (schedules.stage_ranks: loop or V placement). The pattern repeats
    every gpus_per_node replicas, so at most that many are looked at."""
    pp = max(stage_ranks) + 1 if stage_ranks else 1
    dp = data_parallel_degree
    replicas = range(min(dp, gpus_per_node))

    def node(p: int, d: int) -> int:
        return global_rank(p, d, pp, dp, order) // gpus_per_node

    crossing = [False]
    for s in range(1, len(stage_ranks)):
        a, b = stage_ranks[s - 1], stage_ranks[s]
        crossing.append(a != b and any(node(a, d) != node(b, d) for d in replicas))
    return tuple(crossing)


@functools.lru_cache(maxsize=256)
def dp_nodes(pipeline_degree: int, data_parallel_degree: int, gpus_per_node: int, order: RankOrder) -> int:
    """The most nodes one data-parallel group (a pipeline rank's replicas) spans (cached: the planner asks for every
    candidate, and a layout has pp x dp ranks to place)."""
    pp, dp = pipeline_degree, data_parallel_degree
    return max(len({global_rank(p, d, pp, dp, order) // gpus_per_node for d in range(dp)}) for p in range(pp))
