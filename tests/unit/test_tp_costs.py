"""Tensor parallel in the simulator, the memory model and the planner (autotune.tp_costs): one layer's costs on one tp
rank against hand-worked tables, the step time of a tp candidate in closed form, and tp layouts in the ranking."""

from __future__ import annotations

from dataclasses import dataclass, replace

import pytest

from autotune.candidate import Candidate
from autotune.costs import LayerCost, Profile, TensorParallelLayer
from autotune.memory_model import tp_parameter_bytes, tp_saved_bytes
from autotune.plan import plan
from autotune.schedules import Schedule
from autotune.simulate import LinkModel, simulate
from autotune.tp_costs import default_terms, tensor_parallel_costs


@dataclass(frozen=True)
class FakeLink:
    """An all-reduce of n bytes takes n / 100 ms, an all-gather n / 200 ms, whatever tp."""

    tensor_parallel_efficiency: float = 0.8
    tensor_parallel_overhead_ms: float = 0.5

    def allreduce_ms(self, nbytes: float, world_size: int, n_nodes: int = 1) -> float:
        return nbytes / 100

    def all_gather_ms(self, nbytes: float, world_size: int, n_nodes: int = 1) -> float:
        return nbytes / 200


EMBEDDING = LayerCost(forward_ms=1.0, backward_input_ms=0.0, backward_weight_ms=0.4, saved_bytes=8, output_bytes=100,
                      parameter_bytes=1000)
BLOCK = LayerCost(forward_ms=4.0, backward_input_ms=4.0, backward_weight_ms=4.0, saved_bytes=1000, output_bytes=100,
                  parameter_bytes=2000)
HEAD = LayerCost(forward_ms=2.5, backward_input_ms=2.5, backward_weight_ms=2.0, saved_bytes=600, output_bytes=400,
                 parameter_bytes=1000)  # the loss's 0.5 ms forward and 0.5 ms backward inside, as layer_costs puts it
TERMS = (
    TensorParallelLayer(sharded_parameter_bytes=1000, forward_all_reduces=1),
    TensorParallelLayer(sharded_parameter_bytes=1800, forward_all_reduces=2, backward_all_reduces=5),  # norms whole
    TensorParallelLayer(sharded_parameter_bytes=1000, backward_all_reduces=1, forward_all_gathers=1),
)


def test_one_tp_rank_of_an_embedding_a_block_and_a_head():
    """tp 2 at 80 % efficiency: the sharded part of compute x 1 / 1.6 = 0.625 (the block: 0.1 + 0.9 x 0.625 =
    0.6625); each collective its wire time + 0.5 ms; the loss whole; parameters' sharded bytes and the block's
    activations beyond 4 x its output halved in proportion; the head's saved bytes (within 4 x its output) whole."""
    got = tensor_parallel_costs([EMBEDDING, BLOCK, HEAD], 2, terms=TERMS, input_bytes=50, link=FakeLink(),
                                loss_forward_ms=0.5, loss_backward_ms=0.5)
    table = [x for c in got.layers for x in (c.forward_ms, c.backward_input_ms, c.backward_weight_ms, c.saved_bytes,
                                             c.output_bytes, c.parameter_bytes)]
    assert table == pytest.approx([
        # forward: compute + 1 all-reduce of 100 B (1.0 + 0.5)
        *(0.625 + 1.5, 0.0, 0.25, 8, 100, 500),
        # forward: 2 all-reduces (3.0); input grad: 5 all-reduces of its 100 B input (7.5); saved 400 + 600 x 0.9 / 2
        *(2.65 + 3.0, 2.65 + 7.5, 2.65, 730, 100, 200 + 900),
        # forward: 2.0 x 0.625 + loss 0.5 + all-gather of 400 B (2.0 + 0.5); input grad: + loss 0.5 + 1 all-reduce
        *(1.25 + 0.5 + 2.5, 1.25 + 0.5 + 1.5, 1.25, 600, 400, 500),
    ])
    assert got.collective_ms == pytest.approx([1.5, 10.5, 4.0])
    checkpointed = [x for c in got.layers for x in (c.checkpointed_forward_ms, c.recompute_ms)]
    assert checkpointed == pytest.approx([2.125, 2.125, 5.65, 5.65, 4.25, 1.25 + 2.5])  # recompute: no loss


def test_tp_1_leaves_the_costs_as_they_are():
    got = tensor_parallel_costs([EMBEDDING, BLOCK, HEAD], 1, terms=(), input_bytes=50, link=FakeLink())
    assert got.layers == [EMBEDDING, BLOCK, HEAD] and got.collective_ms == [0.0, 0.0, 0.0]


def test_without_recorded_terms_a_transformer_is_assumed_by_position():
    assert [(t.sharded_parameter_bytes, t.forward_all_reduces, t.backward_all_reduces, t.forward_all_gathers)
            for t in default_terms([10, 20, 20, 30])] == [(10, 1, 0, 0), (20, 2, 2, 0), (20, 2, 2, 0), (30, 0, 1, 1)]
    assert default_terms([7])[0].forward_all_reduces == 2


