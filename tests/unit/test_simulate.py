import dataclasses
import itertools
import json
import os
import random
import subprocess
import sys

import pytest

from autotune.action_graph import DeadlockError
from autotune.candidate import Candidate
from autotune.costs import LayerCost, Profile
from autotune.errors import InvalidCandidateError, UsageError
from autotune.schedules import Action, Schedule, default_stages_per_rank
from autotune.simulate import (
    LinkModel,
    max_in_flight,
    simulate,
    step_time_lower_bound,
)

FREE = LinkModel(bandwidth_bytes_per_s=1e30, latency_s=0.0, per_action_overhead_ms=0.0, optimizer_bytes_per_s=1e30)


def layer(f=1.0, b=2.0, w=0.0, saved=0, out=0, params=0):
    return LayerCost(forward_ms=f, backward_input_ms=b, backward_weight_ms=w, saved_bytes=saved, output_bytes=out,
                     parameter_bytes=params)


def profile_of(*layers, input_bytes=0, optimizer_step_ms=0.0):
    return Profile.from_layer_costs(list(layers), input_bytes=input_bytes, optimizer_step_ms=optimizer_step_ms)


def candidate(schedule, pp, m, split, *, batch=None, dp=1, **extra):
    return Candidate(schedule=schedule, pipeline_degree=pp, global_batch_size=batch or m * dp, n_microbatches=m,
                     layers_per_stage=tuple(split), data_parallel_degree=dp, **extra)


@pytest.mark.parametrize("schedule", [Schedule.GPIPE, Schedule.ONE_F_ONE_B])
@pytest.mark.parametrize("p, m", [(2, 2), (2, 4), (4, 4), (4, 8), (3, 9)])
def test_equal_stages_give_the_textbook_bubble(schedule, p, m):
    est = simulate(profile_of(*[layer(f=1.0, b=2.0)] * p), candidate(schedule, p, m, [1] * p), link=FREE)
    assert est.step_time_ms == pytest.approx((m + p - 1) * 3.0)
    assert est.pipeline_time_ms == pytest.approx(est.step_time_ms)
    assert est.bubble_fraction == pytest.approx((p - 1) / (m + p - 1))
    assert est.throughput_samples_per_s == pytest.approx(m / est.step_time_ms * 1e3)


@pytest.mark.parametrize("p, m", [(2, 2), (2, 4), (4, 4), (4, 8), (3, 9)])
def test_2bw_pays_no_fill_or_drain_per_step_and_holds_two_weight_versions(p, m):
    """2BW's steady state: m (f + b) per step against 1F1B's (m + p - 1)(f + b), no bubble; 1F1B's activations plus
    one more copy of each rank's parameters; its lower bound is the busiest rank's work."""
    prof = profile_of(*[layer(f=1.0, b=2.0, saved=1000, params=10**6)] * p)
    two_bw = simulate(prof, candidate(Schedule.TWO_BW, p, m, [1] * p), link=FREE)
    one_f_one_b = simulate(prof, candidate(Schedule.ONE_F_ONE_B, p, m, [1] * p), link=FREE)
    assert two_bw.step_time_ms == pytest.approx(m * 3.0)
    assert one_f_one_b.step_time_ms == pytest.approx((m + p - 1) * 3.0)
    assert two_bw.bubble_fraction == pytest.approx(0.0)
    # the peaks differ by the second version, as 1F1B's (torch's runtime keeps its sends to the step's end; they
    # are empty here)
    assert [a - b for a, b in zip(two_bw.peak_memory_bytes, one_f_one_b.peak_memory_bytes)] == [10**6] * p
    bound = step_time_lower_bound([layer(f=1.0, b=2.0)] * p, candidate(Schedule.TWO_BW, p, m, [1] * p),
                                  input_bytes=0, optimizer_ms_per_byte=0.0, link=FREE)
    assert bound == pytest.approx(m * 3.0)


@pytest.mark.parametrize("params", [10**5, 3 * 10**7])  # 0.1 ms: hidden; 30 ms: 18 ms outlast the 12
def test_2bw_hides_the_replicas_all_reduce_behind_a_steps_work(params):
    """pp 2 x dp 2: an update's all-reduce overlaps the next step's micro-batches, so only what outlasts a rank's
    work of a step (m (f + b)) adds to the step."""
    link = LinkModel(bandwidth_bytes_per_s=1e9, latency_s=0.0, per_action_overhead_ms=0.0, optimizer_bytes_per_s=1e30)
    prof = profile_of(*[layer(f=1.0, b=2.0, params=params)] * 2)
    est = simulate(prof, candidate(Schedule.TWO_BW, 2, 4, [1, 1], dp=2), link=link)
    allreduce = link.allreduce_ms(params, 2)
    assert est.allreduce_ms == pytest.approx(allreduce)
    assert est.step_time_ms == pytest.approx(4 * 3.0 + max(0.0, allreduce - 4 * 3.0))


def test_1f1b_first_rank_holds_p_microbatches_and_gpipe_holds_m():
    p, m, saved = 4, 8, 1000
    prof = profile_of(*[layer(saved=saved)] * p)
    one_f_one_b = simulate(prof, candidate(Schedule.ONE_F_ONE_B, p, m, [1] * p), link=FREE)
    gpipe = simulate(prof, candidate(Schedule.GPIPE, p, m, [1] * p), link=FREE)
    assert one_f_one_b.peak_memory_bytes == tuple((p - r) * saved for r in range(p))
    assert gpipe.peak_memory_bytes == (m * saved,) * p


def test_max_in_flight_literal():
    assert max_in_flight(Schedule.ONE_F_ONE_B, 4, 8, 4) == [4, 3, 2, 1]
    assert max_in_flight(Schedule.GPIPE, 2, 3, 2) == [3, 3]


def test_transfers_sit_on_the_critical_path():
    # GPipe, 2 ranks, 1 micro-batch: F0, send, F1, B1, send grad, B0.
    link = LinkModel(bandwidth_bytes_per_s=1e6, latency_s=1e-3, per_action_overhead_ms=0.0, optimizer_bytes_per_s=1e30)
    prof = profile_of(layer(f=1, b=2, out=4000), layer(f=1, b=2, out=4000))
    est = simulate(prof, candidate(Schedule.GPIPE, 2, 1, [1, 1]), link=link)
    hop = 1.0 + 4.0  # 1 ms latency + 4000 B at 1 MB/s
    assert est.step_time_ms == pytest.approx(1 + hop + 1 + 2 + hop + 2)


def test_bfloat16_wire_halves_transfer_bytes_and_receive_buffers():
    link = LinkModel(bandwidth_bytes_per_s=1e6, latency_s=0.0, per_action_overhead_ms=0.0, optimizer_bytes_per_s=1e30)
    prof = profile_of(layer(f=1, b=2, out=4000), layer(f=1, b=2, out=4000))
    fp32 = simulate(prof, candidate(Schedule.GPIPE, 2, 4, [1, 1]), link=link)
    bf16 = simulate(prof, candidate(Schedule.GPIPE, 2, 4, [1, 1], wire_dtype="bfloat16"), link=link)
    # Receive buffers (grads in on rank 0, activations in on rank 1) and the outputs each in-flight micro-batch keeps;
    # on the last stage, the first backward's temporaries on top: the loss's two gradients of the output (2 x 4000).
    assert fp32.peak_memory_bytes == (4 * 4000 + 4 * 4000, 4 * 4000 + 4 * 4000 + 2 * 4000)
    # the last output stays float32, and so do the loss's gradients; rank 0's backward gets its output's gradient
    # in bfloat16 and the wire cast's backward makes it float32 (4000) for the layer
    assert bf16.peak_memory_bytes == (2 * 4000 + 2 * 4000 + 4000, 2 * 4000 + 4 * 4000 + 2 * 4000)
    assert fp32.step_time_ms - bf16.step_time_ms == pytest.approx(2 * 2.0)  # two hops on the path, 2 ms saved each


def test_per_action_overhead_is_paid_by_every_action():
    link = LinkModel(bandwidth_bytes_per_s=1e30, latency_s=0.0, per_action_overhead_ms=0.5, optimizer_bytes_per_s=1e30)
    est = simulate(profile_of(layer(f=1, b=2)), candidate(Schedule.GPIPE, 1, 4, [1]), link=link)
    assert est.step_time_ms == pytest.approx(4 * (1 + 2 + 2 * 0.5))
    assert est.bubble_fraction == pytest.approx(0.0)


def test_message_overhead_is_paid_by_the_sender_and_the_receiver():
    # GPipe, 2 ranks, 1 micro-batch: F0 posts a send, F1 a receive, B1 a send, B0 a receive; all on the path.
    link = LinkModel(bandwidth_bytes_per_s=1e30, latency_s=0.0, per_action_overhead_ms=0.0, optimizer_bytes_per_s=1e30,
                     message_overhead_ms=0.25)
    prof = profile_of(layer(f=1, b=2, out=4000), layer(f=1, b=2, out=4000))
    est = simulate(prof, candidate(Schedule.GPIPE, 2, 1, [1, 1]), link=link)
    assert est.step_time_ms == pytest.approx(1 + 1 + 2 + 2 + 4 * 0.25)
    # One rank, nothing crosses: no message is posted.
    alone = simulate(profile_of(layer(f=1, b=2)), candidate(Schedule.GPIPE, 1, 2, [1]), link=link)
    assert alone.step_time_ms == pytest.approx(2 * (1 + 2))


