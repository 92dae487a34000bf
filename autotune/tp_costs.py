"""Pure: a layer's costs on one rank of its tensor-parallel group, from its costs at tp 1 (the profile) and what the
model's plan does to it (costs.TensorParallelLayer). A tp candidate's pipeline is simulated on these costs, so the
simulator, the planner's bounds and splits and its memory caps all see the same tp terms; at tp 1 they are the
profile's, unchanged.

    compute (forward, backward)      the sharded part / (tp x link.tensor_parallel_efficiency), the rest whole; the
                                     sharded part is the layer's sharded share of its parameter bytes (a block's
                                     norms and residual adds are a sliver of it)
    a forward all-reduce             of the layer's output, a ring over tp on the intra-node link (tp ranks share a
                                     node), + link.tensor_parallel_overhead_ms for the runtime's part of each call
    a forward all-gather             of the layer's output (a head's logits)
    a backward all-reduce            of the layer's input (a column-wise projection's input gradient)
    checkpointed                     the recomputed forward runs its collectives again
    the loss                         whole on every tp rank (its logits are gathered first)
    parameters, gradients, state     memory_model.tp_parameter_bytes
    saved activations                memory_model.tp_saved_bytes (hidden states whole, the rest / tp)
    output (what crosses stages)     whole: no sequence parallelism

Without terms in the profile (a model without a plan, or a profile recorded before them; `plan --profile
--tensor-parallel`), a decoder-only transformer is assumed by position: the first layer an embedding (one forward
all-reduce), the last a head (an all-gather of its output, one backward all-reduce), two all-reduces each way in
every layer between (Megatron's count for a block), all parameters sharded.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Protocol

from autotune.costs import LayerCost, Profile, TensorParallelLayer
from autotune.memory_model import tp_parameter_bytes, tp_saved_bytes

__all__ = ["TensorParallelCosts", "default_terms", "tensor_parallel_costs", "tensor_parallel_layer_costs"]


class TensorParallelLink(Protocol):
    """What the tp terms read of the link (simulate.LinkModel)."""

    @property
    def tensor_parallel_efficiency(self) -> float: ...
    @property
    def tensor_parallel_overhead_ms(self) -> float: ...
    def allreduce_ms(self, nbytes: float, world_size: int, n_nodes: int = 1) -> float: ...
    def all_gather_ms(self, nbytes: float, world_size: int, n_nodes: int = 1) -> float: ...


@dataclass(frozen=True, kw_only=True)
class TensorParallelCosts:
    """The costs of every layer on one tp rank, and the collectives' share of them."""

    layers: list[LayerCost]
    """Per layer, as LayerCost at the micro-batch size: compute split, collectives added, bytes on one tp rank."""
    collective_ms: list[float]
    """Per layer, the tp collectives of one micro-batch, forward and backward (part of layers' times)."""


def default_terms(parameter_bytes: Sequence[int]) -> tuple[TensorParallelLayer, ...]:
    """A decoder-only transformer's tp pattern by position (module docstring), all parameters sharded."""
    n = len(parameter_bytes)
    terms = []
    for i, nbytes in enumerate(parameter_bytes):
        if n > 1 and i == 0:
            counts = (1, 0, 0)
        elif n > 1 and i == n - 1:
            counts = (0, 1, 1)
        else:
            counts = (2, 2, 0)
        terms.append(TensorParallelLayer(sharded_parameter_bytes=nbytes, forward_all_reduces=counts[0],
                                         backward_all_reduces=counts[1], forward_all_gathers=counts[2]))
    return tuple(terms)


