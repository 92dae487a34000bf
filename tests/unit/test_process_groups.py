"""Where a global rank sits in the pp x dp x tp grid (process_groups.RankLayout): tp innermost, the pp x dp grid laid
over rank // tp in either rank order."""

from __future__ import annotations

import pytest

from autotune.candidate import Candidate
from autotune.process_groups import RankLayout
from autotune.schedules import Schedule


def layout(rank: int, order: str = "pp-inner") -> RankLayout:
    c = Candidate(schedule=Schedule.ONE_F_ONE_B, pipeline_degree=2, data_parallel_degree=2, tensor_parallel_degree=2,
                  global_batch_size=8, n_microbatches=2, layers_per_stage=(2, 2), rank_order=order)  # type: ignore
    return RankLayout.of(c, rank)


@pytest.mark.parametrize("order,table", [
    # rank:        0          1          2          3          4          5          6          7
    ("pp-inner", [(0, 0, 0), (0, 0, 1), (1, 0, 0), (1, 0, 1), (0, 1, 0), (0, 1, 1), (1, 1, 0), (1, 1, 1)]),
    ("dp-inner", [(0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1), (1, 0, 0), (1, 0, 1), (1, 1, 0), (1, 1, 1)]),
])
def test_tp_is_innermost_under_either_rank_order(order, table):
    """(pp_rank, dp_rank, tp_rank) of every rank of pp 2 x dp 2 x tp 2, and back."""
    for rank, (p, d, t) in enumerate(table):
        here = layout(rank, order)
        assert (here.pp_rank, here.dp_rank, here.tp_rank) == (p, d, t)
        assert here.global_rank(p, d, t) == rank


def test_pipelines_and_replicas_keep_their_tp_rank():
    here = layout(0)
    assert here.pipeline_ranks(1, 1) == [5, 7] and here.pipeline_ranks(0) == [0, 2]
    assert here.replica_ranks(1, 0) == [2, 6] and layout(0, "dp-inner").replica_ranks(1, 1) == [5, 7]
