"""One memory model: the planner's per-stage cap and the simulator's per-rank peak count the same bytes."""

from __future__ import annotations

import dataclasses

import pytest

from autotune.candidate import Candidate
from autotune.costs import BackwardBytes, LayerCost, Profile
from autotune.memory_model import (
    autocast_copy_bytes,
    batch_bytes,
    boundary_shared,
    cast_on_wire,
    dp_shards,
    first_weight_bytes,
    gather_buffer_bytes,
    gradient_shard_bytes,
    gradients_made_in_step,
    held_per_microbatch,
    input_backward_bytes,
    input_held_elsewhere_bytes,
    layer_backward_bytes,
    loss_backward_bytes,
    optimizer_step_bytes,
    output_saved_bytes,
    parameter_memory_bytes,
    receive_buffer_bytes,
    reduce_buffer_bytes,
    sends_kept_to_the_end,
    sent_bytes,
    split_kept_bytes,
    stage_memory_bytes,
    unsharded_gradient_bytes,
    weight_gradient_factor,
    wire_bytes,
    wire_factor,
    working_copy_bytes,
)
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
    """With one rank holding one stage, the simulator's walk peaks near the planner's per-stage figure: the planner
    counts the stage's gradients (1600) for the whole step, the simulator from the stage's first backward on (torch
    lets them go after each step), and leaves out the batch's inputs (less the saved inputs, views of it) and a
    backward's temporaries (at most the worst layer's weight, input and output gradients, 400 + 100 + 100, or the
    loss's 2 x 100)."""
    c = Candidate(schedule=Schedule.GPIPE, pipeline_degree=1, global_batch_size=16, n_microbatches=4,
                  layers_per_stage=(4,), activation_checkpointing=checkpointing, wire_dtype=wire)
    peak = simulate(profile(), c, link=LINK, with_timeline=False).peak_memory_bytes[0]
    expected = stage_memory_bytes(parameter_bytes=1600, saved=10_000, stage_in=50, stage_out=100, in_flight=4,
                                  candidate=c, first=True, last=True, optimizer_state_ratio=2.0)
    batch = 4 * 50  # it replaces the 4 inputs the planner counts as saved (in the simulator, views of the batch)
    assert expected - 1600 <= peak <= expected + batch + 600
    if not checkpointing:  # the first backward with all 4 held, its last layer making its 400 of gradients
        assert peak == expected - 1600 + 400 + 100 + 100


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
    assert wire_bytes(100, None, candidate=c) == 50  # not profiled: fp32 with a bfloat16 wire halves it
    assert wire_bytes(100, 60, candidate=c) == 60  # profiled (an integer part travels as it is)
    assert wire_bytes(100, 60, candidate=dataclasses.replace(c, wire_dtype="float32")) == 100
    bf16 = dataclasses.replace(c, precision="bf16")
    assert wire_bytes(100, None, candidate=bf16) == 100  # not profiled: assumed made in bfloat16
    assert wire_bytes(100, 50, candidate=bf16) == 50  # a residual stream's float32, cast on leaving
    assert cast_on_wire(100, 50, candidate=bf16) and not cast_on_wire(50, 50, candidate=bf16)
    assert not cast_on_wire(100, 50, candidate=dataclasses.replace(c, wire_dtype="float32"))
    assert receive_buffer_bytes(25, 50, candidate=c, first=True, last=False) == 4 * 50
    assert receive_buffer_bytes(25, 50, candidate=c, first=False, last=True) == 4 * 25
    assert held_per_microbatch(3000, 50, 50, candidate=c) == 3000 + 50
    assert held_per_microbatch(3000, 50, 50, candidate=dataclasses.replace(c, activation_checkpointing=True)) == 100