def tensor_parallel_costs(
    costs: Sequence[LayerCost],
    tp: int,
    *,
    terms: Sequence[TensorParallelLayer],
    input_bytes: int,
    link: TensorParallelLink,
    loss_forward_ms: float = 0.0,
    loss_backward_ms: float = 0.0,
) -> TensorParallelCosts:
    """The layers' costs (at one micro-batch size, the loss's times inside the last layer's as Profile.layer_costs
    charges them) on one rank of a tp group of `tp` (module docstring). tp 1: the costs as they are."""
    if tp == 1:
        return TensorParallelCosts(layers=list(costs), collective_ms=[0.0] * len(costs))
    efficiency = link.tensor_parallel_efficiency
    overhead = link.tensor_parallel_overhead_ms
    layers: list[LayerCost] = []
    collectives: list[float] = []
    last = len(costs) - 1
    for i, (cost, term) in enumerate(zip(costs, terms, strict=True)):
        fraction = min(1.0, term.sharded_parameter_bytes / cost.parameter_bytes) if cost.parameter_bytes else 0.0
        scale = 1.0 - fraction + fraction / (tp * efficiency)
        into = input_bytes if i == 0 else costs[i - 1].output_bytes
        forward_comm = (term.forward_all_reduces * (link.allreduce_ms(cost.output_bytes, tp) + overhead)
                        + term.forward_all_gathers * (link.all_gather_ms(cost.output_bytes, tp) + overhead))
        backward_comm = term.backward_all_reduces * (link.allreduce_ms(into, tp) + overhead)
        loss_f, loss_b = (loss_forward_ms, loss_backward_ms) if i == last else (0.0, 0.0)
        own_forward = cost.forward_ms - loss_f
        checkpointed = cost.checkpointed_forward_ms if cost.checkpointed_forward_ms is not None else cost.forward_ms
        recompute = cost.recompute_ms if cost.recompute_ms is not None else own_forward

        def split(nbytes: int, c: LayerCost = cost, f: float = fraction) -> int:
            """Activation bytes of the layer on one tp rank (tp_saved_bytes)."""
            return tp_saved_bytes(nbytes, c.output_bytes, sharded_fraction=f, tp=tp)

        layers.append(replace(
            cost,
            forward_ms=own_forward * scale + loss_f + forward_comm,
            backward_input_ms=(cost.backward_input_ms - loss_b) * scale + loss_b + backward_comm,
            backward_weight_ms=cost.backward_weight_ms * scale,
            checkpointed_forward_ms=(checkpointed - loss_f) * scale + loss_f + forward_comm,
            recompute_ms=recompute * scale + forward_comm,
            saved_bytes=tp_saved_bytes(cost.saved_bytes, cost.output_bytes, sharded_fraction=fraction, tp=tp),
            # a backward's temporaries (an MLP's hidden gradient, attention's) split over tp as what it saved
            backward_bytes=None if cost.backward_bytes is None else cost.backward_bytes.map(split),
            # a checkpointed W keeps recomputed activations: split as what they are
            checkpoint_weight_bytes=None if cost.checkpoint_weight_bytes is None else split(
                cost.checkpoint_weight_bytes),
            checkpoint_passes=None if cost.checkpoint_passes is None else cost.checkpoint_passes.map(split),
            parameter_bytes=round(tp_parameter_bytes(cost.parameter_bytes, term.sharded_parameter_bytes, tp)),
            autocast_copy_bytes=round(cost.autocast_copy_bytes * (1.0 - fraction + fraction / tp)),
        ))
        collectives.append(forward_comm + backward_comm)
    return TensorParallelCosts(layers=layers, collective_ms=collectives)


def tensor_parallel_layer_costs(
    profile: Profile, micro_batch_size: float, tp: int, link: TensorParallelLink
) -> TensorParallelCosts:
    """Profile.layer_costs at a micro-batch size, on one rank of a tp group (tensor_parallel_costs with the
    profile's terms, or default_terms)."""
    costs = profile.layer_costs(micro_batch_size)
    if tp == 1:
        return tensor_parallel_costs(costs, 1, terms=(), input_bytes=0, link=link)
    at = micro_batch_size
    terms = profile.tensor_parallel_layers or default_terms([layer.parameter_bytes for layer in profile.layers])
    loss_forward = profile.loss_forward_ms_at(at)
    loss_backward = profile.loss_backward_ms_at(at)
    return tensor_parallel_costs(costs, tp, terms=terms, input_bytes=profile.input_bytes_at(at), link=link,
                                 loss_forward_ms=loss_forward, loss_backward_ms=loss_backward)