@pytest.mark.parametrize("saved,output,fraction,tp,want", [
    (1000, 100, 1.0, 2, 700),   # 400 whole, 600 split
    (1000, 100, 1.0, 4, 550),
    (1000, 100, 0.0, 4, 1000),  # a layer the plan leaves whole
    (300, 100, 1.0, 8, 300),    # all of it within 4 x the output: whole
])
def test_saved_activations_on_one_tp_rank(saved, output, fraction, tp, want):
    assert tp_saved_bytes(saved, output, sharded_fraction=fraction, tp=tp) == want


def test_parameter_bytes_on_one_tp_rank():
    assert tp_parameter_bytes(2000, 1800, 4) == 200 + 450
    assert tp_parameter_bytes(2000, 0, 4) == 2000


LINK = LinkModel(bandwidth_bytes_per_s=1e30, latency_s=0.0, per_action_overhead_ms=0.0, optimizer_bytes_per_s=1e30,
                 tensor_parallel_efficiency=1.0, tensor_parallel_overhead_ms=1.0)
"""Free wires and optimizer, 1 ms per tp collective: a step is its compute plus 1 ms per collective."""


def profile(terms: tuple[TensorParallelLayer, ...] = TERMS) -> Profile:
    p = Profile.from_layer_costs([EMBEDDING, BLOCK, HEAD], micro_batch_size=2, input_bytes=50)
    return replace(p, tensor_parallel_layers=terms)


def candidate(tp: int, **more: object) -> Candidate:
    return Candidate(schedule=Schedule.GPIPE, pipeline_degree=1, tensor_parallel_degree=tp, global_batch_size=4,
                     n_microbatches=2, layers_per_stage=(3,), **more)  # type: ignore[arg-type]


def test_a_tp_step_is_half_the_compute_plus_its_collectives():
    """pp 1, 2 micro-batches: tp 1 runs 2 x 26.4 ms of compute; tp 2 half of it (the block's norms stay whole:
    0.1 of its 12 ms) and 2 x 10 collectives of 1 ms; the estimate names the collectives' share."""
    whole = simulate(profile(), candidate(1), link=LINK)
    compute = EMBEDDING.forward_ms + EMBEDDING.backward_ms + BLOCK.forward_ms + BLOCK.backward_ms \
        + HEAD.forward_ms + HEAD.backward_ms
    assert whole.step_time_ms == pytest.approx(2 * compute) and whole.tensor_parallel_ms == 0
    split = simulate(profile(), candidate(2), link=LINK)
    half = (EMBEDDING.forward_ms + EMBEDDING.backward_ms + HEAD.forward_ms + HEAD.backward_ms) / 2 \
        + (BLOCK.forward_ms + BLOCK.backward_ms) * 0.55
    assert split.step_time_ms == pytest.approx(2 * (half + 10))
    assert split.tensor_parallel_ms == pytest.approx(2 * 10)
    assert split.peak_memory_bytes[0] < whole.peak_memory_bytes[0]


def test_the_planner_ranks_tp_layouts_beside_pp_and_dp():
    """2 GPUs: under a limit that only tp 2 fits (it halves parameters, their state and the block's activations;
    FSDP's replicas gather whole stages) pp 1 x tp 2 ranks first; without a limit, at 1 ms a collective, it ranks
    behind the replicas, but is still ranked (each degree's cheapest point escapes the planner's pruning); tp 1
    predictions are the same with or without tp in the plan."""
    p = profile()
    cheap = replace(LINK, tensor_parallel_overhead_ms=0.0)
    with_tp = plan(p, gpus=2, batch_size=4, memory_limit_bytes=12_000, link=cheap, tensor_parallel_degrees=(1, 2))
    best = with_tp[0]
    assert (best.candidate.tensor_parallel_degree, best.candidate.world_size, best.estimate.feasible) == (2, 2, True)
    assert all(x.candidate.tensor_parallel_degree == 2 for x in with_tp if x.estimate.feasible)
    costly = plan(p, gpus=2, batch_size=4, memory_limit_bytes=None, link=LINK, tensor_parallel_degrees=(1, 2))
    assert costly[0].candidate.tensor_parallel_degree == 1
    assert any(x.candidate.tensor_parallel_degree == 2 for x in costly)
    without = {x.candidate.key: x.estimate
               for x in plan(p, gpus=2, batch_size=4, memory_limit_bytes=None, link=LINK, prune_within=None)}
    for x in costly:
        if x.candidate.tensor_parallel_degree == 1:
            assert x.estimate == without[x.candidate.key]
    assert x.to_dict()["tensor_parallel_degree"] in (1, 2)


def test_profile_keeps_its_tensor_parallel_terms():
    p = profile()
    assert Profile.from_dict(p.to_dict()).tensor_parallel_layers == TERMS
    assert "tensor_parallel_layers" not in profile(()).to_dict()
