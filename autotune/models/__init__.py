"""Real models cut into blocks: any nn.Module -> BlockModel (blocks, stages, side inputs, shared parameters)."""

from autotune.models.blocks import BlockModel, Family, Role, find_shared_parameters
from autotune.models.check import check_blocks, check_cut
from autotune.models.cut import cut_model, discover_blocks, match_split_at, parse_split_at, split_points_from
from autotune.models.shared import SharedParameter, block_stages, shared_groups, shared_parameter_ranks

__all__ = [
    "BlockModel",
    "Family",
    "Role",
    "SharedParameter",
    "block_stages",
    "check_blocks",
    "check_cut",
    "cut_model",
    "discover_blocks",
    "find_shared_parameters",
    "match_split_at",
    "parse_split_at",
    "shared_groups",
    "shared_parameter_ranks",
    "split_points_from",
]