def test_rules_of_sends_backwards_split_and_optimizer():
    c = Candidate(schedule=Schedule.ZBV_ZERO_BUBBLE, pipeline_degree=2, global_batch_size=16, n_microbatches=4,
                  layers_per_stage=(1, 1, 1, 1), wire_dtype="bfloat16")
    assert sends_kept_to_the_end(Schedule.GPIPE) and sends_kept_to_the_end(Schedule.ZBV_ZERO_BUBBLE)
    assert not sends_kept_to_the_end(Schedule.ONE_F_ONE_B)
    assert sent_bytes(25, 50, first=False, last=False) == (50.0, 25.0)  # output, input grad, as they travel
    assert sent_bytes(25, 50, first=True, last=True) == (0.0, 0.0)
    # Worst layer: the second, with its 800 weight-gradient bytes and its 100 input gradient (the output gradient
    # of the stage's last layer is the receive buffer's).
    assert layer_backward_bytes([400, 800], [50, 100], [100, 60], first=True, last=False) == 800 + 100
    assert layer_backward_bytes([400, 800], [50, 100], [100, 60], first=True, last=False, weights="elsewhere") == 100
    assert layer_backward_bytes([400, 800], [50, 100], [100, 60], first=False, last=True) == 800 + 100 + 60
    # A first backward keeping its gradients: the first layer's 400 on top of the 800 the second made.
    assert layer_backward_bytes([400, 800], [50, 100], [100, 60], first=True, last=False, weights="kept") == (
        800 + 400 + 100)
    # ... unless what the second layer saved (1000) is gone by then.
    assert layer_backward_bytes([400, 800], [50, 100], [100, 60], first=True, last=False, weights="kept",
                                freed=[300, 1000]) == 800 + 100
    assert loss_backward_bytes(60) == 120
    assert split_kept_bytes([300, 500], [100, 200], first=False) == 200 + 300
    assert split_kept_bytes([300, 500], [100, 200], first=True) == 0
    # The inputs where the first stage is, the targets where the last is (4 micro-batches).
    assert batch_bytes(50, 10, candidate=c, first=True, last=False) == 200
    assert batch_bytes(50, 10, candidate=c, first=True, last=True) == 240
    assert batch_bytes(50, 10, candidate=c, first=False, last=False) == 0
    # Per tensor (CPU): the model's peak (2 x 400) scaled by the rank's largest layer (100) over the model's (300).
    assert optimizer_step_bytes(2.0, [100], [100, 300], [100], [100, 300], per_tensor=True) == pytest.approx(800 / 3)
    assert optimizer_step_bytes(2.0, [100], [100, 300], [100], [100, 300], per_tensor=False) == 200