def test_compute_slowdown_stretches_compute_and_the_optimizer_and_the_step_overhead_is_paid_once():
    """What bench/action_trace.py measured inside trials: profiled compute runs slower beside another rank (layers
    and the optimizer step alike), and each rank pays a fixed cost per step outside its actions."""
    link = LinkModel(bandwidth_bytes_per_s=1e30, latency_s=0.0, per_action_overhead_ms=0.0, optimizer_bytes_per_s=1e30,
                     compute_slowdown=0.5, step_overhead_ms=0.75)
    prof = profile_of(layer(f=1, b=2, params=1000), optimizer_step_ms=2.0)
    plain = simulate(prof, candidate(Schedule.GPIPE, 1, 2, [1]), link=FREE)
    slowed = simulate(prof, candidate(Schedule.GPIPE, 1, 2, [1]), link=link)
    assert plain.step_time_ms == pytest.approx(2 * 3 + 2.0)
    assert slowed.optimizer_ms == pytest.approx(1.5 * 2.0)
    assert slowed.step_time_ms == pytest.approx(1.5 * (2 * 3 + 2.0) + 0.75)


def test_sends_on_the_sending_rank_cost_it_the_wire_time_and_the_receiver_only_the_latency():
    """gloo writes a send into the socket in the posting thread: on the CPU stand-in the sender pays bytes /
    bandwidth, and the receiver has the tensor a latency after the sender's action ends."""
    wire = LinkModel(bandwidth_bytes_per_s=1e6, latency_s=1e-3, per_action_overhead_ms=0.0, optimizer_bytes_per_s=1e30)
    on_rank = dataclasses.replace(wire, sends_on_rank=True)
    prof = profile_of(layer(f=1, b=2, out=4000), layer(f=1, b=2, out=4000))
    one = candidate(Schedule.GPIPE, 2, 1, [1, 1])
    # F0 -> F1, B1 -> B0 cross: 4 ms of wire and 1 ms of latency each way, on the path either way
    assert simulate(prof, one, link=wire).step_time_ms == pytest.approx(6 + 2 * (4 + 1))
    assert simulate(prof, one, link=on_rank).step_time_ms == pytest.approx(6 + 2 * (4 + 1))
    # GPipe, 2 micro-batches: rank 0's second F waits for nothing, but its first F's send now takes rank 0's time
    two = candidate(Schedule.GPIPE, 2, 2, [1, 1])
    sender = simulate(prof, two, link=on_rank)
    f = [e for e in sender.timeline if e.rank == 0 and e.kind == "F"]
    assert [e.end_ms - e.start_ms for e in f] == pytest.approx([1 + 4, 1 + 4])
    assert [e.end_ms - e.start_ms for e in simulate(prof, two, link=wire).timeline
            if e.rank == 0 and e.kind == "F"] == pytest.approx([1, 1])


def test_split_backward_extras_are_paid_by_i_and_w_but_not_by_a_whole_backward():
    """torch's split backward walks the graph again (I: for the parameter groups, W: once per group): measured per
    layer by the profiler, charged to the I and W of a stage that receives, not to a whole backward (B)."""
    extra = dataclasses.replace(layer(f=1, b=2, w=1), split_input_extra_ms=0.25, split_weight_extra_ms=0.5)
    prof = profile_of(layer(f=1, b=2, w=1), extra, layer(f=1, b=2, w=1), layer(f=1, b=2, w=1))
    split = simulate(prof, candidate(Schedule.INTERLEAVED_ZERO_BUBBLE, 2, 2, [1, 1, 1, 1]), link=FREE)
    durations = {(e.stage, e.kind): e.end_ms - e.start_ms for e in split.timeline}
    assert durations[(1, "I")] == pytest.approx(2.25) and durations[(1, "W")] == pytest.approx(1.5)
    assert durations[(2, "I")] == pytest.approx(2.0) and durations[(2, "W")] == pytest.approx(1.0)
    whole = simulate(prof, candidate(Schedule.GPIPE, 2, 2, [2, 2]), link=FREE)
    assert {round(e.end_ms - e.start_ms, 6) for e in whole.timeline if e.kind == "B"} == {6.0}


def test_a_receive_posted_after_its_send_waits_for_the_sender_s_thread_or_its_next_call():
    """gloo moves a send whose receive was posted late in the sender's own thread, which sleeps while its rank
    computes: the receiver gets it collective_wake_ms after posting, or when the sender's running action ends.
    GPipe's sender runs its other forwards before it waits for its sends, so a receive posted meanwhile waits."""
    link = dataclasses.replace(FREE, collective_wake_ms=0.25, late_receives_wake=True)
    prof = profile_of(layer(f=1, b=2), layer(f=1.5, b=2))
    gpipe = candidate(Schedule.GPIPE, 2, 3, [1, 1])
    # rank 0: F0 [0,1] F1 [1,2] F2 [2,3], then B0-B2 2 ms each after rank 1's; rank 1: F0 [1,2.5], then F1, whose
    # tensor rank 0 sent at 2: posted late (at 2.5), while rank 0 runs F2 until 3, it arrives 0.25 later; F2's,
    # posted at 4.25, finds rank 0 waiting for its forwards' sends: at once
    assert simulate(prof, gpipe, link=FREE).step_time_ms == pytest.approx(13.5)
    late = simulate(prof, gpipe, link=link)
    starts = {e.microbatch: e.start_ms for e in late.timeline if e.rank == 1 and e.kind == "F"}
    assert starts == pytest.approx({0: 1.0, 1: 2.75, 2: 4.25})
    assert late.step_time_ms == pytest.approx(13.75)
    # woken sooner by the sender's next call: its running action ends first
    assert simulate(prof, gpipe, link=dataclasses.replace(link, collective_wake_ms=5.0)).step_time_ms == \
        pytest.approx(14.0)


def test_1f1b_waits_for_its_sends_with_the_next_receive_so_a_late_receive_moves_at_once():
    """torch's Schedule1F1B posts a forward's send with the next backward's receive and waits for both, and a gloo
    send waits for its receive to be posted: the sender does not start that backward before the receiver got to the
    forward, and the receive, late as it is, finds the sender waiting in gloo (no wake)."""
    link = dataclasses.replace(FREE, collective_wake_ms=0.5, late_receives_wake=True)
    prof = profile_of(layer(f=1, b=2), layer(f=1, b=2))
    one_f_one_b = candidate(Schedule.ONE_F_ONE_B, 2, 2, [1, 1])
    # rank 0: F0 [0,1] F1 [1,2], then waits for F1's send and B0's gradient: B0 [4,6] B1 [7,9]; rank 1: F0 [1,2]
    # B0 [2,4], then posts B0's gradient and F1's receive at 4: F1 [4,5] B1 [5,7]
    for wake in (0.5, 5.0):
        est = simulate(prof, one_f_one_b, link=dataclasses.replace(link, collective_wake_ms=wake))
        f1 = next(e for e in est.timeline if e.rank == 1 and e.kind == "F" and e.microbatch == 1)
        assert f1.start_ms == pytest.approx(4.0)
        assert est.step_time_ms == pytest.approx(9.0)


def test_a_post_crossing_one_of_the_other_rank_costs_more_by_how_close_they_are():
    """Two ranks posting to each other at the same moment now and then wait ~3 ms for a core (CROSSING_POST_CPU_MS):
    a rank's posts to the other at one moment within the window of one of the other rank's are charged once,
    weighted down with the distance."""
    from autotune.action_graph import compile_graph
    from autotune.simulate import _crossing_posts

    a = Action
    plan = compile_graph(((a(0, "F", 0), a(2, "F", 0), a(2, "B", 0), a(0, "B", 0)),
                          (a(1, "F", 0), a(3, "F", 0), a(3, "B", 0), a(1, "B", 0))), 4, 1)
    # actions 0-3 on rank 0 (F0 F2 B2 B0), 4-7 on rank 1 (F1 F3 B3 B1); a receive is posted when the rank's action
    # before it ends, a send when its action ends. Rank 1's B3 ends at 5.95, 0.05 ms before rank 0's B2: B3's send
    # and B1's receive there cross B2's send and B0's receive, once a rank (weighted 1 - 0.05 / 0.2): rank 1's
    # charged to B3 (its send comes first), rank 0's to B0 (its receive comes first); every other pair of posts is
    # 1 ms apart or more.
    finish = [1.0, 3.0, 6.0, 8.0, 2.0, 4.0, 5.95, 7.0, 0.0]
    extra = _crossing_posts(plan, finish, 1.0, 0.2)
    assert extra == pytest.approx([0, 0, 0, 0.75, 0, 0, 0.75, 0])
    # torch's runtime posts receives ahead (_receives_posted): B0's after F2 (at 3.0, charged to B2, the action
    # after), where no post of rank 1 is near; so rank 0's moment at 6.0 holds B2's send alone, charged to B2
    posted = [-1, 0, 1, 1, -1, 4, -1, 6]
    extra = _crossing_posts(plan, finish, 1.0, 0.2, posted)
    assert extra == pytest.approx([0, 0, 0.75, 0, 0, 0, 0.75, 0])
    finish[6] = 5.5  # apart: nothing
    assert _crossing_posts(plan, finish, 1.0, 0.2) is None


def test_a_rank_posting_several_messages_at_one_moment_crosses_once():
    """DualPipeV's middle rank posts two sends and two receives after each fused pair, its first rank one pair at
    a time: charged a crossing per post, the middle rank paid twice the first's, though a trace measured the two
    alike (bench/results/action_trace_dualpipev_mlp13.md: 9.6 and 11.0 ms a step of slow posts; charged 11.5 and
    21.6). Charged per moment, the two ranks pay alike."""
    import autotune.simulate as simulator

    prof = profile_of(*[layer(f=1, b=1)] * 8)
    c = candidate(Schedule.DUAL_PIPE_V, 2, 16, [2, 2, 2, 2])
    link = dataclasses.replace(LinkModel.for_device("cpu"), idle_resume_ms=())
    captured = []
    real = simulator._crossing_posts

    def spy(plan, *args, **kwargs):
        extra = real(plan, *args, **kwargs)
        captured.append([sum(extra[x] for x in ids) for ids in plan.rank_actions] if extra else [0.0, 0.0])
        return extra

    simulator._crossing_posts = spy
    try:
        simulate(prof, c, link=link)
    finally:
        simulator._crossing_posts = real
    rank0, rank1 = captured[0]
    assert rank0 > 0 and rank1 > 0
    assert max(rank0, rank1) <= 1.25 * min(rank0, rank1), (rank0, rank1)


