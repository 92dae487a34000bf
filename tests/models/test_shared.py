"""Shared parameters: found by identity, and which ranks of a pipeline hold a copy (pure)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from autotune.errors import UsageError
from autotune.models import SharedParameter, block_stages, cut_model, shared_groups, shared_parameter_ranks


def test_identity_finds_a_module_used_twice_and_a_tied_weight() -> None:
    first, last = nn.Linear(4, 4), nn.Linear(4, 4)
    last.weight = first.weight
    middle = nn.Linear(4, 4)
    net = nn.Sequential(first, nn.ReLU(), middle, middle, last)
    shared = cut_model(net).shared_parameters()
    assert [(s.names, s.blocks, s.nbytes) for s in shared] == [
        (("0.weight", "4.weight"), (0, 4), 64),
        (("2.weight", "3.weight"), (2, 3), 64),
        (("2.bias", "3.bias"), (2, 3), 16),
    ]


def wte(blocks: tuple[int, ...]) -> SharedParameter:
    return SharedParameter(names=("transformer.wte.weight", "lm_head.weight"), blocks=blocks, nbytes=100)


def test_block_stages() -> None:
    assert block_stages([2, 1, 3]) == [0, 0, 1, 2, 2, 2]
    with pytest.raises(UsageError, match="at least one block"):
        block_stages([2, 0])


def test_ranks_holding_a_tied_embedding() -> None:
    # 5 blocks (embedding, 3 layers, head); pp 2.
    loop = [0, 1]  # 1F1B: stage s on rank s
    assert shared_parameter_ranks([wte((0, 4))], [2, 3], loop) == ((0, 1),)
    v_shape = [0, 1, 1, 0]  # ZBV: rank 0 holds stages 0 and 3
    assert shared_parameter_ranks([wte((0, 4))], [2, 1, 1, 1], v_shape) == ((0,),)
    interleaved = [0, 1, 0, 1]  # Interleaved1F1B, 2 stages per rank
    assert shared_parameter_ranks([wte((0, 4))], [1, 1, 2, 1], interleaved) == ((0, 1),)
    assert shared_parameter_ranks([wte((0, 1))], [2, 3], loop) == ((0,),)


def test_groups_to_create() -> None:
    assert shared_groups([(0, 3), (0,), (1, 2), (0, 3)]) == ((0, 3), (1, 2))


def test_placement_is_checked() -> None:
    with pytest.raises(UsageError, match="names 1 stages but layers_per_stage has 2"):
        shared_parameter_ranks([wte((0, 4))], [2, 3], [0])
    with pytest.raises(UsageError, match="is in block 9 but the split covers 5 blocks"):
        shared_parameter_ranks([wte((0, 9))], [2, 3], [0, 1])


def test_shared_bytes_are_counted_once() -> None:
    emb = nn.Embedding(10, 4)
    head = nn.Linear(4, 10, bias=False)
    head.weight = emb.weight
    model = cut_model(nn.Sequential(emb, nn.Linear(4, 4), head))
    total = sum(model.parameter_bytes()) - sum(s.nbytes * (len(s.blocks) - 1) for s in model.shared_parameters())
    assert total == sum(p.numel() * p.element_size() for p in model.model.parameters()) == 4 * (40 + 20)
    assert torch.equal(model.run(torch.tensor([[1, 2]])), model.reference(torch.tensor([[1, 2]])))
