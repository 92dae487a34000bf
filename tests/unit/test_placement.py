"""Where the ranks of a pp x dp grid sit on nodes, which transfers cross nodes, and what crossing costs."""

from __future__ import annotations

import dataclasses

import pytest

from autotune.candidate import Candidate
from autotune.costs import LayerCost, Profile
from autotune.errors import UsageError
from autotune.placement import RANK_ORDERS, crossing_boundaries, dp_nodes, global_rank, grid_position, order_matters
from autotune.plan import plan
from autotune.schedules import Action, Schedule, stage_ranks
from autotune.simulate import LinkModel, simulate

FAST = LinkModel(bandwidth_bytes_per_s=50e9, latency_s=20e-6, per_action_overhead_ms=0.0, optimizer_bytes_per_s=1e30)
SLOW = dataclasses.replace(FAST, inter_node_bandwidth_bytes_per_s=5e9, inter_node_latency_s=200e-6)


def transformer(n_layers: int = 16, *, params: int = 50 * 2**20, output: int = 64 * 2**20) -> Profile:
    block = LayerCost(forward_ms=2.0, backward_input_ms=2.0, backward_weight_ms=2.0, saved_bytes=2**20,
                      output_bytes=output, parameter_bytes=params)
    return Profile.from_layer_costs([block] * n_layers, input_bytes=2**20, device="cuda")


