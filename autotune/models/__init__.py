"""Real models cut into blocks: any nn.Module -> BlockModel (blocks, stages, side inputs, shared parameters)."""

from autotune.models.blocks import BlockModel, Family, Role, find_shared_parameters
from autotune.models.check import check_blocks, check_cut
from autotune.models.cut import cut_model, discover_blocks, match_split_at, parse_split_at, split_points_from
from autotune.models.shared import SharedParameter, block_stages, shared_groups, shared_parameter_ranks
from autotune.models.tensor_parallel import (
    AppliedTP,
    TensorParallelPlan,
    allowed_tp_degrees,
    apply_tp,
    max_tensor_parallel,
    plan_for_degree,
    reduce_partial_gradients,
    tp_plan_of,
)

__all__ = [
    "AppliedTP",
    "BlockModel",
    "Family",
    "Role",
    "SharedParameter",
    "TensorParallelPlan",
    "allowed_tp_degrees",
    "apply_tp",
    "block_stages",
    "check_blocks",
    "check_cut",
    "cut_model",
    "discover_blocks",
    "find_shared_parameters",
    "max_tensor_parallel",
    "match_split_at",
    "parse_split_at",
    "plan_for_degree",
    "reduce_partial_gradients",
    "shared_groups",
    "shared_parameter_ranks",
    "split_points_from",
    "tp_plan_of",
]