def test_crossing_posts_are_charged_to_every_synchronous_schedule():
    """Traced, posts within 0.1 ms of one of the other rank's cost GPipe, 1F1B (behind a light first stage) and the
    multi-stage schedules alike (bench/results/action_trace_crossing_embed_mlp.md, action_trace_1f1b_embed_mlp.md)."""
    prof = profile_of(*[layer(f=1, b=1)] * 4)
    crossing = dataclasses.replace(FREE, crossing_post_ms=1.0, crossing_post_window_ms=0.2)
    for c in (candidate(Schedule.ONE_F_ONE_B, 2, 4, [2, 2]), candidate(Schedule.GPIPE, 2, 4, [2, 2]),
              candidate(Schedule.LOOPED_BFS, 2, 4, [1, 1, 1, 1])):
        assert simulate(prof, c, link=crossing).step_time_ms > simulate(prof, c, link=FREE).step_time_ms
    assert LinkModel.for_device("cuda").crossing_post_ms == 0.0


def test_crossing_posts_across_nodes_are_charged_only_where_the_nodes_are_one_machine():
    """The cost of two ranks posting to each other at once is their gloo threads spinning on shared cores: between
    nodes that are separate machines each has its own, between network namespaces on one machine (the probe read
    one boot id) they do not (bench/results/internode_xeon.md: VHalf m4 -20 % unshaped across the veth without it,
    -5 % with it)."""
    prof = profile_of(*[layer(f=1, b=1)] * 4)
    crossing = dataclasses.replace(FREE, crossing_post_ms=1.0, crossing_post_window_ms=0.2)
    c = candidate(Schedule.ONE_F_ONE_B, 2, 4, [2, 2])
    apart = crossing.with_probe(inter_latency_s=FREE.latency_s, inter_bandwidth_bytes_per_s=FREE.bandwidth_bytes_per_s)
    shared = crossing.with_probe(inter_latency_s=FREE.latency_s,
                                 inter_bandwidth_bytes_per_s=FREE.bandwidth_bytes_per_s, nodes_share_host=True)
    inside = simulate(prof, c, link=crossing).step_time_ms
    assert inside > simulate(prof, c, link=FREE).step_time_ms
    assert simulate(prof, c, link=apart, gpus_per_node=1).step_time_ms == simulate(
        prof, c, link=FREE, gpus_per_node=1).step_time_ms
    assert simulate(prof, c, link=shared, gpus_per_node=1).step_time_ms == pytest.approx(inside)
    assert shared.across_nodes().nodes_share_host and not LinkModel.for_device("cpu").nodes_share_host


def test_the_crossing_share_is_flat_about_an_exact_alignment_under_jitter():
    """The replay aligns posts to the microsecond where stages are equal; the runtime's stray by about an action's
    overhead. Taken in expectation over that jitter, a few microseconds off an exact alignment change the share by
    next to nothing (the bare triangle's slope there let a planner buy an uneven split with them), and the share
    summed over all offsets stays the triangle's."""
    from autotune.simulate import _crossing_share

    window = 0.2
    assert _crossing_share(0.0, window, 0.0) == 1.0
    assert _crossing_share(0.05, window, 0.0) == pytest.approx(0.75)
    assert _crossing_share(0.2, window, 0.0) == 0.0
    bare_drop = _crossing_share(0.0, window, 0.0) - _crossing_share(0.01, window, 0.0)
    jittered_drop = _crossing_share(0.0, window, 0.1) - _crossing_share(0.01, window, 0.1)
    assert bare_drop == pytest.approx(0.05)
    assert 0 <= jittered_drop < bare_drop / 10
    step = 0.001
    area = 2 * sum(_crossing_share(i * step, window, 0.1) for i in range(1, 2000)) * step + _crossing_share(
        0.0, window, 0.1) * step
    assert area == pytest.approx(window, rel=1e-3)  # the triangle's area: 1 x window
    assert _crossing_share(window + 0.6, window, 0.1) == 0.0
    assert LinkModel.for_device("cpu").crossing_post_jitter_ms > 0


def test_a_forward_fused_with_a_backward_sends_after_both():
    """torch runs DualPipeV's OVERLAP_F_B as its forward, then its backward, and posts both one's sends after the
    backward (_add_send_recv): the next stage's forward waits for the end of the pair, not of the forward."""
    prof = profile_of(layer(f=1, b=2), layer(f=1, b=2))
    c = candidate(Schedule.GPIPE, 2, 2, [1, 1])
    ranks = [[Action(0, "F", 0), Action(0, "F", 1), Action(0, "B", 0), Action(0, "B", 1)],
             [Action(1, "F", 0), Action(1, "B", 0), Action(1, "F", 1), Action(1, "B", 1)]]
    # 0F0 0-1, 0F1 1-2, 1F0 1-2, 1B0 2-4, 0B0 4-6, 1F1 4-5 (0F1's tensor there at 2), 1B1 5-7, 0B1 7-9
    assert simulate(prof, c, link=FREE, actions=ranks).step_time_ms == pytest.approx(9.0)
    ranks[0][1] = Action(0, "F", 1, fused_with_next=True)
    # 0F1's tensor leaves when 0B0 ends (6): 1F1 6-7, 1B1 7-9, 0B1 9-11
    assert simulate(prof, c, link=FREE, actions=ranks).step_time_ms == pytest.approx(11.0)
    assert ranks[0][1] == Action(0, "F", 1)  # the same action, run another way


def test_held_activations_slow_each_backward_by_what_the_rank_holds():
    mib = 2**20
    link = LinkModel(bandwidth_bytes_per_s=1e30, latency_s=0.0, per_action_overhead_ms=0.0, optimizer_bytes_per_s=1e30,
                     held_activation_ms_per_mib=0.5)
    prof = profile_of(layer(f=1, b=2, saved=2 * mib))
    # One rank, GPipe m=3: F F F, then B with 3, 2 and 1 micro-batches held (6, 4, 2 MiB).
    est = simulate(prof, candidate(Schedule.GPIPE, 1, 3, [1]), link=link)
    assert est.step_time_ms == pytest.approx(3 * (1 + 2) + 0.5 * (6 + 4 + 2))
    # Holding fewer micro-batches costs less: 1F1B's first rank holds p, GPipe's holds m.
    prof4 = profile_of(*[layer(f=1, b=2, saved=mib)] * 2)
    gpipe = simulate(prof4, candidate(Schedule.GPIPE, 2, 8, [1, 1]), link=link)
    one_f_one_b = simulate(prof4, candidate(Schedule.ONE_F_ONE_B, 2, 8, [1, 1]), link=link)
    assert gpipe.step_time_ms > one_f_one_b.step_time_ms
    plain = simulate(prof4, candidate(Schedule.GPIPE, 2, 8, [1, 1]), link=FREE)
    assert plain.step_time_ms == pytest.approx(simulate(prof4, candidate(Schedule.ONE_F_ONE_B, 2, 8, [1, 1]),
                                                        link=FREE).step_time_ms)


def test_activation_checkpointing_trades_memory_for_a_forward():
    prof = profile_of(layer(f=1, b=2, saved=1000), input_bytes=10)
    plain = simulate(prof, candidate(Schedule.GPIPE, 1, 2, [1]), link=FREE)
    ckpt = simulate(prof, candidate(Schedule.GPIPE, 1, 2, [1], activation_checkpointing=True), link=FREE)
    assert plain.step_time_ms == pytest.approx(2 * (1 + 2))
    assert ckpt.step_time_ms == pytest.approx(2 * (1 + 1 + 2))
    # The global batch's inputs are held; what the first layer saves of them (10) is a view, not held again.
    batch = 2 * 10
    assert plain.peak_memory_bytes == (2 * (1000 - 10) + batch,)
    # the two stage inputs the checkpoints keep are the batch's; one micro-batch rebuilt at a time
    assert ckpt.peak_memory_bytes == (1000 + batch,)


def test_activation_checkpointing_uses_the_measured_recompute_cost():
    prof = dataclasses.replace(profile_of(layer(f=1, b=2, saved=1000)), checkpoint_forward_ratio=(1.2,),
                               checkpoint_recompute_ratio=(1.5,))
    ckpt = simulate(prof, candidate(Schedule.GPIPE, 1, 2, [1], activation_checkpointing=True), link=FREE)
    assert ckpt.step_time_ms == pytest.approx(2 * (1.2 + 1.5 + 2))


def test_checkpointed_split_backward_recomputes_once_per_parameter_group_and_the_first_stage_runs_in_w():
    # torch's W runs one autograd pass per parameter group; checkpointed, each pass recomputes the stage.
    groups = 5
    layers = [LayerCost(forward_ms=1, backward_input_ms=2, backward_weight_ms=0.5, saved_bytes=10, output_bytes=10,
                        parameter_bytes=40, parameter_groups=groups)] * 4
    prof = profile_of(*layers)

    def durations(checkpointing):
        est = simulate(prof, candidate(Schedule.ZBV_ZERO_BUBBLE, 2, 2, [1] * 4, activation_checkpointing=checkpointing),
                       link=FREE)
        return {(e.kind, e.stage): round(e.end_ms - e.start_ms, 6) for e in est.timeline}

    plain, checkpointed = durations(False), durations(True)
    assert plain[("I", 0)] == 0 and plain[("W", 0)] == 2.5  # no input gradient for the data: all of it in W
    assert plain[("I", 1)] == 2 and plain[("W", 1)] == 0.5
    assert checkpointed[("I", 1)] == 2 + 1 and checkpointed[("W", 1)] == 0.5 + groups * 1
    assert checkpointed[("W", 0)] == 2.5 + 1  # the first stage's single full backward recomputes once


