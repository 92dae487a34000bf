"""A model cut into blocks (BlockModel): what the profiler hooks, the partitioner splits and the runtime runs."""

from __future__ import annotations

import dataclasses
import inspect
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Literal, Protocol

import torch
from torch import nn

from autotune.errors import ModelFileError
from autotune.models.shared import SharedParameter

Role = Literal["embedding", "block", "head", "other"]
Family = Literal["sequential", "hf-decoder", "hf-gpt2", "hf-encoder", "timm-vit", "tv-resnet", "traced"]

StageInputs = tuple[tuple[torch.Tensor, ...], dict[str, torch.Tensor]]
"""(positional arguments of the first stage, keyword side inputs of every stage)."""


class Cutter(Protocol):
    """What a family contributes: how a batch's inputs enter the stages, how a stage is built, and what the model's
    own forward returns in the terms of the last stage (for checks)."""

    def split_inputs(self, inputs: Any) -> StageInputs: ...

    def stage(self, start: int, stop: int) -> nn.Module: ...

    def reference(self, inputs: Any) -> Any: ...


@dataclass(frozen=True, kw_only=True)
class BlockModel:
    """A model cut into blocks: a stage is a contiguous range of blocks."""

    family: Family
    """Which cutter made it: a known family, "sequential", or "traced" (torch.fx, at module boundaries)."""
    model: nn.Module
    """The user's model, unmodified: blocks hold its submodules and parameters by reference."""
    blocks: tuple[nn.Module, ...]
    """In execution order; each is called exactly once per forward of a stage that holds it."""
    names: tuple[str, ...]
    """Module names in the model ("model.layers.3"); a block made of several modules joins them with "+"."""
    roles: tuple[Role, ...]
    """What each block is: the embedding, a repeated block, the head, or other glue."""
    cutter: Cutter = field(repr=False)
    """Builds stages and splits inputs for this family."""

    def __post_init__(self) -> None:
        if not (len(self.blocks) == len(self.names) == len(self.roles)):
            raise ValueError("blocks, names and roles must have one entry per block")

    @property
    def n_blocks(self) -> int:
        return len(self.blocks)

    @property
    def output_class(self) -> type | None:
        """The class the user's model returns around its logits (a Hugging Face family's CausalLMOutputWithPast),
        read from its forward's return annotation, or from the members of a union there (GPT-NeoX, OPT, Falcon,
        BLOOM and BERT's `tuple | CausalLMOutputWithPast`); None when it returns a tensor. The last stage ends
        with the logits tensor, and loss_fn gets it in this class when it reads it that way (model_file.LossFn)."""
        if isinstance(self.model, nn.Sequential):
            return None
        forward = type(self.model).forward
        try:
            annotation = typing.get_type_hints(forward).get("return")
        except Exception:  # noqa: BLE001 - an annotation naming what this module cannot import: no class known
            annotation = inspect.signature(forward).return_annotation
        for member in (annotation, *typing.get_args(annotation)):
            if isinstance(member, type) and dataclasses.is_dataclass(member):
                if "logits" in {f.name for f in dataclasses.fields(member)}:
                    return member
        return None

    @property
    def block_types(self) -> tuple[str, ...]:
        """Class name of the module each block runs (the user's module, not autotune's wrapper)."""
        return tuple(_type_name(self.model, name, block) for name, block in zip(self.names, self.blocks))

    def split_inputs(self, inputs: Any) -> StageInputs:
        """make_batch's inputs (a Tensor, tuple or dict, as the model's forward takes them) -> (args for the first
        stage, side inputs every stage gets as keyword arguments). Every tensor has the batch as dim 0."""
        args, side = self.cutter.split_inputs(inputs)
        _check_batch_dim(args, side)
        return args, side

    def stage(self, start: int, stop: int) -> nn.Module:
        """A module running blocks[start:stop]: forward(*carried, **side) -> carried (a Tensor or tuple of Tensors)
        or, when stop == n_blocks, what the user's loss_fn takes (the logits for language and vision models).
        Its .parameters() are exactly the parameters of those blocks; it accepts (and ignores) side inputs it does
        not need."""
        if not 0 <= start < stop <= self.n_blocks:
            raise ValueError(f"a stage needs 0 <= start < stop <= {self.n_blocks}, got [{start}, {stop})")
        return self.cutter.stage(start, stop)

    def run(self, inputs: Any) -> Any:
        """All blocks in one stage on make_batch's inputs: what the pipeline computes, unpipelined."""
        args, side = self.split_inputs(inputs)
        return self.stage(0, self.n_blocks)(*args, **side)

    def reference(self, inputs: Any) -> Any:
        """The model's own forward on the inputs, reduced to what the last stage returns (HF: `.logits`)."""
        return self.cutter.reference(inputs)

    def shared_parameters(self) -> tuple[SharedParameter, ...]:
        """Parameters held by more than one block (GPT-2's wte.weight in the embedding and the head), by identity."""
        return self._shared

    def parameter_bytes(self) -> tuple[int, ...]:
        """Bytes of parameters of each block (a shared parameter counts in every block holding it; subtract
        SharedParameter.nbytes for all but one to count it once)."""
        return tuple(sum(p.numel() * p.element_size() for p in block.parameters()) for block in self.blocks)

    @cached_property
    def _shared(self) -> tuple[SharedParameter, ...]:
        return find_shared_parameters(self.model, self.blocks)


