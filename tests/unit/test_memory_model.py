"""One memory model: the planner's per-stage cap and the simulator's per-rank peak count the same bytes."""

from __future__ import annotations

import pytest

from autotune.candidate import Candidate
from autotune.costs import LayerCost, Profile
from autotune.memory_model import held_per_microbatch, receive_buffer_bytes, stage_memory_bytes
from autotune.plan import _Costs
from autotune.schedules import Schedule
from autotune.simulate import LinkModel, max_in_flight, simulate

LINK = LinkModel.for_device("cpu")


def profile() -> Profile:
    layers = [LayerCost(forward_ms=1.0, backward_input_ms=1.0, backward_weight_ms=1.0, saved_bytes=1000 * (i + 1),
                        output_bytes=100, parameter_bytes=400) for i in range(4)]
    return Profile.from_layer_costs(layers, micro_batch_size=4, input_bytes=50)


@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize("wire", ["float32", "bfloat16"])
def test_one_stage_alone_is_what_the_simulator_peaks_at(checkpointing, wire):
    """With one rank holding one stage, the simulator's walk peaks at the planner's per-stage figure."""
    c = Candidate(schedule=Schedule.GPIPE, pipeline_degree=1, global_batch_size=16, n_microbatches=4,
                  layers_per_stage=(4,), activation_checkpointing=checkpointing, wire_dtype=wire)
    peak = simulate(profile(), c, link=LINK, with_timeline=False).peak_memory_bytes[0]
    expected = stage_memory_bytes(parameter_bytes=1600, saved=10_000, stage_in=50, stage_out=100, in_flight=4,
                                  candidate=c, first=True, last=True, optimizer_state_ratio=2.0)
    assert peak == pytest.approx(expected, abs=1)


def test_the_planner_caps_stages_with_the_memory_model():
    c = Candidate(schedule=Schedule.ONE_F_ONE_B, pipeline_degree=2, global_batch_size=16, n_microbatches=4,
                  layers_per_stage=(2, 2), wire_dtype="bfloat16")
    stage_memory = _Costs(profile(), 4, LINK).stage_memory(c)
    in_flight = max_in_flight(c.schedule, 2, 4, 2)
    assert stage_memory(0, 0, 2) == stage_memory_bytes(
        parameter_bytes=800, saved=3000, stage_in=50, stage_out=100, in_flight=in_flight[0], candidate=c,
        first=True, last=False, optimizer_state_ratio=2.0,
    )


def test_rules():
    c = Candidate(schedule=Schedule.GPIPE, pipeline_degree=2, global_batch_size=16, n_microbatches=4,
                  layers_per_stage=(2, 2), wire_dtype="bfloat16")
    assert receive_buffer_bytes(50, 100, candidate=c, first=True, last=False) == 4 * 100 * 0.5
    assert receive_buffer_bytes(50, 100, candidate=c, first=False, last=True) == 4 * 50 * 0.5
    assert held_per_microbatch(3000, 50, 100, candidate=c, last=False) == 3000 + 50  # the output travels as bf16
    assert held_per_microbatch(3000, 50, 100, candidate=c, last=True) == 3000 + 100  # the loss reads it as is