def test_a_tensor_between_two_stages_is_counted_once():
    """fp32 with a float32 wire, the output a stage sends is the tensor its last layer saved (a ReLU's) and the
    receive buffer the tensor the next stage's first layer saved (a LayerNorm's): each counted once, as the stage's
    kept output and as the receive buffer; a bfloat16 wire casts a float32 output on leaving and what arrives back
    to float32, so there both are copies; a bfloat16 output leaves as it is (the sender's side stays shared), and
    FSDP2's bf16 computes on what arrives (the receiver's does)."""
    c = Candidate(schedule=Schedule.ONE_F_ONE_B, pipeline_degree=2, global_batch_size=4, n_microbatches=4,
                  layers_per_stage=(1, 1))
    assert boundary_shared(c) and not boundary_shared(dataclasses.replace(c, wire_dtype="bfloat16"))
    assert not boundary_shared(dataclasses.replace(c, precision="bf16"))
    sharded_bf16 = dataclasses.replace(c, precision="bf16", pipeline_degree=1, data_parallel_degree=2,
                                       data_parallel_mode="shard", layers_per_stage=(2,))
    assert boundary_shared(sharded_bf16)
    assert output_saved_bytes(100, 100, candidate=c, last=False) == 100
    assert output_saved_bytes(100, 100, candidate=dataclasses.replace(c, wire_dtype="bfloat16"), last=False,
                              cast_out=True) == 0
    assert output_saved_bytes(100, 100, candidate=dataclasses.replace(c, precision="bf16"), last=False) == 100
    assert output_saved_bytes(100, 100, candidate=dataclasses.replace(c, activation_checkpointing=True),
                              last=False) == 0  # the checkpoint saves nothing inside
    assert input_held_elsewhere_bytes(100, 300, 100, candidate=c, first=False) == 100
    assert input_held_elsewhere_bytes(100, 300, 0, candidate=c, first=False) == 0  # a ReLU first: saves no input
    assert input_held_elsewhere_bytes(100, 300, None, candidate=c, first=False) == 0  # not profiled
    assert input_held_elsewhere_bytes(100, 300, None, candidate=c, first=True) == 100  # the batch's view
    bf16_wire = dataclasses.replace(c, wire_dtype="bfloat16")
    assert input_held_elsewhere_bytes(100, 300, 100, candidate=bf16_wire, first=False) == 0  # cast on arrival
    assert input_held_elsewhere_bytes(100, 300, 100, candidate=bf16_wire, first=True) == 100
    ckpt = dataclasses.replace(c, activation_checkpointing=True)
    assert input_held_elsewhere_bytes(100, 300, 0, candidate=ckpt, first=False) == 100  # the checkpoint's input
    # In the walk: stage 0 saves its 1000-byte output (ReLU-like), stage 1 its 1000-byte input (LayerNorm-like).
    relu = LayerCost(forward_ms=1.0, backward_input_ms=1.0, backward_weight_ms=1.0, saved_bytes=3000,
                     output_bytes=1000, parameter_bytes=0, saved_input_bytes=0, saved_output_bytes=1000)
    norm = dataclasses.replace(relu, saved_input_bytes=1000, saved_output_bytes=0)
    costs = Profile.from_layer_costs([relu, norm], micro_batch_size=1, input_bytes=0)
    counted_once = simulate(costs, c, link=LINK, with_timeline=False).peak_memory_bytes
    old = Profile.from_layer_costs([dataclasses.replace(x, saved_input_bytes=None, saved_output_bytes=0)
                                    for x in (relu, norm)], micro_batch_size=1, input_bytes=0)
    counted_twice = simulate(old, c, link=LINK, with_timeline=False).peak_memory_bytes
    # 1F1B over 2 ranks: rank 0 holds 2 micro-batches in flight, rank 1 one.
    assert counted_twice[0] - counted_once[0] == 2 * 1000
    assert counted_twice[1] - counted_once[1] == 1000


def test_profiled_backward_bytes():
    """A layer's profiled backward (costs.BackwardBytes, (made inside, handed in)): a stage's last layer reads its
    output's gradient from the receive buffer (handed in), every other layer's is made inside (and counted in the
    figure); a later backward's fresh weight gradients are in the figure, a first one's stay (counted by the
    caller: "elsewhere", or with the figure: "kept")."""
    inner = BackwardBytes(first=(900, 700), later=(1000, 800), input_peak=(600, 400), input_kept=(300, 100))
    last_layer = BackwardBytes(first=(250, 150), later=(300, 200), input_peak=(120, 100), input_kept=(50, 0))
    params, ins, outs = [400, 100], [50, 200], [200, 60]
    profiled = [inner, last_layer]
    # Not the last stage: layer 1 (handed) 200; layer 0 (made) 1000 once layer 1 let go of its 600 saved.
    assert layer_backward_bytes(params, ins, outs, first=False, last=False, profiled=profiled,
                                freed=[0, 600]) == 1000 - 600
    assert layer_backward_bytes(params, ins, outs, first=False, last=False, profiled=profiled) == 1000
    # The last stage: layer 1's gradient comes from the loss: made inside, 300.
    assert layer_backward_bytes(params, ins, outs, first=False, last=True, profiled=profiled,
                                freed=[0, 900]) == 300
    # A first backward: the gradients it keeps counted elsewhere (900 - 400), or here (900 + the 100 made after).
    assert layer_backward_bytes(params, ins, outs, first=False, last=False, profiled=profiled,
                                weights="elsewhere") == 900 - 400
    assert layer_backward_bytes(params, ins, outs, first=False, last=False, profiled=profiled,
                                weights="kept") == 900 + 100
    # Sharded bf16: a later backward's fresh weight gradients are half the profiled float32 ones.
    assert layer_backward_bytes(params, ins, outs, first=False, last=False, profiled=profiled,
                                grad_factor=0.5) == 1000 - 200
    # Checkpointed, the last layer saved 150 of the stage's output (a ReLU's): the recompute's copy goes at its first
    # backward op, which holds at least the output's gradient (60): layer 1 300 - 150 = 150 (not the last stage: its
    # handed figure 200 - 150 = 50, held at least 60); never more than without.
    assert layer_backward_bytes(params, ins, outs, first=False, last=True, profiled=profiled, freed=[0, 900],
                                recomputed_output=150) == 300 - 150
    assert layer_backward_bytes([100], [200], [60], first=False, last=False, profiled=[last_layer],
                                recomputed_output=150) == 60
    assert layer_backward_bytes([100], [200], [60], first=False, last=False, profiled=[last_layer],
                                recomputed_output=10) == 200 - 10
    # The split backward's I keeps what each layer leaves and lets go of nothing saved: layer 1 (handed) 100 at
    # most, leaving 0; layer 0 600 at most on top, leaving 300. The first stage's I does nothing.
    assert input_backward_bytes(profiled, first=False, last=False) == (600, 300)
    assert input_backward_bytes(profiled, first=False, last=True) == (max(120, 50 + 600), 50 + 300)
    assert input_backward_bytes(profiled, first=True, last=False) == (0, 0)