def find_shared_parameters(model: nn.Module, blocks: Sequence[nn.Module]) -> tuple[SharedParameter, ...]:
    """Parameters that the .parameters() of two or more blocks yield, named by every name they have in model."""
    holders: dict[int, list[int]] = {}
    params: dict[int, nn.Parameter] = {}
    for index, block in enumerate(blocks):
        for p in block.parameters():
            holders.setdefault(id(p), []).append(index)
            params[id(p)] = p
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    return tuple(
        SharedParameter(
            names=tuple(names.get(key, ["(not a parameter of the model)"])),
            blocks=tuple(where),
            nbytes=params[key].numel() * params[key].element_size(),
        )
        for key, where in holders.items()
        if len(where) > 1
    )


def bind_inputs(forward: Any, inputs: Any, *, what: str) -> dict[str, Any]:
    """make_batch's inputs as the model's forward would bind them: a Tensor is the first argument, a tuple the
    positional arguments, a dict the keyword arguments. Returns {parameter name: tensor}, in signature order."""
    signature = inspect.signature(forward)
    try:
        if isinstance(inputs, torch.Tensor):
            bound = signature.bind(inputs)
        elif isinstance(inputs, (tuple, list)):
            bound = signature.bind(*inputs)
        elif isinstance(inputs, Mapping):
            bound = signature.bind(**inputs)
        else:
            raise ModelFileError(
                f"make_batch returned inputs of type {type(inputs).__name__}; return a tensor, a tuple of tensors "
                f"(the positional arguments of {what}'s forward) or a dict (its keyword arguments)"
            )
    except TypeError as exc:
        names = ", ".join(signature.parameters)
        raise ModelFileError(
            f"make_batch's inputs do not fit {what}.forward({names}): {exc}; return the arguments the model takes"
        ) from exc
    arguments = dict(bound.arguments)
    for name, value in list(arguments.items()):
        kind = signature.parameters[name].kind
        if kind is inspect.Parameter.VAR_KEYWORD:
            arguments.pop(name)
            arguments.update(value)
        elif kind is inspect.Parameter.VAR_POSITIONAL:
            raise ModelFileError(f"{what}.forward takes *{name}; pass its inputs as a dict of named tensors")
    for name, value in arguments.items():
        if not isinstance(value, torch.Tensor):
            raise ModelFileError(
                f"make_batch's input {name!r} is {describe(value)}; inputs must be tensors with the batch as dim 0 "
                f"(leave out arguments that keep their default)"
            )
    return arguments


def _check_batch_dim(args: tuple[torch.Tensor, ...], side: dict[str, torch.Tensor]) -> None:
    tensors = [("the first input", t) for t in args] + list(side.items())
    if not tensors:
        return
    rows = {t.shape[0] if t.dim() else None for _, t in tensors}
    if len(rows) > 1 or None in rows:
        shapes = ", ".join(f"{name} {tuple(t.shape)}" for name, t in tensors)
        raise ModelFileError(
            f"make_batch's inputs must all have the batch as dim 0 (they are cut into micro-batches), got {shapes}"
        )


def describe(value: Any) -> str:
    """A short description of a value for an error message: "a tensor of shape (2, 8)", "a CausalLMOutput"."""
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {tuple(value.shape)}"
    if value is None:
        return "None"
    if isinstance(value, (tuple, list)):
        inner = ", ".join(describe(v) for v in value[:3]) + (", ..." if len(value) > 3 else "")
        return f"a {type(value).__name__} of {len(value)} ({inner})"
    if isinstance(value, Mapping):
        keys = ", ".join(map(str, list(value)[:4]))
        return f"a {type(value).__name__} with keys ({keys})"
    name = type(value).__name__
    return f"{'an' if name[:1].lower() in 'aeiou' else 'a'} {name}"


def _type_name(model: nn.Module, name: str, block: nn.Module) -> str:
    """The class of the user's module a block stands for (the first of a "+"-joined name)."""
    first = name.split("+")[0]
    try:
        return type(model.get_submodule(first)).__name__
    except AttributeError:
        return type(block).__name__
