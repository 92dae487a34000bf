"""The layout space with tensor parallelism (autotune.layouts): which tp degrees a run may use, and the pp x dp x tp
layouts with their schedules and micro-batch counts, against hand-worked tables."""

from __future__ import annotations

import pytest

from autotune.errors import UsageError
from autotune.layouts import layout_choices, parallel_layout_choices, tensor_parallel_degrees
from autotune.schedules import Schedule


@pytest.mark.parametrize("gpus,allowed,per_node,want", [
    (8, (1, 2, 4, 8), None, (1, 2, 4, 8)),   # one machine: every allowed degree dividing the ranks
    (8, (1, 2, 4), None, (1, 2, 4)),         # the model's plan stops at 4 (e.g. 4 key/value heads)
    (6, (1, 2, 4), None, (1, 2)),            # 4 does not divide 6 ranks
    (16, (1, 2, 4, 8), 4, (1, 2, 4)),        # a tp group stays inside a node of 4
    (12, (1, 2, 4), 6, (1, 2)),              # 4 would straddle nodes of 6
    (4, (), None, (1,)),                     # no plan: tp 1 only
])
def test_tp_degrees_are_the_models_that_divide_the_ranks_and_fit_a_node(gpus, allowed, per_node, want):
    assert tensor_parallel_degrees(gpus, allowed, per_node) == want


def test_a_tp_layout_is_a_pp_x_dp_layout_of_gpus_over_tp():
    """4 GPUs, 8 layers, B = 8, GPipe and 1F1B: tp 1 has pp x dp over 4 ranks, tp 2 over 2, tp 4 over 1; each with the
    schedules and B/M counts the (pp, dp) layout of gpus / tp has."""
    space = parallel_layout_choices(4, 8, 8, tp_degrees=(1, 2, 4), schedules=["GPipe", "1F1B"])
    assert list(space) == [(4, 1, 1), (2, 2, 1), (1, 4, 1), (2, 1, 2), (1, 2, 2), (1, 1, 4)]
    assert space[(2, 1, 2)] == layout_choices(2, 8, 8, schedules=["GPipe", "1F1B"])[(2, 1)]
    assert space[(2, 1, 2)] == {Schedule.GPIPE: [1, 2, 4, 8], Schedule.ONE_F_ONE_B: [2, 4, 8]}
    assert space[(1, 1, 4)] == {Schedule.ONE_F_ONE_B: [1, 2, 4, 8]}  # pp 1: GPipe folded into 1F1B
    assert space[(1, 2, 2)] == {Schedule.ONE_F_ONE_B: [1, 2, 4]}     # B/M per replica divides B / dp = 4


def test_given_pp_dp_layouts_are_tp_1_only_and_a_degree_must_divide_the_ranks():
    assert list(parallel_layout_choices(4, 8, 8, tp_degrees=(1, 2), layouts=[(2, 2)])) == [(2, 2, 1)]
    with pytest.raises(UsageError, match="tensor-parallel degree 3 does not divide 4 GPUs"):
        parallel_layout_choices(4, 8, 8, tp_degrees=(1, 3))