def test_a_first_weight_pass_makes_gradients_layer_by_layer_and_lets_go_of_what_its_input_pass_kept(tmp_path):
    """torch's W (stage_backward_weight) runs a stage's parameter groups in order: each makes its gradients, which
    stay, and lets go of the output gradients the I kept for it. Measured on five 256-wide Linear + GELU layers
    under the live-tensor tracker, the W peaks at or under first_weight_bytes from the layers' profiled figures, by
    no more than the inputs its weight ops saved (which it also lets go of, not profiled); it counted the whole
    stage's gradients on top before (1.32 MB against 857 KB measured)."""
    import torch
    from torch import nn

    from autotune.compat import stage_backward_input, stage_backward_weight
    from autotune.model_file import load_model_file
    from autotune.profiling import profile_model
    from autotune.trial.memory import LiveTensorBytes

    width, batch, n = 256, 64, 5
    path = tmp_path / "mlp.py"
    path.write_text(
        "import torch\nfrom torch import nn\n"
        f"def build_model():\n    return nn.Sequential(*[nn.Sequential(nn.Linear({width}, {width}), nn.GELU()) "
        f"for _ in range({n})], nn.Linear({width}, 10))\n"
        f"def make_batch(b):\n    return torch.randn(b, {width}), torch.randint(0, 10, (b,))\n"
        "def loss_fn(out, target):\n    return nn.functional.cross_entropy(out, target)\n")
    costs = profile_model(load_model_file(path), batch_size=batch, repeats=1).layer_costs(batch)
    # blocks 0..4 as a middle stage: its last layer's output gradient handed in (the receive buffer)
    predicted = first_weight_bytes([c.parameter_bytes for c in costs[:n]],
                                   [c.backward_bytes.input_kept[int(i == n - 1)] for i, c in enumerate(costs[:n])])
    stage = nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(n)])
    weights = list(stage.parameters())
    received = torch.randn(batch, width, requires_grad=True)
    grad = torch.ones(batch, width)
    with LiveTensorBytes(alive=[*weights, received, grad]) as tracker:
        output = stage(received)
        _, groups = stage_backward_input([output], [grad], [received], weights)
        start = tracker.peak_bytes = tracker.live_bytes
        stage_backward_weight(weights, groups)
        measured = tracker.peak_bytes - start
    parameters = sum(p.numel() * 4 for p in weights)
    activation = batch * width * 4
    assert measured <= predicted <= measured + (n - 1) * activation, (measured, predicted)
    assert predicted < parameters  # the whole stage's gradients on top was the rule before
    assert first_weight_bytes([100, 100, 100], [30, 30, 30]) == 70 + 70 + 100
    assert first_weight_bytes([100, 10], [100, 0]) == 100  # the worst at a layer before the last


