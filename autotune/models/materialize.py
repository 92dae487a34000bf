"""Blocks become real only where they run: the model is built with its parameters on the meta device (buffers real,
as the model's own code computes them), and a block's parameters get storage on one device and a deterministic
initialisation of their own, so every rank, the profiler and a single-process reference agree on every value.

    build   parameters_on_meta(): build_model() runs as usual; each parameter moves to meta as it is registered
            (one parameter's memory at a time), buffers (rotary inv_freq, BatchNorm statistics) stay real
    group   a parameter's home is the first block holding it; a group is one block's home parameters
    init    per group, seeded by the block's name: to_empty, then, over the modules whose parameters all live in the
            group (children before parents, as Module.apply visits them), the module's own initialiser: the
            Hugging Face family's _init_weights(module), else module.reset_parameters(); then the model file's
            init_weights(module), if it defines one. A parameter no initialiser wrote gets normal(0, 0.02).

A tied parameter (GPT-2's wte.weight, also lm_head.weight) has one home (the embedding): a rank holding only the head
materialises the embedding's group too, and then releases what it does not run, so both holders get the same values.
"""

from __future__ import annotations

import logging
import weakref
import zlib
from collections.abc import Callable, Collection, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from autotune.models.hf import is_transformers_model

logger = logging.getLogger(__name__)

FALLBACK_STD = 0.02
"""Standard deviation of the normal draw for a parameter no initialiser wrote (the Hugging Face default)."""

InitFn = Callable[[nn.Module], Any]