def test_optimizer_temporaries_count_once_the_activations_are_gone():
    prof = profile_of(layer(saved=1000, params=4000), layer(saved=1000, params=4000))
    prof = dataclasses.replace(prof, optimizer_state_bytes=2 * 8000)
    c = candidate(Schedule.GPIPE, 2, 2, [1, 1])
    static = 4000 * (2 + 2)  # parameters, gradients, AdamW's two moments
    # The first backward's weight gradients become .grad; the second's are fresh (4000) until added, while the
    # second micro-batch's 1000 are still held: 5000 over the 2000 both micro-batches hold after their forwards.
    assert simulate(prof, c, link=FREE).peak_memory_bytes == (static + 1000 + 4000,) * 2
    # A step that allocates 1x the model's parameters on top: on CPU the optimizer steps one tensor at a time, so
    # a rank holding a largest layer pays the whole model's peak (8000), more than the backward, and it sets the peak.
    heavy = dataclasses.replace(prof, optimizer_peak_bytes=8000)
    assert simulate(heavy, c, link=FREE).peak_memory_bytes == (static + 8000,) * 2
    # On CUDA (foreach: all of a rank's tensors at once) each rank pays its share by parameters (4000): no change.
    foreach = dataclasses.replace(heavy, device="cuda")
    assert simulate(foreach, c, link=FREE).peak_memory_bytes == (static + 5000,) * 2
    light = dataclasses.replace(prof, optimizer_peak_bytes=800)  # under the backward: no change
    assert simulate(light, c, link=FREE).peak_memory_bytes == (static + 5000,) * 2


def test_static_memory_optimizer_and_data_parallel_all_reduce():
    link = LinkModel(bandwidth_bytes_per_s=1e6, latency_s=1e-3, per_action_overhead_ms=0.0, optimizer_bytes_per_s=1e30)
    params = 1000
    prof = profile_of(layer(params=params), layer(params=params), optimizer_step_ms=10.0)
    single = simulate(prof, candidate(Schedule.GPIPE, 2, 2, [1, 1]), link=link)
    # params + grads + AdamW's 2x state, and the second backward's fresh weight gradients before they are added
    assert single.peak_memory_bytes == (4 * params + params, 4 * params + params)
    assert single.optimizer_ms == pytest.approx(5.0)  # each rank holds half of the parameters
    assert single.step_time_ms == pytest.approx(single.pipeline_time_ms + 5.0)
    replicated = simulate(prof, candidate(Schedule.GPIPE, 2, 2, [1, 1], dp=2), link=link)
    ring = 2 * (2 - 1) * (1e-3 + params / 2 / 1e6) * 1e3
    assert replicated.allreduce_ms == pytest.approx(ring)
    assert replicated.step_time_ms == pytest.approx(replicated.pipeline_time_ms + ring + 5.0)
    assert replicated.throughput_samples_per_s == pytest.approx(4 / replicated.step_time_ms * 1e3)


def test_a_ranks_optimizer_step_pays_the_fixed_call_cost_once_whatever_its_blocks():
    """The profile sums one step per block, each paying the step's fixed cost (a CUDA foreach step's launches); a
    rank steps once over all its stages: the fixed cost once, the rest by bytes."""
    params = 1000
    prof = dataclasses.replace(
        profile_of(*(layer(params=params) for _ in range(4)), layer(), optimizer_step_ms=10.0), optimizer_call_ms=2.0)
    assert prof.to_dict()["optimizer_call_ms"] == 2.0 and Profile.from_dict(prof.to_dict()) == prof
    one_rank = simulate(prof, candidate(Schedule.GPIPE, 1, 1, [5]), link=FREE)
    assert one_rank.optimizer_ms == pytest.approx(2.0 + (10.0 - 4 * 2.0))  # 4 blocks stepped on their own
    two_ranks = simulate(prof, candidate(Schedule.GPIPE, 2, 1, [2, 3]), link=FREE)
    assert two_ranks.optimizer_ms == pytest.approx(2.0 + (10.0 - 4 * 2.0) / 2)
    older = simulate(dataclasses.replace(prof, optimizer_call_ms=0.0), candidate(Schedule.GPIPE, 2, 1, [2, 3]),
                     link=FREE)
    assert older.optimizer_ms == pytest.approx(5.0)  # profiles saved before: by bytes alone, as before
    bound = step_time_lower_bound(prof.layer_costs(1), candidate(Schedule.GPIPE, 2, 1, [2, 3]), input_bytes=0,
                                  optimizer_ms_per_byte=(10.0 - 8.0) / (4 * params), optimizer_call_ms=2.0, link=FREE)
    assert bound <= two_ranks.step_time_ms + 1e-9



def test_an_action_after_its_rank_sat_idle_pays_the_hosts_probed_resume_cost():
    """Compute right after a rank's wait runs slower on the CPU stand-in (LinkModel.idle_resume_ms, from the
    profile's probe): linear between the probed gaps, flat beyond the last, a short action its share of the
    window. In GPipe m1 over 2 ranks the second rank waits for the first's forward and the first for the second's
    backward: each of those two actions pays for its gap, and nothing else moves."""
    from autotune.simulate import idle_resume_extra_ms

    points = ((1.0, 0.2), (4.0, 0.8))
    link = dataclasses.replace(FREE, idle_resume_ms=points, idle_resume_window_ms=2.0)
    assert idle_resume_extra_ms(link, 0.0, 5.0) == 0.0  # back to back
    assert idle_resume_extra_ms(link, 0.5, 5.0) == pytest.approx(0.1)  # from (0, 0) to the first point
    assert idle_resume_extra_ms(link, 2.5, 5.0) == pytest.approx(0.5)
    assert idle_resume_extra_ms(link, 40.0, 5.0) == pytest.approx(0.8)  # flat beyond the last
    assert idle_resume_extra_ms(link, 40.0, 0.5) == pytest.approx(0.2)  # a quarter of the window: a quarter
    assert idle_resume_extra_ms(FREE, 40.0, 5.0) == 0.0  # not probed (cuda, older profiles): nothing

    prof = profile_of(layer(f=3.0, b=5.0), layer(f=3.0, b=5.0))
    gpipe = candidate(Schedule.GPIPE, 2, 1, [1, 1])
    plain = simulate(prof, gpipe, link=FREE)
    resumed = simulate(prof, gpipe, link=link)
    # rank 1's forward waited 3 ms (0.6 extra), rank 0's backward waited 3 + 0.6 + 3 + 5 ms (0.8 extra)
    assert plain.step_time_ms == pytest.approx(16.0)
    assert resumed.step_time_ms == pytest.approx(16.0 + 0.6 + 0.8)
    # a stored study's link comes back from JSON with lists: the same link, still hashable
    again = LinkModel(**json.loads(json.dumps(dataclasses.asdict(link))))
    assert again == link and hash(again) == hash(link)
    # the profile's probe reaches the link simulate uses by default on the CPU, and not on CUDA
    probed = dataclasses.replace(prof, idle_resume_ms=points, idle_resume_window_ms=2.0)
    assert Profile.from_dict(probed.to_dict()) == probed
    assert LinkModel.for_profile(probed).idle_resume_ms == points
    assert LinkModel.for_profile(prof).idle_resume_ms == ()
    assert LinkModel.for_profile(dataclasses.replace(probed, device="cuda")).idle_resume_ms == ()


def test_the_cpu_per_action_overhead_moves_with_the_profiled_hosts_speed():
    """A rank's time around each action is Python and dispatch: a host whose probe (Profile.host_call_ms) is twice
    the development machine's pays twice the per-action overhead, twice DistributedDataParallel's forward (Python
    around the module's call too) and twice each post of a send or receive, crossing or not; nothing else in the
    link moves (the collectives' wake is the scheduler's), and an override is kept as given."""
    from autotune.simulate import HOST_CALL_REFERENCE_MS, HOST_SCALE_RANGE

    base = profile_of(*(layer() for _ in range(4)))
    default = LinkModel.for_device("cpu")
    assert LinkModel.for_profile(base) == default  # no probe (a profile saved before it): the defaults
    slow = dataclasses.replace(base, host_call_ms=2 * HOST_CALL_REFERENCE_MS)
    assert Profile.from_dict(slow.to_dict()) == slow
    link = LinkModel.for_profile(slow)
    assert link.per_action_overhead_ms == pytest.approx(2 * default.per_action_overhead_ms)
    python_side = ("per_action_overhead_ms", "replica_forward_overhead_ms", "message_overhead_ms",
                   "crossing_post_ms")
    for name in python_side:
        assert getattr(link, name) == pytest.approx(2 * getattr(default, name)) and getattr(default, name) > 0
    assert dataclasses.replace(link, **{name: getattr(default, name) for name in python_side}) == default
    assert LinkModel.for_profile(slow, per_action_overhead_ms=0.3).per_action_overhead_ms == 0.3
    wild = dataclasses.replace(base, host_call_ms=100 * HOST_CALL_REFERENCE_MS)  # a disturbed probe: bounded
    assert LinkModel.for_profile(wild).per_action_overhead_ms == pytest.approx(
        HOST_SCALE_RANGE[1] * default.per_action_overhead_ms)
    assert LinkModel.for_profile(dataclasses.replace(slow, device="cuda")) == LinkModel.for_device("cuda")
    assert LinkModel.for_profile(slow, per_action_overhead_ms=0.5).per_action_overhead_ms == 0.5  # asked: as asked
    # simulate's default link is the profile's: many actions cost more on the slower host
    many = candidate(Schedule.ONE_F_ONE_B, 2, 8, [2, 2])
    assert simulate(slow, many).step_time_ms > simulate(base, many).step_time_ms
    assert simulate(slow, many).step_time_ms == pytest.approx(simulate(base, many, link=link).step_time_ms)