def test_gradients_counted_from_the_first_backward_where_torch_makes_them():
    """torch lets a step's gradients go (zero_grad(set_to_none=True)): one replica's unsharded stages make them in
    their first backward; DistributedDataParallel's buckets stay, FSDP2's are walked apart, 2BW as before."""
    c = Candidate(schedule=Schedule.GPIPE, pipeline_degree=2, global_batch_size=4, n_microbatches=4,
                  layers_per_stage=(1, 1))
    assert gradients_made_in_step(c)
    assert not gradients_made_in_step(dataclasses.replace(c, data_parallel_degree=2, global_batch_size=8))
    assert not gradients_made_in_step(dataclasses.replace(c, schedule=Schedule.TWO_BW))
    assert parameter_memory_bytes(100, 2.0) == 400 and parameter_memory_bytes(100, 2.0, gradients=False) == 300


def test_a_rank_holds_the_batch_its_stages_read():
    """VMin over 2 ranks (stages 0 and 3 on rank 0, 1 and 2 on rank 1): rank 0 holds the inputs and the targets of
    the batch, rank 1 none of it (runtime.prepare_batch)."""
    c = Candidate(schedule=Schedule.V_MIN, pipeline_degree=2, global_batch_size=4, n_microbatches=4,
                  layers_per_stage=(1, 1, 1, 1))
    layers = [LayerCost(forward_ms=1.0, backward_input_ms=1.0, backward_weight_ms=1.0, saved_bytes=0,
                        output_bytes=1000, parameter_bytes=0)] * 4
    bare = Profile.from_layer_costs(layers, micro_batch_size=1, input_bytes=0)
    batch = dataclasses.replace(bare, input_bytes=(300,), target_bytes=(20,))
    assert batch.target_bytes_at(2) == 40
    bare_peaks = simulate(bare, c, link=LINK, with_timeline=False).peak_memory_bytes
    peaks = simulate(batch, c, link=LINK, with_timeline=False).peak_memory_bytes
    assert peaks[0] - bare_peaks[0] == 4 * (300 + 20)
    assert peaks[1] == bare_peaks[1]


def _two_layers(**extra) -> Profile:
    layers = [LayerCost(forward_ms=1.0, backward_input_ms=1.0, backward_weight_ms=1.0, saved_bytes=0,
                        output_bytes=1000, parameter_bytes=0)] * 2
    return Profile.from_layer_costs(layers, micro_batch_size=1, input_bytes=0)


FOUR_SENDERS = Profile.from_layer_costs(
    [LayerCost(forward_ms=1.0, backward_input_ms=1.0, backward_weight_ms=1.0, saved_bytes=0, output_bytes=1000,
               parameter_bytes=0)] * 4,
    micro_batch_size=1, input_bytes=0,
)
"""Four layers that save nothing, each sending 1000 bytes on: what a rank holds is its receive buffers and sends."""


def test_1f1b_lets_go_of_its_sends_and_the_runtime_keeps_them_to_the_end():
    """Rank 0 sends 1000-byte outputs. 1F1B (m=4, 2 ranks) holds 2 in flight plus the last one sent, which lingers
    until the next backward (traced: 0F0's output alive in 0B1); LoopedBFS (4 stages, rank 0 holds 0 and 2) keeps
    every output sent and every input gradient sent back until the pipeline ends."""
    one_f_one_b = Candidate(schedule=Schedule.ONE_F_ONE_B, pipeline_degree=2, global_batch_size=4, n_microbatches=4,
                            layers_per_stage=(1, 1))
    peak = simulate(_two_layers(), one_f_one_b, link=LINK, with_timeline=False).peak_memory_bytes[0]
    assert peak == 4 * 1000 + 3 * 1000  # receive buffers for 4 output gradients, 3 outputs
    looped = Candidate(schedule=Schedule.LOOPED_BFS, pipeline_degree=2, global_batch_size=2, n_microbatches=2,
                       layers_per_stage=(1, 1, 1, 1))
    peak = simulate(FOUR_SENDERS, looped, link=LINK, with_timeline=False).peak_memory_bytes[0]
    # Receive buffers: stage 0 grads (2), stage 2 activations and grads (4); then after the forwards of stages 0
    # and 2 (4 outputs) the backwards of stage 2 send 2 input gradients back, and every output stays.
    assert peak == 6 * 1000 + 4 * 1000 + 2 * 1000