def pipeline(pp: int, *, dp: int = 1, order: str = "pp-inner", schedule: Schedule = Schedule.ONE_F_ONE_B,
             m: int = 8, layers: int = 16) -> Candidate:
    stages = pp * (2 if schedule in (Schedule.INTERLEAVED_1F1B, Schedule.ZBV_ZERO_BUBBLE) else 1)
    split = [layers // stages] * stages
    return Candidate(schedule=schedule, pipeline_degree=pp, data_parallel_degree=dp, global_batch_size=m * dp,
                     n_microbatches=m, layers_per_stage=tuple(split), rank_order=order)  # type: ignore[arg-type]


@pytest.mark.parametrize("order", RANK_ORDERS)
def test_grid_position_inverts_global_rank(order):
    pp, dp = 4, 3
    seen = {global_rank(p, d, pp, dp, order) for p in range(pp) for d in range(dp)}
    assert seen == set(range(pp * dp))
    for rank in range(pp * dp):
        assert global_rank(*grid_position(rank, pp, dp, order), pp, dp, order) == rank


def test_the_two_orders_literal():
    # pp 4 x dp 2: pp-inner keeps a pipeline on consecutive ranks, dp-inner a stage's replicas.
    assert [global_rank(p, 0, 4, 2, "pp-inner") for p in range(4)] == [0, 1, 2, 3]
    assert [global_rank(p, 0, 4, 2, "dp-inner") for p in range(4)] == [0, 2, 4, 6]


@pytest.mark.parametrize("per_node, crossed", [(8, 0), (4, 1), (2, 3), (1, 7)])
def test_a_pipeline_of_8_is_cut_by_the_nodes(per_node, crossed):
    ranks = stage_ranks(Schedule.ONE_F_ONE_B, 8, 8)
    assert sum(crossing_boundaries(ranks, 1, per_node, "pp-inner")) == crossed


def test_interleaved_wrap_around_and_dp_inner():
    # Interleaved, pp 2, 4 stages on ranks 0 1 0 1: every hand-off crosses when each rank is its own node.
    ranks = stage_ranks(Schedule.INTERLEAVED_1F1B, 2, 4)
    assert crossing_boundaries(ranks, 1, 1, "pp-inner") == (False, True, True, True)
    assert crossing_boundaries(ranks, 1, 2, "pp-inner") == (False, False, False, False)
    # pp 4 x dp 2 on nodes of 4: pp-inner keeps pipelines inside; dp-inner crosses once, at p1 -> p2.
    ranks = stage_ranks(Schedule.ONE_F_ONE_B, 4, 4)
    assert crossing_boundaries(ranks, 2, 4, "pp-inner") == (False,) * 4
    assert crossing_boundaries(ranks, 2, 4, "dp-inner") == (False, False, True, False)
    assert dp_nodes(4, 2, 4, "pp-inner") == 2 and dp_nodes(4, 2, 4, "dp-inner") == 1
    # ZBV's V: rank r holds stages r and 2pp-1-r; the turn (stage pp-1 -> pp) stays on one rank.
    ranks = stage_ranks(Schedule.ZBV_ZERO_BUBBLE, 2, 4)
    assert ranks == [0, 1, 1, 0]
    assert crossing_boundaries(ranks, 1, 1, "pp-inner") == (False, True, False, True)


def test_order_matters_only_for_a_pipeline_and_replicas_over_nodes():
    assert order_matters(4, 2, 4)
    assert not order_matters(4, 2, None) and not order_matters(4, 2, 8)
    assert not order_matters(1, 8, 4) and not order_matters(8, 1, 4)


def test_hierarchical_all_reduce():
    same = FAST.allreduce_ms(1e9, 16)
    assert FAST.allreduce_ms(1e9, 16, 1) == same
    # 16 ranks on 2 nodes of 8: a ring of 8 inside, then the 1/8 shard across the 2 nodes on the slow link.
    expected = FAST.allreduce_ms(1e9, 8) + 2 * (1) * (200e-6 + 1e9 / 8 / 2 / 5e9) * 1e3
    assert SLOW.allreduce_ms(1e9, 16, 2) == pytest.approx(expected)


def test_a_pipeline_crossing_nodes_is_predicted_slower_when_the_link_between_them_is():
    prof = transformer()
    c = pipeline(8)
    inside = simulate(prof, c, link=SLOW)  # one machine: no node boundary at all
    one_node = simulate(prof, c, link=SLOW, gpus_per_node=8)
    crossing = simulate(prof, c, link=SLOW, gpus_per_node=4)
    every = simulate(prof, c, link=SLOW, gpus_per_node=1)
    assert one_node.step_time_ms == inside.step_time_ms
    assert inside.step_time_ms < crossing.step_time_ms < every.step_time_ms
    # An inter-node link as fast as the one inside costs only the wire time a receiver no longer hides behind its
    # previous action, and one tensor at a time between two ranks (a 64 MiB hand-off is 1.3 ms at 50 GB/s).
    fast = simulate(prof, c, link=FAST, gpus_per_node=1).step_time_ms
    assert inside.step_time_ms < fast < every.step_time_ms


def test_dp_inner_wins_when_gradients_dominate_and_pp_inner_when_activations_do():
    grads = transformer(params=2**30, output=2**20)
    big_grads = {o: simulate(grads, pipeline(4, dp=4, order=o), link=SLOW, gpus_per_node=4).step_time_ms
                 for o in RANK_ORDERS}
    assert big_grads["dp-inner"] < big_grads["pp-inner"]
    acts = transformer(params=2**10, output=2**30)
    big_acts = {o: simulate(acts, pipeline(4, dp=4, order=o), link=SLOW, gpus_per_node=4).step_time_ms
                for o in RANK_ORDERS}
    assert big_acts["pp-inner"] < big_acts["dp-inner"]


def test_with_probe_adds_only_what_crossing_costs():
    base = LinkModel.for_device("cpu")
    probed = base.with_probe(inter_latency_s=80e-6, inter_bandwidth_bytes_per_s=1e9, intra_latency_s=30e-6,
                             intra_bandwidth_bytes_per_s=2e9)
    assert probed.inter_node_latency_s == pytest.approx(base.latency_s + 50e-6)
    assert 1 / probed.inter_node_bandwidth_bytes_per_s == pytest.approx(1 / base.bandwidth_bytes_per_s + 0.5e-9)
    faster = base.with_probe(inter_latency_s=1e-6, inter_bandwidth_bytes_per_s=1e12)  # never faster than inside
    assert faster.across_nodes().latency_s == base.latency_s
    assert faster.across_nodes().bandwidth_bytes_per_s == base.bandwidth_bytes_per_s


def test_the_collectives_between_nodes_get_what_the_probed_all_reduce_got_of_the_link():
    # The probe timed one stream at 2.4 MB/s and an all-reduce moving its bytes at 2.1 (gloo over a tbf-shaped 20
    # Mbit/s link: ~88 %). Sends between nodes keep the stream's rate; the ring collectives across nodes run at the
    # same share of the modelled inter-node bandwidth.
    base = LinkModel.for_device("cpu")
    plain = base.with_probe(inter_latency_s=70e-6, inter_bandwidth_bytes_per_s=2.4e6)
    probed = base.with_probe(inter_latency_s=70e-6, inter_bandwidth_bytes_per_s=2.4e6,
                             inter_allreduce_bandwidth_bytes_per_s=2.1e6)
    assert probed.across_nodes().transfer_ms(2**20) == pytest.approx(plain.across_nodes().transfer_ms(2**20))
    assert probed.inter_node_allreduce_bandwidth_bytes_per_s == pytest.approx(2.1e6)
    nbytes = 3 * 2**20  # dp 2 over 2 nodes: a ring of 2, 2 passes of nbytes / 2
    assert probed.allreduce_ms(nbytes, 2, 2) == pytest.approx(2 * (70e-6 + nbytes / 2 / 2.1e6) * 1e3)
    assert plain.allreduce_ms(nbytes, 2, 2) == pytest.approx(2 * (70e-6 + nbytes / 2 / 2.4e6) * 1e3)
    assert probed.allreduce_ms(nbytes, 2) == plain.allreduce_ms(nbytes, 2)  # one node: the intra link
    # an all-reduce faster than the stream (a probe's noise) does not make the collectives faster than the sends
    noisy = base.with_probe(inter_latency_s=70e-6, inter_bandwidth_bytes_per_s=2.4e6,
                            inter_allreduce_bandwidth_bytes_per_s=3e6)
    assert noisy.allreduce_ms(nbytes, 2, 2) == pytest.approx(plain.allreduce_ms(nbytes, 2, 2))


def test_plan_ranks_both_orders_over_nodes_and_one_on_a_machine():
    prof = transformer()
    fast = {"schedules": ["1F1B"], "memory_limit_bytes": None, "prune_within": None}
    over_nodes = plan(prof, gpus=8, batch_size=16, link=SLOW, gpus_per_node=2, **fast)
    orders = {(p.candidate.pipeline_degree, p.candidate.rank_order) for p in over_nodes}
    assert (4, "dp-inner") in orders and (4, "pp-inner") in orders
    assert all(p.candidate.rank_order == "pp-inner" for p in over_nodes
               if p.candidate.pipeline_degree in (1, 8))
    alone = plan(prof, gpus=8, batch_size=16, link=SLOW, **fast)
    assert {p.candidate.rank_order for p in alone} == {"pp-inner"}
    with pytest.raises(UsageError, match="whole number of nodes"):
        plan(prof, gpus=8, batch_size=16, gpus_per_node=3, **fast)


def test_rank_order_round_trips_and_keeps_old_keys():
    c = pipeline(4, dp=2)
    assert "rank_order" not in c.to_dict() and "dp-inner" not in c.key
    d = dataclasses.replace(c, rank_order="dp-inner")
    assert Candidate.from_dict(d.to_dict()) == d and d.key.endswith("+dp-inner")


SLOW_WIRE = LinkModel(bandwidth_bytes_per_s=1e6, latency_s=0.0, per_action_overhead_ms=0.0,
                      optimizer_bytes_per_s=1e30)
"""10 ms on the wire for each 10 kB hand-off of TWO_SENDERS, no latency, no overheads."""
HANDOFF = LayerCost(forward_ms=1.0, backward_input_ms=2.0, backward_weight_ms=0.0, saved_bytes=0, output_bytes=10_000,
                    parameter_bytes=0)
"""A layer of F 1 ms, B 2 ms, that sends 10 kB on."""
TWO_SENDERS = Profile.from_layer_costs([HANDOFF] * 2, input_bytes=0)
"""Two layers: F 1 ms, B 2 ms, 10 kB sent on."""


def test_across_nodes_a_transfer_starts_when_its_receiver_posts_the_receive():
    # GPipe, 2 ranks on 2 nodes, 2 micro-batches, F 1 ms, B 2 ms, each hand-off 10 ms on the wire (latency 0).
    # rank 0: F0 0-1, F1 1-2                      B0: wire 25-35, 35-37   B1: wire 37-47, 47-49
    # rank 1: F0: wire 1-11, 11-12  F1: wire 12-22, 22-23   B0 23-25  B1 25-27
    # Inside one node the second forward's tensor is already there when rank 1 gets to it (arrives at 12): 29 ms.
    link, prof = SLOW_WIRE, TWO_SENDERS
    c = pipeline(2, schedule=Schedule.GPIPE, m=2, layers=2)
    assert simulate(prof, c, link=link, gpus_per_node=2).step_time_ms == pytest.approx(29.0)
    assert simulate(prof, c, link=link, gpus_per_node=1).step_time_ms == pytest.approx(49.0)
    one = pipeline(2, schedule=Schedule.GPIPE, m=1, layers=2)  # nothing to overlap with: the same either way
    assert simulate(prof, one, link=link, gpus_per_node=1).step_time_ms == pytest.approx(1 + 10 + 1 + 2 + 10 + 2)
    # Only the wire time waits for the receiver; the latency (a per-message cost) overlaps as before. With 5 ms of
    # latency on top, the micro-batch-0 hand-offs wait for the send (1 + 15 = 16, 30 + 15 = 45: 5 ms later each),
    # the micro-batch-1 ones for the receiver's post (17 + 10 = 27, 47 + 10 = 57: no later).
    slow = dataclasses.replace(link, latency_s=5e-3)
    assert simulate(prof, c, link=slow, gpus_per_node=2).step_time_ms == pytest.approx(29.0 + 2 * 5)
    assert simulate(prof, c, link=slow, gpus_per_node=1).step_time_ms == pytest.approx(49.0 + 2 * 5)


def test_across_nodes_two_ranks_move_one_tensor_at_a_time_between_them():
    # 1F1B, 2 ranks on 2 nodes, 2 micro-batches, F 1 ms, B 2 ms, each hand-off 10 ms on the wire.
    # rank 1: F0 (wire 1-11) 11-12, B0 12-14; at 14 it posts B0's gradient's send and F1's activation's receive in
    # one batch, the send first (torch's bwd_send + fwd_recv). Rank 0 posted that gradient's receive at 2, so the
    # gradient goes 14-24 (rank 0: B0 24-26); F1's receive reaches rank 0 behind it, so the activation goes 24-34
    # (F1 34-35, B1 35-37), B1's gradient 37-47 (rank 0's receive posted at 26), B1 on rank 0 47-49. Traced at 200
    # and 20 Mbit/s (bench/internode.py, 1F1B m2): two wire times between rank 1's B0 and its F1.
    # Inside one node the two 14-24 transfers overlap: 29 ms.
    link, prof = SLOW_WIRE, TWO_SENDERS
    c = pipeline(2, schedule=Schedule.ONE_F_ONE_B, m=2, layers=2)
    assert simulate(prof, c, link=link, gpus_per_node=2).step_time_ms == pytest.approx(29.0)
    across = simulate(prof, c, link=link, gpus_per_node=1, with_timeline=True)
    assert across.step_time_ms == pytest.approx(49.0)
    starts = {(e.rank, e.kind, e.microbatch): e.start_ms for e in across.timeline}
    assert starts[(0, "B", 0)] == pytest.approx(24.0) and starts[(1, "F", 1)] == pytest.approx(34.0)


def test_on_torchs_runtime_a_transfer_waits_for_its_receive_where_the_runtime_posts_it():
    # GPipe's action lists (2 ranks on 2 nodes, 2 micro-batches, F 1 ms, B 2 ms, 10 ms on the wire) run by a
    # schedule on torch's runtime, which posts each receive where _add_send_recv puts it in the receiver's list: F0's
    # before rank 1's first action, so it goes at once, 1-11 (F0 11-12); F1's after rank 1's F0, 12-22 (F1 22-23);
    # B0's after rank 0's F1, 25-35 (B0 35-37); B1's after rank 0's B0, 37-47 (B1 47-49). Here that is as late as
    # GPipe's own receives (49 ms, above); inside one node 29 ms.
    from autotune.simulate import simulate_costs

    actions = [[Action(0, "F", 0), Action(0, "F", 1), Action(0, "B", 0), Action(0, "B", 1)],
               [Action(1, "F", 0), Action(1, "F", 1), Action(1, "B", 0), Action(1, "B", 1)]]
    runtime = Candidate(schedule=Schedule.LOOPED_BFS, pipeline_degree=2, global_batch_size=2, n_microbatches=2,
                        layers_per_stage=(1, 1))

    def step(candidate: Candidate, per_node: int) -> float:
        return simulate_costs([HANDOFF, HANDOFF], candidate, input_bytes=0, optimizer_ms_per_byte=0.0,
                              optimizer_state_ratio=0.0, link=SLOW_WIRE, actions=actions,
                              gpus_per_node=per_node).step_time_ms

    assert step(runtime, 2) == pytest.approx(29.0)
    assert step(runtime, 1) == pytest.approx(49.0)
    assert step(dataclasses.replace(runtime, schedule=Schedule.GPIPE), 1) == pytest.approx(49.0)


def test_across_nodes_a_receive_posted_after_its_send_waits_for_the_sender():
    # A late receive over two nodes and a wire of no time: 1F1B m2, F 1 ms, B 2 ms. Rank 1 posts F1's receive at
    # 4, after rank 0 sent F1's activations (at 2), while rank 0 runs B0 (4-6): the tensor moves when rank 0's
    # collective thread wakes (0.5 ms: F1 at 4.5) or B0 ends (6, with a 5 ms wake). Traced on the unshaped link
    # (bench/internode.py, 1F1B m8): each such receive arrived 1.4-1.8 ms after its post, when the sender's
    # backward ended. Inside a node the replay holds rank 0's B0 until the receive is posted (torch's 1F1B waits
    # for F1's send with B0's receive; test_simulate), so the tensor moves at once there: F1 at 4.
    prof = TWO_SENDERS
    link = LinkModel(bandwidth_bytes_per_s=1e30, latency_s=0.0, per_action_overhead_ms=0.0, optimizer_bytes_per_s=1e30,
                     late_receives_wake=True, collective_wake_ms=0.5)
    c = pipeline(2, schedule=Schedule.ONE_F_ONE_B, m=2, layers=2)
    for per_node, f1_start, steps in ((1, 4.5, (9.5, 11.0)), (2, 4.0, (9.0, 9.0))):
        late = simulate(prof, c, link=link, gpus_per_node=per_node, with_timeline=True)
        f1 = next(e for e in late.timeline if e.rank == 1 and e.kind == "F" and e.microbatch == 1)
        assert f1.start_ms == pytest.approx(f1_start, abs=1e-3)
        assert late.step_time_ms == pytest.approx(steps[0], abs=1e-3)
        woken_late = simulate(prof, c, link=dataclasses.replace(link, collective_wake_ms=5.0), gpus_per_node=per_node)
        assert woken_late.step_time_ms == pytest.approx(steps[1], abs=1e-3)
    # without the term (cuda), the tensor moves at once: 9 ms
    eager = dataclasses.replace(link, late_receives_wake=False)
    assert simulate(prof, c, link=eager, gpus_per_node=1).step_time_ms == pytest.approx(9.0, abs=1e-3)


def test_across_nodes_the_sender_still_copies_its_send_into_the_socket():
    # sends_on_rank (gloo over TCP): the posting thread writes the bytes into its socket, across nodes too, at the
    # rate inside a node (2 MB of activations at 1 GB/s: 2 ms on the sender's forward); the receiver waits for the
    # slower wire between nodes besides.
    cost = LayerCost(forward_ms=1.0, backward_input_ms=2.0, backward_weight_ms=0.0, saved_bytes=0,
                     output_bytes=2_000_000, parameter_bytes=0)
    prof = Profile.from_layer_costs([cost, cost], input_bytes=0, device="cpu")
    link = LinkModel(bandwidth_bytes_per_s=1e9, latency_s=0.0, per_action_overhead_ms=0.0, optimizer_bytes_per_s=1e30,
                     sends_on_rank=True, inter_node_bandwidth_bytes_per_s=1e8)
    c = pipeline(2, schedule=Schedule.GPIPE, m=1, layers=2)
    for per_node in (2, 1):
        timeline = simulate(prof, c, link=link, gpus_per_node=per_node, with_timeline=True).timeline
        f0 = next(e for e in timeline if e.rank == 0 and e.kind == "F")
        assert f0.end_ms - f0.start_ms == pytest.approx(1.0 + 2.0)
    f1 = next(e for e in timeline if e.rank == 1 and e.kind == "F")
    assert f1.start_ms == pytest.approx(3.0 + 20.0)  # 2 MB over 100 MB/s after the copy: the wire on top


def test_across_nodes_one_way_tensors_go_in_the_order_they_were_ready_not_the_order_they_are_needed():
    # A V of three stages on torch's runtime (rank 0: stages 0 and 2, rank 1: stage 1), 2 micro-batches, F 1 ms,
    # B 2 ms, each hand-off 10 ms on the wire, 2 nodes. Rank 0 sends micro-batch 1's activations at 2, and rank 1
    # posts their receive at 12 (after its F1m0), a notice that waits behind rank 1's own send on the wire then
    # (12-22): they are ready at 22 and go 22-32. B2m0's gradient, sent at 25, goes behind them, 32-42, though
    # rank 1 needs it first (B1m0 42-44, F1m1 44-45); its two sends go 44-54 and 54-64 (rank 0: F2m1 64-65, B2m1
    # 65-67, B0m0 67-69); B2m1's gradient 67-77 (B1m1 77-79) and B1m1's 79-89: B0m1 89-91. Placed in the order
    # rank 1 needs them (the gradient first, 25-35), the step came out 8 ms shorter than this; traced so on VHalf m4
    # at 20 Mbit/s (bench/internode.py: 373 ms measured, 316 predicted that way, 370 now).
    from autotune.simulate import simulate_costs

    actions = [[Action(0, "F", 0), Action(0, "F", 1), Action(2, "F", 0), Action(2, "B", 0), Action(2, "F", 1),
                Action(2, "B", 1), Action(0, "B", 0), Action(0, "B", 1)],
               [Action(1, "F", 0), Action(1, "B", 0), Action(1, "F", 1), Action(1, "B", 1)]]
    runtime = Candidate(schedule=Schedule.LOOPED_BFS, pipeline_degree=2, global_batch_size=2, n_microbatches=2,
                        layers_per_stage=(1, 1, 1))
    estimate = simulate_costs([HANDOFF] * 3, runtime, input_bytes=0, optimizer_ms_per_byte=0.0,
                              optimizer_state_ratio=0.0, link=SLOW_WIRE, actions=actions, gpus_per_node=1,
                              with_timeline=True)
    assert estimate.step_time_ms == pytest.approx(91.0)
    rank1 = {(e.kind, e.stage, e.microbatch): e.start_ms for e in estimate.timeline if e.rank == 1}
    assert rank1[("B", 1, 0)] == pytest.approx(42.0)
    assert rank1[("F", 1, 1)] == pytest.approx(44.0)


@pytest.mark.parametrize("schedule, pp, m", [(Schedule.V_HALF, 2, 4), (Schedule.INTERLEAVED_1F1B, 2, 4),
                                             (Schedule.ZBV_ZERO_BUBBLE, 2, 6), (Schedule.LOOPED_BFS, 3, 6),
                                             (Schedule.DUAL_PIPE_V, 2, 8), (Schedule.DUAL_PIPE_V, 4, 8)])
def test_receives_are_posted_where_torchs_runtime_puts_them(schedule, pp, m):
    """Across nodes a runtime schedule's transfer starts no earlier than its receive is posted (gloo moves no byte
    before), and torch's _add_send_recv decides where each receive sits in the receiving rank's list."""
    from torch.distributed.pipelining import schedules as torch_schedules

    from autotune.action_graph import compiled_graph
    from autotune.schedules import action_lists, default_stages_per_rank
    from autotune.simulate import _receives_posted

    n_stages = pp * default_stages_per_rank(schedule)
    kinds = {"F": "FORWARD", "B": "FULL_BACKWARD", "I": "BACKWARD_INPUT", "W": "BACKWARD_WEIGHT"}
    ctype = torch_schedules._ComputationType
    lists = action_lists(schedule, pp, m, n_stages)
    graph = compiled_graph(schedule, pp, m, n_stages)
    where = {(graph.stage[a], graph.kind[a], graph.microbatch[a]): a for a in range(len(graph.kind))}
    to_rank = dict(enumerate(graph.stage_rank))
    def torch_actions(actions):  # DualPipeV's fused pairs as torch's OVERLAP_F_B
        out, run = [], []
        for a in actions:
            run.append(torch_schedules._Action(a.stage, getattr(ctype, kinds[a.kind]), a.microbatch))
            if not a.fused_with_next:
                out.append(run[0] if len(run) == 1 else
                           torch_schedules._Action(-1, ctype.OVERLAP_F_B, None, tuple(run)))
                run = []
        return out

    with_comms = torch_schedules._add_send_recv(
        {r: torch_actions(actions) for r, actions in enumerate(lists)}, to_rank.__getitem__, n_stages)
    names = {getattr(ctype, name): letter for letter, name in kinds.items()}
    posted = _receives_posted(graph)
    checked = 0
    for actions in with_comms.values():
        last = -1
        for act in actions:
            kind = act.computation_type
            if kind in names or act.sub_actions:
                act = act.sub_actions[-1] if act.sub_actions else act  # a fused pair: its receives come after both
                last = where[(act.stage_index, names[act.computation_type], act.microbatch_index)]
            elif kind in (ctype.RECV_F, ctype.RECV_B):
                backward = kind == ctype.RECV_B
                receiver = where.get((act.stage_index, "B" if backward else "F", act.microbatch_index))
                if receiver is None:
                    receiver = where[(act.stage_index, "I", act.microbatch_index)]
                assert graph.cross[receiver] and posted[receiver] == last, act
                checked += 1
    assert checked == sum(graph.cross)
