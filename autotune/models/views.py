"""Views of a module: a shallow copy that runs the module's own forward with some children swapped for stand-ins.

This is how a family adapter runs exactly the model's own code for a part of it (the embedding, or the masks and
rotary embeddings every decoder layer gets) while holding only that part's parameters: the copy shares every kept
child and parameter with the model by reference; the swapped children are parameter-free stand-ins that stop the
forward, record what a layer was called with, or stand for a module the part must not run.
"""

from __future__ import annotations

import copy
import typing
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from autotune.errors import ModelFileError

_HOOK_DICTS = (
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_backward_hooks",
    "_backward_pre_hooks",
)


def view(module: nn.Module, *, replace: Mapping[str, nn.Module], keep_parameters: bool) -> nn.Module:
    """A shallow copy of `module`: same class, same forward, same config; children are the module's own objects
    except those named in `replace`; its direct parameters kept (shared) or dropped (then its forward fails loudly
    with AttributeError if it reads one). Hooks are not copied."""
    clone = copy.copy(module)
    clone._modules = OrderedDict(
        (name, replace[name] if name in replace else child) for name, child in module._modules.items()
    )
    clone._parameters = OrderedDict(module._parameters) if keep_parameters else OrderedDict()
    clone._buffers = OrderedDict(module._buffers)
    for name in _HOOK_DICTS:
        if hasattr(module, name):
            setattr(clone, name, OrderedDict())
    return clone


class Stop(BaseException):  # noqa: N818 - control flow, not an error; BaseException so `except Exception` lets it by
    """Raised by a stand-in to end a forward early, carrying the value it was called with."""

    def __init__(self, value: Any) -> None:
        super().__init__()
        self.value = value


class LayerCall:
    """What a stand-in layer recorded: the arguments besides the hidden state."""

    def __init__(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self.args, self.kwargs = args, kwargs


class Recorder:
    """Shared by the stand-ins of one ModuleList: stop at layer `stop_at` (raising Stop with its hidden state), or
    record the calls of layers first..last and stop after the last."""

    def __init__(self) -> None:
        self.first = 0
        self.last = -1
        self.stop_at: int | None = None
        self.calls: dict[int, LayerCall] = {}

    def reset(self, *, first: int = 0, last: int = -1, stop_at: int | None = None) -> None:
        self.first, self.last, self.stop_at, self.calls = first, last, stop_at, {}


class StandInLayer(nn.Module):
    """Stands for layer `index` of a ModuleList: records its call or stops the forward; returns the hidden state,
    in a tuple (the rest None) where the layer's forward is annotated to return one (DeBERTa's layers return their
    output with the attention weights, and the encoder unpacks both)."""

    def __init__(self, index: int, recorder: Recorder, like: nn.Module | None = None) -> None:
        super().__init__()
        if like is not None:  # plain attributes the base forward reads (transformers 4.x: layer.attention_type)
            for name, value in vars(like).items():
                if not name.startswith("_") and name != "training" and isinstance(value, (str, int, float, bool)):
                    setattr(self, name, value)
        self.index = index
        self.recorder = recorder
        self.tuple_size = _returned_tuple_size(like) if like is not None else 0

    def forward(self, hidden: Any, *args: Any, **kwargs: Any) -> Any:
        rec = self.recorder
        if rec.stop_at == self.index:
            raise Stop(hidden)
        if rec.first <= self.index <= rec.last:
            rec.calls[self.index] = LayerCall(args, kwargs)
            if self.index == rec.last:
                raise Stop(hidden)
        return (hidden, *(None,) * (self.tuple_size - 1)) if self.tuple_size > 1 else hidden


def _returned_tuple_size(layer: nn.Module) -> int:
    """How many values the layer's forward is annotated to return in a tuple of fixed length (0: not a tuple, or
    no annotation to tell)."""
    try:
        annotation = typing.get_type_hints(type(layer).forward).get("return")
    except Exception:  # noqa: BLE001 - an annotation naming what cannot be imported here: nothing to tell
        return 0
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) is tuple and args and Ellipsis not in args:
        return len(args)
    return 0


def stand_in_layers(layers: nn.ModuleList, recorder: Recorder) -> nn.ModuleList:
    return nn.ModuleList(StandInLayer(i, recorder, layer) for i, layer in enumerate(layers))


class Absent(nn.Module):
    """Stands for a module the view must not run; running it means the model is not of the expected shape."""

    def __init__(self, name: str, why: str) -> None:
        super().__init__()
        self.name, self.why = name, why

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise ModelFileError(f"the model's forward ran {self.name} where autotune did not expect it ({self.why})")


class Zero(nn.Module):
    """Stands for a module whose output only feeds values the view discards (a position embedding or an embedding
    norm while the view computes masks): zeros shaped like a float input (a norm keeps its input's shape), or a
    0-dim zero for an index input or wherever it stands for an embedding (`embedding`: its output broadcasts
    against the hidden state it is added to; OPT's learned positions are looked up from the attention mask, a float
    tensor of ones when the batch has none)."""

    def __init__(self, *, embedding: bool = False) -> None:
        super().__init__()
        self.embedding = embedding

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        like = next((a for a in args if isinstance(a, torch.Tensor)), None)
        if like is not None and like.is_floating_point() and not self.embedding:
            return torch.zeros_like(like)
        return torch.zeros((), device=like.device if like is not None else None)


class Passthrough(nn.Module):
    """Stands for a dropout whose output the view discards: returns its input, draws no random numbers."""

    def forward(self, x: Any, *args: Any, **kwargs: Any) -> Any:
        return x
