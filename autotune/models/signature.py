"""When two blocks cost the same: a signature of everything that changes a block's cost (its class and module tree,
parameter and buffer shapes and dtypes, plain attributes such as a sliding window or an attention type, the glue
code of a traced block, and its input shapes and dtypes), but not its position in the model (layer_idx) or its
parameter values. The profiler measures one block per signature."""

from __future__ import annotations

import re
from collections.abc import Hashable, Sequence
from typing import Any

import torch
from torch import fx, nn

from autotune.models.blocks import BlockModel

TensorSpec = tuple[tuple[int, ...], torch.dtype]
"""(shape, dtype) of one input tensor."""

_POSITION = re.compile(r"(^|_)(idx|index|id|number|num|no|position)$", re.IGNORECASE)
"""Attribute names that say where a layer sits (layer_idx, layer_number, index), not what it costs."""
_PLAIN = (str, int, float, bool, type(None))


def block_signature(blocks: BlockModel, index: int, inputs: Sequence[Hashable]) -> Hashable:
    """What decides block `index`'s cost; `inputs`: its input tensors' specs (at every micro-batch size). The last
    block is never the same as another (the loss is measured after it), nor is the first (its inputs are the
    model's, which need no gradient)."""
    ends = (index == 0, index == blocks.n_blocks - 1)
    return (blocks.block_types[index], blocks.roles[index], ends, module_signature(blocks.blocks[index]),
            tuple(inputs))


def module_signature(module: nn.Module) -> tuple[Any, ...]:
    """The module tree in visiting order, names left out: depth, class, own parameters and buffers (shape, dtype,
    requires_grad), plain attributes other than positions, and for a torch.fx GraphModule its code's operations."""
    out: list[Any] = []

    def visit(m: nn.Module, depth: int) -> None:
        out.append((depth, _class_name(m), _tensors(m), _attributes(m), _graph(m)))
        for child in m.children():
            visit(child, depth + 1)

    visit(module, 0)
    return tuple(out)


def _class_name(m: nn.Module) -> str:
    name = type(m).__name__
    return re.sub(r"\d+$", "", name) if isinstance(m, fx.GraphModule) else name  # fx names segments Block0, Block1


def _tensors(m: nn.Module) -> tuple[Any, ...]:
    params = tuple((tuple(p.shape), p.dtype, p.requires_grad) for p in m._parameters.values() if p is not None)
    buffers = tuple((tuple(b.shape), b.dtype) for b in m._buffers.values() if b is not None)
    return params, buffers


def _attributes(m: nn.Module) -> tuple[Any, ...]:
    out = []
    for name, value in vars(m).items():
        if name.startswith("_") or name == "training" or _POSITION.search(name):
            continue
        if isinstance(value, (list, tuple)) and all(isinstance(v, _PLAIN) for v in value):
            value = tuple(value)
        elif not isinstance(value, _PLAIN):
            continue
        out.append((name, value))
    return tuple(sorted(out, key=lambda item: item[0]))


def _graph(m: nn.Module) -> tuple[Any, ...]:
    if not isinstance(m, fx.GraphModule):
        return ()
    ops = []
    for node in m.graph.nodes:
        if node.op in ("call_function", "call_method"):
            target = node.target if isinstance(node.target, str) else getattr(node.target, "__qualname__", "?")
            ops.append((node.op, target, len(node.args), tuple(sorted(node.kwargs))))
        else:
            ops.append((node.op,))
    return tuple(ops)