def test_a_hand_off_inside_a_rank_is_no_send():
    """ZBV, 2 ranks, m=1, 1000-byte outputs: rank 1 holds stages 1 and 2, and 1 -> 2 is local (torch makes stage 1's
    output stage 2's receive buffer, and stage 2's input gradient stage 1's). Rank 1: receive buffers 4 x 1000;
    F1 (its output is stage 2's buffer: nothing more), F2 (+1000, sent to rank 0), I2 (+1000 at worst: the input
    gradient, handed to stage 1, nothing kept), I1 (+1000 at worst, its input gradient sent and kept): 2000."""
    c = Candidate(schedule=Schedule.ZBV_ZERO_BUBBLE, pipeline_degree=2, global_batch_size=1, n_microbatches=1,
                  layers_per_stage=(1, 1, 1, 1))
    assert simulate(FOUR_SENDERS, c, link=LINK, with_timeline=False).peak_memory_bytes[1] == 4 * 1000 + 2000


def test_every_rank_keeps_its_sends_under_a_multi_stage_schedule():
    """ZBV, 2 ranks, m=8, 1000-byte outputs: rank 1 (stages 1 and 2) sends stage 2's outputs and stage 1's input
    gradients to rank 0, and torch keeps all 16 until the pipeline ends (the runtime waits for its sends last; the
    I leaves the gradient on the receive buffer), on top of its 32 receive buffers; what else it may hold at the end
    is a backward's temporaries (an input gradient, one more being sent)."""
    c = Candidate(schedule=Schedule.ZBV_ZERO_BUBBLE, pipeline_degree=2, global_batch_size=8, n_microbatches=8,
                  layers_per_stage=(1, 1, 1, 1))
    peak = simulate(FOUR_SENDERS, c, link=LINK, with_timeline=False).peak_memory_bytes[1]
    assert 32 * 1000 + 16 * 1000 <= peak <= 32 * 1000 + 16 * 1000 + 2 * 1000


# --- sharded (FSDP2) and bf16 --------------------------------------------------------------------------------------


def test_rules_of_sharding_and_bf16():
    """Bytes per float32 parameter byte: FSDP2 keeps the float32 parameter and AdamW shards (1 + 2) over dp for the
    step, gathers a working copy in the param dtype (bf16: half), accumulates float32 gradients unsharded and keeps
    their shards from the reduce-scatter to the optimizer step; autocast (replicated bf16) casts weight copies
    instead, and a bf16 profile's tensors travel as they are."""
    shard = Candidate(schedule=Schedule.GPIPE, pipeline_degree=1, data_parallel_degree=4, global_batch_size=8,
                      n_microbatches=2, layers_per_stage=(2,), precision="bf16", data_parallel_mode="shard",
                      wire_dtype="bfloat16")
    assert dp_shards(shard) == 4
    assert parameter_memory_bytes(8000, 2.0, dp_shards(shard)) == 6000  # 12 B per parameter over 4 ranks: 3 B
    assert gradient_shard_bytes(8000, candidate=shard) == 2000
    assert working_copy_bytes(8000, candidate=shard) == 4000  # bf16: 2 of 4 B
    assert unsharded_gradient_bytes(8000, candidate=shard) == 8000  # float32, the reduce dtype
    assert gather_buffer_bytes(4000, candidate=shard) == 500  # one unit's shard, cast to bf16
    assert gather_buffer_bytes(4000, candidate=dataclasses.replace(shard, precision="fp32")) == 0  # a view
    assert reduce_buffer_bytes(4000, candidate=shard) == 4000  # one unit's gradients, float32
    assert weight_gradient_factor(shard) == 0.5
    assert autocast_copy_bytes(300, candidate=shard) == 0  # bf16 parameters: nothing to cast
    assert wire_factor(shard) == 1.0  # a bf16 profile measured what autocast made: sent as it is
    fp32_shard = dataclasses.replace(shard, precision="fp32")
    assert working_copy_bytes(8000, candidate=fp32_shard) == 8000 and weight_gradient_factor(fp32_shard) == 1.0
    assert wire_factor(fp32_shard) == 0.5
    replicated = dataclasses.replace(shard, data_parallel_mode="replicate")
    assert dp_shards(replicated) == 1 and parameter_memory_bytes(8000, 2.0, dp_shards(replicated)) == 32000
    assert gradient_shard_bytes(8000, candidate=replicated) == 0
    assert working_copy_bytes(8000, candidate=replicated) == unsharded_gradient_bytes(8000, candidate=replicated) == 0
    assert gather_buffer_bytes(4000, candidate=replicated) == reduce_buffer_bytes(4000, candidate=replicated) == 0
    assert autocast_copy_bytes(300, candidate=replicated) == 300 and weight_gradient_factor(replicated) == 1.0
    assert autocast_copy_bytes(300, candidate=dataclasses.replace(replicated, precision="fp32")) == 0