def test_data_parallel_sync_overlaps_the_last_backward_bucket_by_bucket():
    """DistributedDataParallel's buckets (1 MiB, then 25 MiB each) are all-reduced as the last backward fills them,
    one after another; only what is left after the backward shows. A ring of 2 moves 1 MiB in 1 ms here."""
    mib = 2**20
    link = LinkModel(bandwidth_bytes_per_s=mib * 1e3, latency_s=0.0, per_action_overhead_ms=0.0,
                     optimizer_bytes_per_s=1e30)
    params = mib + 3 * 25 * mib  # four buckets: 1, 25, 25, 25 MiB
    est = simulate(profile_of(layer(f=1.0, b=200.0, params=params)), candidate(Schedule.GPIPE, 1, 1, [1], dp=2),
                   link=link)
    # The backward runs 1..201 ms, the gradients ready evenly: bucket k is full at 1 + 200 x (bytes so far / all).
    ready = [1 + 200 * done / 76 for done in (1, 26, 51, 76)]
    end = 0.0
    for at, size in zip(ready, (1, 25, 25, 25)):
        end = max(end, at) + size
    assert end == pytest.approx(226.0)
    assert est.allreduce_ms == pytest.approx(76.0)  # the same bytes moved
    assert est.step_time_ms == pytest.approx(end)  # not 201 + 76 = 277, the flat all-reduce after the backward