@contextmanager
def parameters_on_meta() -> Iterator[None]:
    """While active, every parameter a module registers is moved to the meta device (its storage freed at once);
    buffers and plain tensors stay where the code made them. A parameter registered twice (tied) stays one."""
    original = nn.Module.register_parameter
    moved: dict[int, tuple[weakref.ref[torch.Tensor], nn.Parameter]] = {}

    def register(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and param.device.type != "meta":
            entry = moved.get(id(param))
            if entry is not None and entry[0]() is param:
                param = entry[1]
            else:
                meta = _meta_like(param)
                moved[id(param)] = (weakref.ref(param), meta)
                param = meta
        original(module, name, param)

    nn.Module.register_parameter = register  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = original  # type: ignore[method-assign]


def _meta_like(param: nn.Parameter) -> nn.Parameter:
    data = param.detach().to("meta")
    try:
        meta = type(param)(data, requires_grad=param.requires_grad)
    except TypeError:  # a Parameter subclass with another constructor
        meta = nn.Parameter(data, requires_grad=param.requires_grad)
    meta.__dict__.update(param.__dict__)
    return meta


def home_blocks(blocks: Sequence[nn.Module]) -> dict[int, int]:
    """id(parameter) -> the first block holding it (its home: the group it is materialised and initialised with)."""
    home: dict[int, int] = {}
    for index, block in enumerate(blocks):
        for p in block.parameters():
            home.setdefault(id(p), index)
    return home


def groups_of(blocks: Sequence[nn.Module], indices: Collection[int]) -> list[int]:
    """The groups to materialise so that the blocks in `indices` can run: their parameters' homes, increasing."""
    home = home_blocks(blocks)
    return sorted({home[id(p)] for i in indices for p in blocks[i].parameters()})


def materialize(
    model: nn.Module,
    blocks: Sequence[nn.Module],
    names: Sequence[str],
    indices: Collection[int],
    *,
    device: torch.device | str = "cpu",
    init_weights: InitFn | None = None,
    seed: int = 0,
) -> None:
    """Give the parameters of blocks `indices` storage on `device` and initialise them, group by group (see the
    module docstring). Parameters of a group a block needs but the blocks in `indices` do not hold (the rest of a
    tied parameter's home) are released again. Parameter objects keep their identity (torch.utils.swap_tensors), so
    every view, stage and tie that holds them sees the real tensor."""
    device = torch.device(device)
    home = home_blocks(blocks)
    needed = {id(p) for i in indices for p in blocks[i].parameters()}
    groups = sorted({home[key] for key in needed})
    units = _init_units(model, home)
    params_of: dict[int, list[nn.Parameter]] = {}
    for p in _unique(p for block in blocks for p in block.parameters()):
        params_of.setdefault(home[id(p)], []).append(p)
    for group in groups:
        fresh = [p for p in params_of.get(group, []) if _is_released(p)]
        for p in fresh:
            _give_storage(p, device)
        if not fresh:
            continue
        rng_devices = [device] if device.type == "cuda" else []
        with torch.random.fork_rng(devices=rng_devices), torch.no_grad():
            torch.manual_seed(_group_seed(seed, names[group]))
            for p in fresh:
                if p.is_floating_point():
                    p.fill_(float("nan"))  # what no initialiser writes stays NaN: found and filled below
                else:
                    p.zero_()
            for module in units.get(group, []):
                _initialise(module, model, init_weights)
            _fill_unwritten(model, fresh)
    for p in _unique(p for g in groups for p in params_of.get(g, [])):
        if id(p) not in needed:
            release(p)


def release(p: torch.Tensor) -> None:
    """Free a parameter's (or buffer's) storage: it goes back to the meta device, keeping its identity. When autograd
    still holds it (swap_tensors refuses), it keeps its device with an empty storage and its shape is remembered:
    materialize() gives it storage again."""
    if p.device.type == "meta" or _RELEASED_SHAPE in p.__dict__:
        return
    try:
        _swap_data(p, torch.empty_like(p, device="meta"))
    except RuntimeError:
        shape = tuple(p.shape)
        p.data = torch.empty(0, dtype=p.dtype, device=p.device)
        setattr(p, _RELEASED_SHAPE, shape)


def release_block(block: nn.Module) -> None:
    """Let go of a block's parameters once it has run: their gradients are dropped (a gradient would keep its own
    storage) and each goes back to the meta device, keeping its identity, so every view, stage and tie that holds it
    sees it released and materialize() can give it storage again."""
    for p in block.parameters():
        p.grad = None
        release(p)


_RELEASED_SHAPE = "_autotune_released_shape"


def _is_released(p: torch.Tensor) -> bool:
    return p.device.type == "meta" or _RELEASED_SHAPE in p.__dict__


def _give_storage(p: torch.Tensor, device: torch.device) -> None:
    if p.device.type == "meta":
        _swap_data(p, torch.empty_like(p, device=device))
        return
    shape = p.__dict__.pop(_RELEASED_SHAPE)
    if p.device == device:
        p.data = torch.empty(shape, dtype=p.dtype, device=device)
    else:
        _swap_data(p, torch.empty(shape, dtype=p.dtype, device=device))


def _swap_data(p: torch.Tensor, data: torch.Tensor) -> None:
    """Replace p's tensor by `data` in place (p stays the same Python object, with its attributes)."""
    new: torch.Tensor = nn.Parameter(data, requires_grad=p.requires_grad) if isinstance(p, nn.Parameter) else data
    attributes = dict(p.__dict__)
    attributes.pop("_is_hf_initialized", None)  # new storage is not initialised, whatever the flag says
    torch.utils.swap_tensors(p, new)
    p.__dict__.clear()
    p.__dict__.update(attributes)


def _group_seed(seed: int, name: str) -> int:
    return zlib.crc32(f"{seed}:{name}".encode())


def _init_units(model: nn.Module, home: dict[int, int]) -> dict[int, list[nn.Module]]:
    """group -> the modules whose parameters (all of them, at any depth) have that home, children before parents.
    A module spanning several groups (a model's top module holding a ViT's cls_token) is not called: a call
    would draw random numbers for parameters of other groups, so values would depend on which groups are real."""
    units: dict[int, list[nn.Module]] = {}
    seen: set[int] = set()

    def visit(module: nn.Module) -> set[int | None]:
        homes: set[int | None] = set()
        for child in module.children():
            if id(child) in seen:
                homes |= {home.get(id(p)) for p in child.parameters()}
                continue
            seen.add(id(child))
            homes |= visit(child)
        homes |= {home.get(id(p)) for p in module.parameters(recurse=False)}
        if len(homes) == 1 and None not in homes:
            units.setdefault(next(iter(homes)), []).append(module)  # type: ignore[arg-type]
        return homes

    seen.add(id(model))
    visit(model)
    return units


def _initialise(module: nn.Module, model: nn.Module, init_weights: InitFn | None) -> None:
    hf_init = getattr(model, "_init_weights", None)
    if is_transformers_model(model) and callable(hf_init):
        hf_init(module)
    else:
        reset = getattr(module, "reset_parameters", None)
        if callable(reset):
            reset()
    if init_weights is not None:
        init_weights(module)


def _fill_unwritten(model: nn.Module, params: list[nn.Parameter]) -> None:
    """Entries no initialiser wrote (still NaN) get normal(0, FALLBACK_STD) draws, from the group's generator."""
    names = {id(p): name for name, p in model.named_parameters(remove_duplicate=False)}
    for p in params:
        if not p.is_floating_point():
            continue
        unwritten = torch.isnan(p)
        if bool(unwritten.any()):
            logger.info("no initialiser wrote %s: normal(0, %s); define init_weights(module) in the model file "
                        "to choose", names.get(id(p), "a parameter"), FALLBACK_STD)
            p.copy_(torch.where(unwritten, torch.randn_like(p) * FALLBACK_STD, p))


def _unique(params: Any) -> list[nn.Parameter]:
    seen: dict[int, nn.Parameter] = {}
    for p in params:
        seen.setdefault(id(p), p)
    return list(seen.values())