SHARD_TWO_LAYERS = [LayerCost(forward_ms=1.0, backward_input_ms=1.0, backward_weight_ms=1.0, saved_bytes=1000,
                              output_bytes=100, parameter_bytes=4000, autocast_copy_bytes=1500)] * 2


def _one_stage(schedule: Schedule, precision: str = "fp32", **extra) -> tuple[Profile, Candidate]:
    profile = Profile.from_layer_costs(SHARD_TWO_LAYERS, micro_batch_size=1, input_bytes=50, precision=precision)
    c = Candidate(schedule=schedule, pipeline_degree=1, data_parallel_degree=4, global_batch_size=8,
                  n_microbatches=2, layers_per_stage=(2,), precision=precision, **extra)
    return profile, c


@pytest.mark.parametrize(
    "schedule, reshard, peak",
    [(Schedule.GPIPE, False, 22250), (Schedule.ONE_F_ONE_B, False, 22250), (Schedule.GPIPE, True, 22250),
     (Schedule.ONE_F_ONE_B, True, 22250)],
)
def test_one_sharded_stage_peaks_as_walked_by_hand(schedule, reshard, peak):
    """pp 1 x dp 4, two layers of 4000 parameter bytes (P = 8000), 2 micro-batches of 1000 + 1000 saved, output 100,
    input 50 (a view of the batch: 2050 held per micro-batch). Static: the batch 100 + the parameter and AdamW
    shards P x 3 / 4 = 6100 (the gradient shards, P / 4, only from the reduce-scatter to the optimizer step).
    c = u = 8000: the working copy and the unsharded float32 gradients, which accumulate as a backward frees the
    activations (there at its end, not with the loss's gradients at its start).

        GPipe, kept  F0 (gathers)  F1        B0 (1st)                 B1 (last)                   reduce
        live         c+2050        c+4100    c+4100 -> c+u+2050       c+u+2050 -> c+u             -> P/4
        peak         10050         12100     12100 + 200 (the loss's) 18050 + 4200 = 22250         16000 + 0

    (B1's 4200: a layer's fresh weight gradients 4000 + its input and output gradients; a unit's reduce-scatter
    input, 4000 float32, comes after its 4000 of working copy are let go of.) 1F1B (F0 B0 F1 B1) peaks at B1 too.
    Resharding after forward, a forward holds two units (8000, here the stage) while it runs (in fp32 the
    all-gather's input is a view of its output); a backward gathers the stage again, kept after it. GPipe: B0
    gathers, B1 finds it gathered: 22250 again. 1F1B: F1 lets go of what B0 gathered, so B1 gathers once more, unit
    by unit: its last layer's backward holds that unit and the one before, prefetched: 10050 + 8000 + 4200 = 22250;
    the first layer's, both units less what the last one let go of: 10050 + 8000 + 4200 - 1000 (two layers:
    resharding saves nothing here). Replicated: 100 + 4P + 2050 + 4200, + P at B1: under
    DistributedDataParallel, B0 runs under no_sync and its gradients accumulate beside DDP's buckets until B1's
    sync copies them in (simulate._ddp_accumulation)."""
    profile, c = _one_stage(schedule, data_parallel_mode="shard", reshard_after_forward=reshard)
    assert simulate(profile, c, link=LINK, with_timeline=False).peak_memory_bytes == (6100 + peak,)
    replicated = dataclasses.replace(c, data_parallel_mode="replicate", reshard_after_forward=False)
    replicated_peak = simulate(profile, replicated, link=LINK, with_timeline=False).peak_memory_bytes
    assert replicated_peak == (100 + 32000 + 6250 + 8000,)