def test_where_collectives_take_the_ranks_own_time_the_buckets_follow_the_backward_and_pay_the_wake_once():
    """On the CPU stand-in gloo's all-reduces run on the core the rank computes on (DistributedDataParallel measured
    no faster than one all-reduce after the backward): every bucket waits for the backward's end, and the sync pays
    LinkModel.collective_wake_ms once (waking gloo's threads), not per bucket; a lone replica pays nothing."""
    mib = 2**20
    link = LinkModel(bandwidth_bytes_per_s=mib * 1e3, latency_s=0.0, per_action_overhead_ms=0.0,
                     optimizer_bytes_per_s=1e30, gradient_sync_overlaps=False, collective_wake_ms=3.0)
    prof = profile_of(layer(f=1.0, b=200.0, params=mib + 3 * 25 * mib))
    est = simulate(prof, candidate(Schedule.GPIPE, 1, 1, [1], dp=2), link=link)
    assert est.step_time_ms == pytest.approx(201.0 + 3.0 + 76.0)
    assert est.allreduce_ms == pytest.approx(3.0 + 76.0)
    alone = simulate(prof, candidate(Schedule.GPIPE, 1, 1, [1]), link=link)
    assert alone.step_time_ms == pytest.approx(201.0) and alone.allreduce_ms == 0.0
    # a split backward's flat all-reduce after the schedule pays it too
    split = profile_of(*[layer(f=1.0, b=100.0, w=100.0, params=(mib + 3 * 25 * mib) // 2)] * 2)
    zb = simulate(split, candidate(Schedule.ZBV_ZERO_BUBBLE, 1, 2, [1, 1], batch=4, dp=2), link=link)
    assert zb.allreduce_ms == pytest.approx(3.0 + 76.0)
    cpu = LinkModel.for_device("cpu")
    assert not cpu.gradient_sync_overlaps and cpu.collective_wake_ms > 0
    assert LinkModel.for_device("cuda").gradient_sync_overlaps


def test_a_replicated_stage_under_ddp_pays_its_forward_overhead_on_every_micro_batch():
    """DistributedDataParallel's forward costs every micro-batch's forward (LinkModel.replica_forward_overhead_ms),
    the ones under no_sync as well; not where the stages run without it: one replica, sharded, a split backward
    (one flat all-reduce after the schedule), tensor parallel (its replicas average after the schedule). CUDA has
    none (the host runs ahead of the GPU)."""
    link = dataclasses.replace(FREE, replica_forward_overhead_ms=0.5)
    prof = profile_of(layer(f=1.0, b=2.0))
    base = simulate(prof, candidate(Schedule.ONE_F_ONE_B, 1, 4, [1], dp=2), link=FREE).step_time_ms
    assert simulate(prof, candidate(Schedule.ONE_F_ONE_B, 1, 4, [1], dp=2), link=link).step_time_ms == \
        pytest.approx(base + 4 * 0.5)
    for other in (candidate(Schedule.ONE_F_ONE_B, 1, 4, [1]),
                  candidate(Schedule.ONE_F_ONE_B, 1, 4, [1], dp=2, data_parallel_mode="shard")):
        assert simulate(prof, other, link=link).step_time_ms == simulate(prof, other, link=FREE).step_time_ms
    split = profile_of(layer(f=1.0, b=1.0, w=1.0), layer(f=1.0, b=1.0, w=1.0))
    zb = candidate(Schedule.ZBV_ZERO_BUBBLE, 1, 2, [1, 1], batch=4, dp=2)
    assert simulate(split, zb, link=link).step_time_ms == simulate(split, zb, link=FREE).step_time_ms
    assert LinkModel.for_device("cpu").replica_forward_overhead_ms > 0
    assert LinkModel.for_device("cuda").replica_forward_overhead_ms == 0
    tp = candidate(Schedule.ONE_F_ONE_B, 1, 4, [1], dp=2, tensor_parallel_degree=2)
    assert simulate(prof, tp, link=link).step_time_ms == simulate(prof, tp, link=FREE).step_time_ms


def test_feasible_is_judged_against_the_limit():
    prof = profile_of(layer(saved=100), layer(saved=100))
    c = candidate(Schedule.GPIPE, 2, 4, [1, 1])
    assert simulate(prof, c, link=FREE).feasible
    assert simulate(prof, c, link=FREE, memory_limit_bytes=400).feasible
    tight = simulate(prof, c, link=FREE, memory_limit_bytes=399)
    assert not tight.feasible and tight.memory_limit_bytes == 399


def respects_dependencies(est, n_stages, pp):
    ends = {(e.stage, e.kind, e.microbatch): e for e in est.timeline}
    for e in est.timeline:
        if e.kind == "F" and e.stage > 0:
            assert e.start_ms >= ends[(e.stage - 1, "F", e.microbatch)].end_ms - 1e-9
        if e.kind in ("B", "I"):
            assert e.start_ms >= ends[(e.stage, "F", e.microbatch)].end_ms - 1e-9
            if e.stage < n_stages - 1:
                up = ends.get((e.stage + 1, "B", e.microbatch)) or ends[(e.stage + 1, "I", e.microbatch)]
                assert e.start_ms >= up.end_ms - 1e-9
        if e.kind == "W":
            assert e.start_ms >= ends[(e.stage, "I", e.microbatch)].end_ms - 1e-9
    for rank in range(pp):
        events = sorted((e for e in est.timeline if e.rank == rank), key=lambda e: e.start_ms)
        assert all(a.end_ms <= b.start_ms + 1e-9 for a, b in itertools.pairwise(events))


@pytest.mark.parametrize("schedule", list(Schedule))
def test_every_schedule_respects_dependencies_and_the_lower_bound(schedule):
    rng = random.Random(schedule.value)
    link = LinkModel.for_device("cpu")
    for pp, m in [(2, 4), (3, 6), (4, 8), (4, 16)]:
        n_stages = pp * default_stages_per_rank(schedule)
        layers = [layer(f=rng.uniform(0.5, 2), b=rng.uniform(0.5, 2), w=rng.uniform(0, 1), saved=100, out=1000,
                        params=rng.randrange(10, 10**7)) for _ in range(2 * n_stages)]
        c = candidate(schedule, pp, m, [2] * n_stages)
        est = simulate(profile_of(*layers), c, link=link)
        kinds = [e.kind for e in est.timeline]
        assert kinds.count("F") == n_stages * m
        assert kinds.count("B") + kinds.count("I") == n_stages * m
        assert kinds.count("W") == kinds.count("I")
        respects_dependencies(est, n_stages, pp)
        bound = step_time_lower_bound(layers, c, input_bytes=0,
                                      optimizer_ms_per_byte=1e3 / link.optimizer_bytes_per_s, link=link)
        assert 0 < bound <= est.step_time_ms + 1e-9, (pp, m)
        assert 0.0 <= est.bubble_fraction < 1.0
        json.dumps(est.to_dict())


@pytest.mark.parametrize("schedule, v", [(Schedule.ONE_F_ONE_B, 1), (Schedule.GPIPE, 1),
                                         (Schedule.INTERLEAVED_1F1B, 2), (Schedule.INTERLEAVED_1F1B, 4)])
def test_the_lower_bound_counts_the_pipelines_fill_and_drain(schedule, v):
    # Equal stages of f + b on a free link, v per rank: no order beats (m v + pp - 1)(f + b) (a rank's work plus
    # the fill and drain, 1/v of a micro-batch's pass through the rank), and 1F1B and GPipe reach it. The planner
    # prunes with this bound; without the fill and drain it was m v (f + b), 20-30 % low at pp = 16.
    pp, m = 4, 8
    n_stages = pp * v
    layers = [layer(f=1.0, b=2.0)] * n_stages
    c = candidate(schedule, pp, m, [1] * n_stages)
    bound = step_time_lower_bound(layers, c, input_bytes=0, optimizer_ms_per_byte=0.0, link=FREE)
    assert bound == pytest.approx((m * v + pp - 1) * 3.0)
    if v == 1:
        assert simulate(profile_of(*layers), c, link=FREE).step_time_ms == pytest.approx(bound)


def test_deadlocked_action_lists_are_refused():
    prof = profile_of(layer(), layer())
    c = candidate(Schedule.GPIPE, 2, 1, [1, 1])
    # rank 1 wants stage 1's backward before its forward
    stuck = [[Action(0, "F", 0), Action(0, "B", 0)], [Action(1, "B", 0), Action(1, "F", 0)]]
    with pytest.raises(DeadlockError, match="deadlocks: rank 0 at 0B0 waits for 1B0; rank 1 at 1B0 waits for 1F0"):
        simulate(prof, c, link=FREE, actions=stuck)
    crossed = [[Action(0, "B", 0), Action(0, "F", 0)], [Action(1, "F", 0), Action(1, "B", 0)]]
    with pytest.raises(DeadlockError, match="deadlocks"):
        simulate(prof, c, link=FREE, actions=crossed)
    missing = [[Action(0, "F", 0)], [Action(1, "F", 0), Action(1, "B", 0)]]
    with pytest.raises(DeadlockError, match="lack stage 0's work for micro-batch 0"):
        simulate(prof, c, link=FREE, actions=missing)
    good = [[Action(0, "F", 0), Action(0, "B", 0)], [Action(1, "F", 0), Action(1, "B", 0)]]
    assert simulate(prof, c, link=FREE, actions=good).step_time_ms == pytest.approx(6.0)


def test_candidate_must_fit_the_profile():
    with pytest.raises(InvalidCandidateError, match="covers 3 layers but the model has 2"):
        simulate(profile_of(layer(), layer()), candidate(Schedule.GPIPE, 2, 2, [2, 1]), link=FREE)


def test_link_model_defaults_and_overrides():
    cpu, cuda = LinkModel.for_device("cpu"), LinkModel.for_device("cuda")
    assert cuda.bandwidth_bytes_per_s > cpu.bandwidth_bytes_per_s
    assert cuda.per_action_overhead_ms < cpu.per_action_overhead_ms
    assert LinkModel.for_device("cpu", latency_s=0.0).latency_s == 0.0
    assert cpu.transfer_ms(0) == 0.0
    assert cpu.allreduce_ms(10**6, 1) == 0.0
    with pytest.raises(UsageError, match="unknown link model field"):
        LinkModel.for_device("cpu", bandwidth=1.0)
    with pytest.raises(UsageError, match="no link model for device 'tpu'"):
        LinkModel.for_device("tpu")


def test_schedule_graphs_are_kept_on_disk_between_runs(tmp_path, monkeypatch):
    from autotune import action_graph, graph_cache, schedules

    monkeypatch.setenv(graph_cache.CACHE_ENV, str(tmp_path))
    graph_cache.graph_folder.cache_clear()
    action_graph.compiled_graph.cache_clear()
    try:
        with graph_cache.planning():
            built = action_graph.compiled_graph(Schedule.INTERLEAVED_1F1B, 2, 4, 4)
        (stored,) = tmp_path.glob("graphs/*/Interleaved1F1B-pp2-m4-s4.pickle")
        # A new run (empty in-memory cache) reads the file: torch's schedule code is not asked again.
        action_graph.compiled_graph.cache_clear()
        monkeypatch.setattr(action_graph, "action_lists", lambda *args: pytest.fail("rebuilt a cached graph"))
        with graph_cache.planning():
            assert action_graph.compiled_graph(Schedule.INTERLEAVED_1F1B, 2, 4, 4) == built
        # A torn file is a miss: rebuilt from torch's lists and written whole again.
        stored.write_bytes(stored.read_bytes()[:100])
        action_graph.compiled_graph.cache_clear()
        monkeypatch.setattr(action_graph, "action_lists", schedules.action_lists)
        with graph_cache.planning():
            assert action_graph.compiled_graph(Schedule.INTERLEAVED_1F1B, 2, 4, 4) == built
            # Invalid combinations are refused as before, and nothing is stored for them.
            with pytest.raises(InvalidCandidateError):
                action_graph.compiled_graph(Schedule.INTERLEAVED_1F1B, 2, 5, 4)
        assert graph_cache.load_graph(stored) == built
        assert len(list(tmp_path.glob("graphs/*/*.pickle"))) == 1
    finally:
        graph_cache.graph_folder.cache_clear()
        action_graph.compiled_graph.cache_clear()


def test_an_empty_cache_setting_keeps_no_graphs(tmp_path, monkeypatch):
    from autotune import action_graph, graph_cache

    monkeypatch.setenv(graph_cache.CACHE_ENV, "")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    graph_cache.graph_folder.cache_clear()
    action_graph.compiled_graph.cache_clear()
    try:
        assert graph_cache.graph_folder() is None
        with graph_cache.planning():
            action_graph.compiled_graph(Schedule.ONE_F_ONE_B, 2, 4, 2)
        assert list(tmp_path.rglob("*")) == []
    finally:
        graph_cache.graph_folder.cache_clear()
        action_graph.compiled_graph.cache_clear()


PURE_PLANNER_SCRIPT = """
import os, subprocess, sys
sys.modules["torch"] = None  # the planning core imports no torch
import autotune.plan, autotune.simulate
from autotune.costs import LayerCost, Profile

started = []
real_popen = subprocess.Popen
def no_process(*args, **kwargs):
    started.append(args)
    raise AssertionError("the planner started a process")
subprocess.Popen = no_process
real_open = open
def no_write(file, mode="r", *args, **kwargs):
    if any(flag in mode for flag in "wax+"):
        raise AssertionError(f"the planner wrote {file}")
    return real_open(file, mode, *args, **kwargs)
import builtins
builtins.open = no_write

layer = LayerCost(forward_ms=1.0, backward_input_ms=1.0, backward_weight_ms=1.0, saved_bytes=2**20,
                  output_bytes=2**16, parameter_bytes=2**20)
profile = Profile.from_layer_costs([layer] * 8, input_bytes=2**10, device="cuda")
planned = autotune.plan.plan(profile, gpus=4, batch_size=16, memory_limit_bytes=None,
                             schedules=["1F1B", "VHalf", "VMin"])
assert planned and not started
print(len(planned))
"""


def test_the_planning_core_imports_no_torch_starts_no_process_and_writes_no_file(tmp_path):
    # Issue 22: the disk cache, the workers and the paused collector are the edge's (graph_cache.planning); plan()
    # alone, on schedules autotune generates itself, runs with torch unimportable and without any file or process.
    script = tmp_path / "pure.py"
    script.write_text(PURE_PLANNER_SCRIPT)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "AUTOTUNE_CACHE_DIR": str(tmp_path / "cache")})
    assert done.returncode == 0, done.stderr[-2000:]
    assert int(done.stdout) > 0
    assert not (tmp_path / "cache").exists()


AHEAD_SCRIPT = """
import json, sys
from autotune import graph_cache
from autotune.costs import LayerCost, Profile
from autotune.plan import plan

if __name__ == "__main__":
    if sys.argv[1] == "here":
        graph_cache.BUILT_AHEAD_FROM = 10**9
    block = LayerCost(forward_ms=4.0, backward_input_ms=4.0, backward_weight_ms=4.0, saved_bytes=2 * 2**30,
                      output_bytes=32 * 2**20, parameter_bytes=400 * 2**20)
    head = LayerCost(forward_ms=6.0, backward_input_ms=6.0, backward_weight_ms=6.0, saved_bytes=3 * 2**30,
                     output_bytes=4 * 2**20, parameter_bytes=500 * 2**20)
    profile = Profile.from_layer_costs([block] * 23 + [head], input_bytes=2**15, device="cuda")
    with graph_cache.planning():
        planned = plan(profile, gpus=32, batch_size=256, memory_limit_bytes=40 * 2**30, gpus_per_node=8)
    print(json.dumps({"torch": "torch" in sys.modules,
                      "planned": [[p.candidate.key, p.estimate.step_time_ms, p.estimate.feasible] for p in planned]}))
"""


def test_torch_orders_built_ahead_rank_the_same_without_importing_torch_here(tmp_path):
    # A fresh process planning 32 ranks needs ~100 of torch's orders: workers build them (importing torch) while the
    # planner simulates, which must change nothing but the time. Built here instead, the ranking is the same.
    from autotune.devices import usable_cores

    if usable_cores() < 2:
        pytest.skip("building ahead needs a second core")
    script = tmp_path / "plan32.py"
    script.write_text(AHEAD_SCRIPT)
    results = {}
    for mode in ("ahead", "here"):
        cache = tmp_path / f"cache-{mode}"
        done = subprocess.run([sys.executable, str(script), mode], capture_output=True, text=True, timeout=240,
                              env={**os.environ, "AUTOTUNE_CACHE_DIR": str(cache)})
        assert done.returncode == 0, done.stderr[-2000:]
        results[mode] = json.loads(done.stdout)
        assert not list(cache.rglob(".*.tmp")), "a stopped worker's temp file was left in the cache"
    assert results["ahead"]["torch"] is False
    assert results["here"]["torch"] is True
    assert len(results["ahead"]["planned"]) > 100
    assert results["ahead"]["planned"] == results["here"]["planned"]


def test_a_graph_whose_worker_ends_without_it_is_built_here(tmp_path):
    from autotune import graph_cache

    quit_early = subprocess.Popen([sys.executable, "-c", "pass"])
    assert graph_cache._await_ahead(tmp_path / "never.pickle", quit_early) is None


# --- sharded (FSDP2) -----------------------------------------------------------------------------------------------


def test_all_gather_and_reduce_scatter_are_the_halves_of_the_all_reduce():
    """A ring of 4 on one node: 3 steps of a quarter each (8 MB at 1 GB/s: 3 x 2 ms); over 2 nodes of 2, a ring of 2
    inside (1 step of 4 MB: 4 ms) and one of the half across, on the inter-node link (1 step of 2 MB at 0.5 GB/s)."""
    link = LinkModel(bandwidth_bytes_per_s=1e9, latency_s=0.0, per_action_overhead_ms=0.0, optimizer_bytes_per_s=1e30,
                     inter_node_bandwidth_bytes_per_s=0.5e9)
    assert link.all_gather_ms(8e6, 4) == link.reduce_scatter_ms(8e6, 4) == pytest.approx(6.0)
    assert link.allreduce_ms(8e6, 4) == pytest.approx(12.0)
    assert link.all_gather_ms(8e6, 4, n_nodes=2) == pytest.approx(4.0 + 4.0)
    assert link.allreduce_ms(8e6, 4, n_nodes=2) == pytest.approx(2 * link.reduce_scatter_ms(8e6, 4, n_nodes=2))
    assert link.all_gather_ms(8e6, 1) == link.reduce_scatter_ms(0, 4) == 0.0


def test_collectives_inside_a_node_go_at_their_own_rate_and_passes_and_across_at_the_links():
    """gloo on the CPU stand-in: a collective's ring steps go at 0.5 GB/s here, not a send's 1 GB/s, an all-gather
    costs two passes and a reduce-scatter three inside a node. 8 MB over 2 ranks: a pass is 1 step of 4 MB, 8 ms.
    Across 2 nodes of 1: the inter-node link's own rate (0.25 GB/s: 16 ms a pass), not the collectives' rate inside a
    node, one pass for an all-gather and reduce_scatter_passes_across_nodes (2 here) for a reduce-scatter."""
    link = LinkModel(bandwidth_bytes_per_s=1e9, latency_s=0.0, per_action_overhead_ms=0.0, optimizer_bytes_per_s=1e30,
                     collective_bandwidth_bytes_per_s=0.5e9, all_gather_passes=2, reduce_scatter_passes=3,
                     reduce_scatter_passes_across_nodes=2, inter_node_bandwidth_bytes_per_s=0.25e9)
    assert link.allreduce_ms(8e6, 2) == pytest.approx(16.0)
    assert link.all_gather_ms(8e6, 2) == pytest.approx(16.0)
    assert link.reduce_scatter_ms(8e6, 2) == pytest.approx(24.0)
    assert link.transfer_ms(4e6) == pytest.approx(4.0)  # sends keep the point-to-point rate
    assert link.allreduce_ms(8e6, 2, n_nodes=2) == pytest.approx(32.0)
    assert link.all_gather_ms(8e6, 2, n_nodes=2) == pytest.approx(16.0)
    assert link.reduce_scatter_ms(8e6, 2, n_nodes=2) == pytest.approx(32.0)
    # 2 nodes of 2: inside each node the collectives' passes over the whole tensor, across the link the half
    assert link.reduce_scatter_ms(8e6, 4, n_nodes=2) == pytest.approx(3 * 8.0 + 2 * 8.0)
    cpu, cuda = LinkModel.for_device("cpu"), LinkModel.for_device("cuda")
    assert cpu.collective_bandwidth_bytes_per_s < cpu.bandwidth_bytes_per_s
    assert (cpu.all_gather_passes, cpu.reduce_scatter_passes) == (2, 3) and cpu.shard_unit_overhead_ms > 0
    assert cpu.shard_unit_overhead_ms_per_mib > 0 and cpu.sharded_optimizer_group_ms > 0
    assert cuda.collective_bandwidth_bytes_per_s is None and cuda.shard_unit_overhead_ms == 0.0
    assert cuda.shard_unit_overhead_ms_per_mib == cuda.sharded_optimizer_group_ms == 0.0
    assert (cuda.all_gather_passes, cuda.reduce_scatter_passes, cuda.reduce_scatter_passes_across_nodes) == (1, 1, 1)
    assert cpu.reduce_scatter_passes_across_nodes == 2
    # gloo's all-gather across nodes: 1.5 passes (bench/internode.py's collective table); NCCL's one
    assert cpu.all_gather_passes_across_nodes == 1.5 and cuda.all_gather_passes_across_nodes == 1.0
    gloo = dataclasses.replace(link, all_gather_passes_across_nodes=1.5)
    assert gloo.all_gather_ms(8e6, 2, n_nodes=2) == pytest.approx(24.0)
    assert gloo.all_gather_ms(8e6, 2) == pytest.approx(16.0)  # inside a node: all_gather_passes


WIRE_1GBS = LinkModel(bandwidth_bytes_per_s=1e9, latency_s=0.0, per_action_overhead_ms=0.0,
                      optimizer_bytes_per_s=1e12)


def test_fsdp2s_hooks_cost_each_action_per_sharded_unit_and_its_optimizer_each_module():
    """The keep case below (F0 B0 F1 B1 on one rank, two sharded units of 4 MB) with hooks of 0.5 ms per unit and
    0.25 ms per MiB of the stage's parameters, per action: 4 x (2 x 0.5 + 0.25 x 8e6 / 2**20) on the rank's own
    time; the optimizer over DTensor shards 1.5 ms per module holding parameters (one a layer here). A replicated
    candidate pays none of it."""
    prof = Profile.from_layer_costs([layer(f=1.0, b=1.0, w=1.0, params=4_000_000)] * 2)
    hooked = dataclasses.replace(WIRE_1GBS, shard_unit_overhead_ms=0.5, shard_unit_overhead_ms_per_mib=0.25,
                                 sharded_optimizer_group_ms=1.5)
    shard = candidate(Schedule.ONE_F_ONE_B, 1, 2, [2], dp=2, data_parallel_mode="shard")
    plain, charged = simulate(prof, shard, link=WIRE_1GBS), simulate(prof, shard, link=hooked)
    assert charged.optimizer_ms == pytest.approx(plain.optimizer_ms + 2 * 1.5)
    assert charged.step_time_ms == pytest.approx(plain.step_time_ms + 4 * (2 * 0.5 + 0.25 * 8e6 / 2**20) + 3.0)
    replicate = candidate(Schedule.ONE_F_ONE_B, 1, 2, [2], dp=2)
    assert simulate(prof, replicate, link=hooked).step_time_ms == simulate(prof, replicate, link=WIRE_1GBS).step_time_ms


@pytest.mark.parametrize(
    "precision, reshard, gathers, step",
    [
        # keep: F0 gathers (unit 2 ms exposed, the rest 2 ms behind F's 2 ms of compute), B1 reduces (4 ms)
        ("fp32", False, [True, False, False, False], (2 + 2) + 4 + 2 + (4 + 4)),
        # reshard: F0 gathers, B0 gathers again (2 ms exposed, the rest behind its 4 ms); F1 finds it gathered (a
        # backward leaves it so) and reshards it after, so B1 gathers once more
        ("fp32", True, [True, True, False, True], (2 + 2) + (4 + 2) + 2 + (4 + 2 + 4)),
        # bf16: half the bytes to gather (1 ms a unit), the same float32 gradients to reduce
        ("bf16", False, [True, False, False, False], (2 + 1) + 4 + 2 + (4 + 4)),
    ],
)
def test_sharded_step_time_adds_the_gathers_compute_cannot_hide_and_the_reduce_scatter(precision, reshard, gathers,
                                                                                      step):
    """pp 1 x dp 2, 1F1B over 2 micro-batches (F0 B0 F1 B1), two layers of 4 MB each: F 2 ms, B 4 ms. An all-gather
    over 2 ranks moves half its bytes (a 4 MB unit: 2 ms at 1 GB/s); the reduce-scatter of the stage's 8 MB of
    float32 gradients 4 ms; AdamW steps over the rank's half of the parameters."""
    prof = Profile.from_layer_costs([layer(f=1.0, b=1.0, w=1.0, params=4_000_000)] * 2, precision=precision)
    c = candidate(Schedule.ONE_F_ONE_B, 1, 2, [2], dp=2, precision=precision, data_parallel_mode="shard",
                  reshard_after_forward=reshard)
    est = simulate(prof, c, link=WIRE_1GBS)
    optimizer = 8e6 / 2 / 1e12 * 1e3
    assert est.step_time_ms == pytest.approx(step + optimizer)
    assert est.optimizer_ms == pytest.approx(optimizer)
    per_gather = 4.0 if precision == "fp32" else 2.0  # the whole stage's gather time, hidden or not
    assert est.gather_ms == pytest.approx(per_gather * sum(gathers))
    assert est.reduce_scatter_ms == pytest.approx(4.0) and est.allreduce_ms == 0.0
    assert step_time_lower_bound(prof.layer_costs(1), c, input_bytes=0, optimizer_ms_per_byte=1e3 / 1e12,
                                 link=WIRE_1GBS) <= est.step_time_ms


def test_a_replicated_candidate_all_reduces_and_a_profile_of_another_precision_is_refused():
    prof = Profile.from_layer_costs([layer(f=1.0, b=1.0, w=1.0, params=4_000_000)] * 2)
    replicated = simulate(prof, candidate(Schedule.ONE_F_ONE_B, 1, 2, [2], dp=2), link=WIRE_1GBS)
    assert replicated.allreduce_ms == pytest.approx(8.0) and replicated.gather_ms == replicated.reduce_scatter_ms == 0
    with pytest.raises(UsageError, match="profile was measured in fp32 but the candidate trains in bf16; profile "
                                         "again with --precision bf16"):
        simulate(prof, candidate(Schedule.ONE_F_ONE_B, 1, 2, [2], dp=2, precision="bf16"))


def test_the_profiles_device_workspaces_are_in_every_ranks_peak_and_its_feasibility():
    """cuBLAS's workspaces (Profile.device_workspace_bytes, measured by the profiler on CUDA) are held by every rank
    whatever its stage: on an H200 they were most of a small model's peak (bench/results/cuda_first_run.md)."""
    profile = profile_of(*[layer(f=1.0, b=2.0, params=1000, saved=100)] * 2)
    with_workspaces = dataclasses.replace(profile, device_workspace_bytes=64 * 2**20)
    c = candidate(Schedule.ONE_F_ONE_B, 2, 4, [1, 1])
    plain, held = simulate(profile, c, link=FREE), simulate(with_workspaces, c, link=FREE)
    assert [h - p for h, p in zip(held.peak_memory_bytes, plain.peak_memory_bytes)] == [64 * 2**20] * 2
    limit = max(plain.peak_memory_bytes) + 2**20
    assert simulate(profile, c, link=FREE, memory_limit_bytes=limit).feasible
    assert not simulate(with_workspaces, c, link=FREE, memory_limit_bytes=limit).feasible
    assert Profile.from_dict(json.loads(json.dumps(with_workspaces.to_dict()))).device_workspace_bytes == 64 * 2**20
    assert Profile.from_dict(profile.to_dict()).device_workspace_bytes == 0


def test_the_planner_counts_the_device_workspaces_as_simulate_does():
    from autotune.plan import plan

    profile = dataclasses.replace(profile_of(*[layer(f=1.0, b=2.0, params=1000, saved=100)] * 4),
                                  device_workspace_bytes=2**20)
    planned = plan(profile, gpus=2, batch_size=8, memory_limit_bytes=None, link=FREE)
    for p in planned[:5]:
        assert p.estimate.peak_memory_bytes == simulate(profile, p.candidate, link=FREE).peak_memory_bytes


def test_the_last_stage_keeps_the_loss_input_and_the_loss_backward_as_profiled():
    """bf16: the last stage keeps its output as the loss gets it (float32, Profile.loss_input_bytes), and the loss's
    backward holds what the profile measured (Profile.loss_backward_bytes), not twice the bfloat16 output; profiles
    without them are predicted as before (the output, twice the output). The planner counts them as simulate does."""
    from autotune.plan import plan

    profile = profile_of(layer(params=1000, saved=100, out=500), layer(params=1000, saved=100, out=1000))
    c = candidate(Schedule.GPIPE, 2, 1, [1, 1])

    def peaks(loss_input: int, loss_backward: int) -> list[int]:
        measured = dataclasses.replace(profile, loss_input_bytes=(loss_input,), loss_backward_bytes=(loss_backward,))
        return simulate(measured, c, link=FREE).peak_memory_bytes

    assert simulate(profile, c, link=FREE).peak_memory_bytes == peaks(1000, 2000)
    assert [a - b for a, b in zip(peaks(2000, 40000), peaks(1000, 40000))] == [0, 1000]  # held until the backward
    assert [a - b for a, b in zip(peaks(2000, 50000), peaks(2000, 40000))] == [0, 10000]
    measured = dataclasses.replace(profile, loss_input_bytes=(2000,), loss_backward_bytes=(4000,))
    again = Profile.from_dict(json.loads(json.dumps(measured.to_dict())))
    assert (again.loss_input_bytes, again.loss_backward_bytes) == ((2000,), (4000,))
    assert Profile.from_dict(profile.to_dict()).loss_input_bytes == ()
    for p in plan(measured, gpus=2, batch_size=2, memory_limit_bytes=None, link=FREE)[:5]:
        assert p.estimate.peak_memory_bytes == simulate(measured, p.candidate, link=FREE).peak_memory_bytes


def test_a_checkpointed_w_keeps_what_its_group_passes_recomputed():
    """simulate._weight_recompute_bytes by hand: two layers of 50 bytes rebuilt, two groups each. Unmeasured: every
    group keeps the stage's recompute (4 x 100). Measured (60 each alone: 30 a group, so the weight paths hold
    (50 - 30) / (1 - 1/4) = 26.7 and the rest 23.3): the first layer's groups keep their own 30 and the second
    layer's 50, the second's their own 30 and the first's 23.3, and the last recompute is in flight but for its own
    layer's 50 (the layer measured alone held it already). One layer: what it holds measured alone, no more
    (bench/models/gpt2block.py's one-block stages were +8 .. +15 % with the recompute counted twice)."""
    from autotune.simulate import _weight_recompute_bytes

    assert _weight_recompute_bytes(100, [50, 50], [2, 2], [None, None]) == 400
    assert _weight_recompute_bytes(100, [50, 50], [2, 2], [60, 60]) == int(2 * (30 + 50) + 2 * (30 + 70 / 3) + 50)
    assert _weight_recompute_bytes(50, [50], [2], [60]) == 60
    assert _weight_recompute_bytes(0, [50, 50], [2, 2], [60, 60]) == 0


def test_a_checkpointed_w_composes_its_layers_pass_by_pass():
    """simulate._composed_weight_recompute_bytes by hand: two layers rebuilt 50 and 40, two passes each, each pass
    (peak recomputing, peak walking, keeps after). At pass p of a layer after n earlier passes, recomputing: what it
    adds alone (its peak less its p - 1 earlier recomputes, each keeping what it kept after pass p - 1; before the
    first, all it rebuilt) + the other layer's rebuilt bytes + (n + p - 1) x (what stays of earlier layers + its
    keeps after p - 1 + later layers' rebuilt bytes); walking: alone less p - 1 keeps after p, + (n + p) x (earlier
    layers' kept + later layers' rebuilt) + (n + p - 1) x its keeps after p. Less what earlier layers' W let go of
    (6). A later layer's saved input (7 here) counts as kept throughout. The first layer is held (a later one keeps
    its graph), the last free. A layer with parameters and no measurement: None (the old rule then)."""
    from autotune.costs import CheckpointPasses
    from autotune.simulate import _composed_weight_recompute_bytes

    first = CheckpointPasses(free=((60, 55, 30), (70, 60, 10)), held=((60, 55, 30), (80, 70, 28)), kept=20, let_go=6)
    second = CheckpointPasses(free=((45, 40, 25), (55, 50, 5)), held=((45, 40, 25), (60, 55, 24)), kept=15, let_go=4)
    candidates = [
        60 + 40, 55 + 40,  # first layer, pass 1: recomputing, walking
        (80 - 30) + 40 + 1 * (30 + 40), (70 - 28) + 2 * 40 + 1 * 28,  # pass 2
        (45 + 7) + 50 + 2 * (20 + 40) - 6, (40 + 7) + 3 * 20 + 2 * (25 + 7) - 6,  # second layer, pass 1
        (55 + 7 - (25 + 7)) + 50 + 3 * (20 + 25 + 7) - 6, (50 + 7 - (5 + 7)) + 4 * 20 + 3 * (5 + 7) - 6,  # pass 2
    ]
    assert _composed_weight_recompute_bytes(90, [50, 40], [2, 2], [first, second], [0, 7]) == max(candidates) == 230
    assert _composed_weight_recompute_bytes(90, [50, 40], [2, 2], [first, None], [0, 7]) is None
    # what a layer saves of its input stays after its passes only where none of them walks the node that saved it
    # (input_kept; RMSNorm's pow, not LayerNorm's): a third layer's one pass (peak 1000) after four counts it 4 times
    import dataclasses as dc
    third = CheckpointPasses(free=((1000, 0, 0),), held=((1000, 0, 0),), kept=0)
    kept_input = _composed_weight_recompute_bytes(100, [50, 40, 10], [2, 2, 1], [first, second, third], [0, 7, 0])
    walked = _composed_weight_recompute_bytes(100, [50, 40, 10], [2, 2, 1],
                                              [first, dc.replace(second, input_kept=False), third], [0, 7, 0])
    assert kept_input - walked == 4 * 7 and walked == 1000 + 90 + 4 * (20 + 15 + 10) - (6 + 4)
    # a layer without parameters runs no pass: all it rebuilt stays while a later layer's graph holds it
    assert _composed_weight_recompute_bytes(50, [10, 40], [0, 2], [None, second], [0, 0]) == max(
        45 + 10, 40 + 10, 55 - 25 + 10 + 1 * (10 + 25), 50 - 5 + 2 * 10 + 1 * 5) == 75


def test_a_profile_keeps_its_checkpoint_passes():
    """Profile.to_dict / from_dict carry costs.CheckpointPasses per size, and layer_costs interpolates them (sizes
    with different numbers of passes: None)."""
    from autotune.costs import CheckpointPasses

    one = CheckpointPasses(free=((100, 90, 40), (120, 100, 10)), held=((100, 90, 40), (130, 120, 30)), kept=25,
                           let_go=8)
    two = CheckpointPasses(free=((200, 180, 80), (240, 200, 20)), held=((200, 180, 80), (260, 240, 60)), kept=50,
                           let_go=16)
    assert CheckpointPasses.interpolated([one, two], lambda values: (values[0] + values[1]) / 2) == CheckpointPasses(
        free=((150, 135, 60), (180, 150, 15)), held=((150, 135, 60), (195, 180, 45)), kept=38, let_go=12)
    walked = CheckpointPasses(free=one.free, held=one.held, kept=25, input_kept=False)
    assert CheckpointPasses.from_dict(walked.to_dict()) == walked and walked.map(lambda n: n).input_kept is False
    old = {k: v for k, v in one.to_dict().items() if k != "input_kept"}  # profiles before it: kept
    assert CheckpointPasses.from_dict(old).input_kept is True
    short = CheckpointPasses(free=((100, 90, 40),), held=((100, 90, 40),), kept=0)
    assert CheckpointPasses.interpolated([one, short], lambda values: values[0]) is None
    assert CheckpointPasses.from_dict(json.loads(json.dumps(one.to_dict()))) == one
    assert one.map(lambda n: n // 2) == CheckpointPasses(
        free=((50, 45, 20), (60, 50, 5)), held=((50, 45, 20), (65, 60, 15)), kept=12, let_go=4)


def test_a_sharded_bf16_rank_holding_both_uses_of_a_tie_casts_it_per_forward():
    """sharding.shard_stage leaves a tie held twice on a rank out of FSDP, float32, and runs its holders under
    autocast: the layer that casts it (a tied LM head, its profiled autocast copy 100) keeps a bfloat16 copy, capped
    at half the tied float32 bytes (160 -> 80). Not where the uses are on two ranks (each shards its own), nor
    unsharded (autocast_copy_bytes counts the copies there)."""
    from autotune.simulate import _sharded_tied_cast_bytes

    shard = Candidate(schedule=Schedule.ONE_F_ONE_B, pipeline_degree=1, data_parallel_degree=2,
                      data_parallel_mode="shard", global_batch_size=8, n_microbatches=2, layers_per_stage=(3,),
                      precision="bf16")
    tie = [((0, 2), 160)]
    assert _sharded_tied_cast_bytes([0, 0, 100], tie, [0, 3], [0], candidate=shard) == [80]
    assert _sharded_tied_cast_bytes([0, 0, 100], tie, [0, 1, 3], [0, 1], candidate=shard) == [0, 0]
    assert _sharded_tied_cast_bytes([0, 0, 100], tie, [0, 1, 2, 3], [0, 1, 0], candidate=shard) == [0, 0, 80]
    unsharded = dataclasses.replace(shard, data_parallel_mode="replicate")
    assert _sharded_tied_cast_bytes([0, 0, 100], tie, [0, 3], [0], candidate=unsharded) == [0]
