"""Run a BlockModel cut into stages the way a pipeline does (each stage on its own graph, gradients handed back
across every boundary) and compare with the model's own forward and backward."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from autotune.models import BlockModel


def pipelined(
    model: BlockModel, inputs: Any, cuts: Sequence[int], loss_fn: Callable[[Any, Any], torch.Tensor], target: Any
) -> tuple[Any, torch.Tensor]:
    """Forward stage by stage with detached boundaries, the loss on the last, then backward stage by stage.
    Returns (last stage output, loss); parameter gradients are left in .grad."""
    args, side = model.split_inputs(inputs)
    bounds = [0, *cuts, model.n_blocks]
    carried: tuple[Any, ...] = args
    received: list[tuple[torch.Tensor, ...]] = []
    sent: list[tuple[torch.Tensor, ...]] = []
    out: Any = None
    for s, (start, stop) in enumerate(itertools.pairwise(bounds)):
        if s > 0:  # what a receiving stage gets: fresh leaves, needing a gradient when the sent tensor does
            carried = tuple(t.detach().requires_grad_(t.requires_grad) for t in carried)
        received.append(carried)
        out = model.stage(start, stop)(*carried, **side)
        if stop < model.n_blocks:
            assert isinstance(out, (torch.Tensor, tuple)), f"stage [{start}, {stop}) returned {type(out)}"
            carried = out if isinstance(out, tuple) else (out,)
            assert all(isinstance(t, torch.Tensor) for t in carried)
            sent.append(carried)
    loss = loss_fn(out, target)
    loss.backward()
    for s in range(len(sent) - 1, -1, -1):  # stage s gets the input gradients of stage s + 1
        pairs = [(o, i.grad) for o, i in zip(sent[s], received[s + 1]) if i.grad is not None]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
    return out, loss


def reference(model: BlockModel, inputs: Any, loss_fn: Callable[[Any, Any], torch.Tensor], target: Any) -> Any:
    out = model.reference(inputs)
    loss_fn(out, target).backward()
    return out


def grads(module: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.grad.clone() for name, p in module.named_parameters() if p.grad is not None}


def assert_cuts_match(
    model: BlockModel,
    inputs: Any,
    loss_fn: Callable[[Any, Any], torch.Tensor],
    target: Any,
    *,
    three_way: bool = True,
    rtol: float = 1.3e-6,
    atol: float = 1e-5,
) -> int:
    """For every 2-way cut (and every 3-way cut): the last stage's output, the loss and every parameter gradient
    equal the model's own. Returns the number of cuts checked."""
    net = model.model
    net.zero_grad(set_to_none=True)
    torch.manual_seed(0)
    want = reference(model, inputs, loss_fn, target)
    want_grads = grads(net)
    assert want_grads, "the reference produced no gradients"
    n = model.n_blocks
    cuts: list[tuple[int, ...]] = [(k,) for k in range(1, n)]
    if three_way:
        cuts += list(itertools.combinations(range(1, n), 2))
    for cut in cuts:
        net.zero_grad(set_to_none=True)
        torch.manual_seed(0)
        got, _ = pipelined(model, inputs, cut, loss_fn, target)
        torch.testing.assert_close(got, want, rtol=rtol, atol=atol, msg=lambda m, c=cut: f"cut {c}: {m}")
        got_grads = grads(net)
        assert got_grads.keys() == want_grads.keys(), f"cut {cut}: gradients of {set(got_grads) ^ set(want_grads)}"
        try:  # one comparison over all gradients (fast), then per parameter to name the culprit
            torch.testing.assert_close(_flat(got_grads), _flat(want_grads), rtol=rtol, atol=atol)
        except AssertionError:
            for name, g in want_grads.items():
                torch.testing.assert_close(got_grads[name], g, rtol=rtol, atol=atol,
                                           msg=lambda m, c=cut, p=name: f"cut {c}, {p}: {m}")
            raise
    net.zero_grad(set_to_none=True)
    return len(cuts)


def _flat(tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.flatten() for t in tensors.values()])


def every_parameter_in_a_block(model: BlockModel) -> None:
    held = {id(p) for block in model.blocks for p in block.parameters()}
    missing = [name for name, p in model.model.named_parameters() if id(p) not in held]
    assert not missing, f"parameters in no block: {missing}"


def stage_parameters_are_blocks(model: BlockModel) -> None:
    """A stage holds exactly the parameters of its blocks."""
    n = model.n_blocks
    for start, stop in [(0, 1), (0, n), (n - 1, n), (1, max(2, n - 1))]:
        stage = model.stage(start, stop)
        want = {id(p) for block in model.blocks[start:stop] for p in block.parameters()}
        assert {id(p) for p in stage.parameters()} == want, (start, stop)