def test_bf16_shards_gather_half_copies_and_autocast_keeps_a_copy_per_micro_batch_in_flight():
    """bf16, the same stage. Sharded: c = 4000 (bf16 copy), u = 8000 (float32), and the second backward's fresh
    weight gradients are bf16 (2000 + 200 of input and output gradients): c + u + 2050 + 2200 at B1. Replicated
    under autocast: each forward's graph keeps its weight copies (2 x 1500 per micro-batch), freed by its backward:
    GPipe holds both micro-batches' at B0."""
    profile, c = _one_stage(Schedule.GPIPE, "bf16", data_parallel_mode="shard")
    first, second = 4000 + 4100 + 200, 4000 + 8000 + 2050 + 2200
    assert simulate(profile, c, link=LINK, with_timeline=False).peak_memory_bytes == (6100 + max(first, second),)
    assert second > first
    replicated = dataclasses.replace(c, data_parallel_mode="replicate")
    held = 2050 + 3000
    # B0: both held + the loss's 200; B1: one held + 4200 + the gradients B0 accumulated beside DDP's buckets
    assert simulate(profile, replicated, link=LINK, with_timeline=False).peak_memory_bytes == (
        100 + 32000 + max(2 * held + 200, held + 4200 + 8000),)


def test_the_planner_caps_sharded_stages_with_the_same_terms():
    profile, c = _one_stage(Schedule.GPIPE, "bf16", data_parallel_mode="shard")
    stage_memory = _Costs(profile, 1, LINK).stage_memory(c)
    assert stage_memory(0, 0, 2) == pytest.approx(6000 + 4000 + 8000 + 2 * (2000 + 100))  # shards, copy, grads, held
    replicated = dataclasses.replace(c, data_parallel_mode="replicate")
    stage_memory = _Costs(profile, 1, LINK).stage_memory(replicated)
    assert stage_memory(0, 0, 2) == pytest.approx(32000 + 2 * (2000 + 3000 + 100))  # autocast copies per in flight


def test_a_sharded_backward_counts_what_it_gathers_and_accumulates_layer_by_layer():
    """Two layers of 4000 float32 parameter bytes, input and output 100, 1000 saved each (let go once done), the
    last stage, not profiled (a layer's backward: its weight gradients + its input's and output's)."""
    layers = dict(parameter_bytes=[4000, 4000], input_bytes=[100, 100], output_bytes=[100, 100], first=False,
                  last=True, freed=[1000, 1000])
    # resharding, a later backward gathers as it goes: the last layer holds its unit and the one before it,
    # prefetched (4200 + 8000); the first layer holds both less what the last let go of
    assert layer_backward_bytes(**layers, gathered=[4000, 4000]) == 4200 + 8000
    assert layer_backward_bytes(**layers) == 4200  # kept gathered: counted by the caller
    # a sharded stage's first backward: the unsharded gradients stay layer by layer (the first layer's backward
    # holds the last's 4000); in fp32 as kept
    assert layer_backward_bytes(**layers, weights="accumulated") == 4200 + 4000 - 1000
    assert layer_backward_bytes(**layers, weights="elsewhere") == 200
    # in bf16 each layer's gradients are made in bfloat16 (2000), then copied into float32 once it is done, both
    # held with its input's gradient: the first layer's 4000 + 6000 + 100 - 2000 let go of
    assert layer_backward_bytes(**layers, weights="accumulated", grad_factor=0.5) == 8100
