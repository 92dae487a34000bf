"""What a stage hands to the next: tensors that torch's schedules may detach in place.

torch's split backward (zero-bubble and V schedules: stage_backward_input in torch/distributed/pipelining/
_backward.py) ends with `for t in stage_outputs: t.detach_()`. That fails for an output that is a view ("Can't
detach views in-place": nn.Linear on a 3-D activation returns one) and, for an output that is one of the stage's
inputs (a skip connection passed through), detaches the input. So such outputs leave as a new tensor on the same
memory: no copy, not a view, the gradient passed straight through.

A tensor subclass has no memory of its own to alias: tensor parallelism's all-reduced output (torch's
AsyncCollectiveTensor, which RowwiseParallel returns before the collective is waited on: a stage ending with a
vocabulary-parallel embedding) leaves as a copy, made by an op, which waits for it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeVar

import torch

T = TypeVar("T")


def handoff(value: T, inputs: Sequence[Any] = ()) -> T:
    """`value` (a tensor, or a tuple of tensors and others) with every view, and every tensor that is one of
    `inputs`, replaced by a same-memory alias; one tensor stays one tensor."""
    given = {id(t) for t in inputs}
    if isinstance(value, torch.Tensor):
        return _fresh(value, given)  # type: ignore[return-value]
    if isinstance(value, tuple):
        return tuple(_fresh(v, given) if isinstance(v, torch.Tensor) else v for v in value)  # type: ignore[return-value]
    return value


def _fresh(tensor: torch.Tensor, given: set[int]) -> torch.Tensor:
    if type(tensor) is not torch.Tensor and not isinstance(tensor, torch.nn.Parameter):
        return tensor.clone()
    if not (tensor._is_view() or id(tensor) in given):
        return tensor
    if tensor.requires_grad:
        out: torch.Tensor = _Alias.apply(tensor)
        return out
    return _same_memory(tensor)


def _same_memory(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.new_empty(0).set_(tensor.untyped_storage(), tensor.storage_offset(), tensor.size(), tensor.stride())


class _Alias(torch.autograd.Function):
    """Identity whose output shares the input's memory without being a view of it."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor) -> torch.Tensor:
        return _same_memory(tensor)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad
