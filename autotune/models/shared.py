"""Parameters shared between blocks (tied embeddings) and which ranks of a pipeline hold a copy: pure, torch-free."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from autotune.errors import UsageError


@dataclass(frozen=True, kw_only=True)
class SharedParameter:
    """One parameter used by more than one block: trained as one, counted once."""

    names: tuple[str, ...]
    """Every name it has in the model, e.g. ("transformer.wte.weight", "lm_head.weight")."""
    blocks: tuple[int, ...]
    """Indices of the blocks that hold it, increasing (at least two)."""
    nbytes: int
    """Its size in bytes (count it once in memory and in the profile)."""


def block_stages(layers_per_stage: Sequence[int]) -> list[int]:
    """The stage of each block, for a split given as block counts per stage: [2, 1] -> [0, 0, 1]."""
    if any(n < 1 for n in layers_per_stage):
        raise UsageError(f"every stage needs at least one block, got layers_per_stage {list(layers_per_stage)}")
    return [stage for stage, n in enumerate(layers_per_stage) for _ in range(n)]


def shared_parameter_ranks(
    shared: Sequence[SharedParameter], layers_per_stage: Sequence[int], stage_ranks: Sequence[int]
) -> tuple[tuple[int, ...], ...]:
    """For each shared parameter, the pipeline ranks that hold a copy of it (increasing, without repeats).

    `stage_ranks[s]` is the pipeline rank holding stage s (loop placement: s % pp; V placement: rank r holds r and
    2pp-1-r). A parameter whose blocks all sit on one rank gets one rank: no gradient needs to travel, but that rank
    must keep one Parameter and one optimizer entry for it. With two or more ranks, their gradients are summed over a
    process group of exactly those ranks (Megatron's embedding group), before averaging over data-parallel replicas.

        blocks    emb  L0  L1  L2  head         shared: wte in blocks 0 and 4
        stage      0    0   1   2   3           layers_per_stage [2, 1, 1, 1]
        rank       0    0   1   1   0           V placement, pp 2: stages 0,3 -> rank 0; 1,2 -> rank 1
        -> wte is held by rank 0 only (both copies are one Parameter there)
    """
    stages = block_stages(layers_per_stage)
    if len(stage_ranks) != len(layers_per_stage):
        raise UsageError(
            f"stage_ranks names {len(stage_ranks)} stages but layers_per_stage has {len(layers_per_stage)}"
        )
    out = []
    for parameter in shared:
        if parameter.blocks and max(parameter.blocks) >= len(stages):
            raise UsageError(
                f"shared parameter {parameter.names[0]} is in block {max(parameter.blocks)} but the split covers "
                f"{len(stages)} blocks"
            )
        out.append(tuple(sorted({stage_ranks[stages[b]] for b in parameter.blocks})))
    return tuple(out)


def shared_groups(ranks_per_parameter: Sequence[tuple[int, ...]]) -> tuple[tuple[int, ...], ...]:
    """The distinct rank sets of two or more ranks, in a fixed order: the process groups to create (every rank
    must create every group, in the same order, even the groups it is not in)."""
    return tuple(sorted({ranks for ranks in ranks_per_parameter if len(ranks) > 1}))
