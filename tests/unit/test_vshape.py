from collections import Counter

import pytest

from autotune.errors import InvalidCandidateError
from autotune.schedules import Schedule, action_lists, one_f_one_b, stage_ranks, validate_schedule
from autotune.vshape import PERIOD, _block, activation_cap, v_shape_actions

V_SCHEDULES = {Schedule.V_HALF: "half", Schedule.V_MIN: "min"}


def render(actions):
    return " ".join(str(a) for a in actions)


def replay(lists, n_stages):
    """Run per-rank lists with every action one slot long, each as soon as its rank is free and its inputs exist.
    Returns the makespan in slots; fails on a deadlock (a dependency cycle between the ranks' orders)."""
    done: dict[tuple[int, str, int], int] = {}
    position = [0] * len(lists)
    slot = 0
    while any(position[r] < len(lists[r]) for r in range(len(lists))):
        # Unit costs: what finished by this slot is all there will be if no rank can move now.
        progressed = False
        for rank, actions in enumerate(lists):
            if position[rank] == len(actions):
                continue
            a = actions[position[rank]]
            if a.kind == "F":
                needs = [(a.stage - 1, "F", a.microbatch)] if a.stage > 0 else []
            elif a.kind == "I":
                needs = [(a.stage, "F", a.microbatch)]
                needs += [(a.stage + 1, "I", a.microbatch)] if a.stage < n_stages - 1 else []
            else:
                needs = [(a.stage, "I", a.microbatch)]
            if all(done.get(n, slot + 1) <= slot for n in needs):
                done[a.stage, a.kind, a.microbatch] = slot + 1
                position[rank] += 1
                progressed = True
        assert progressed, (
            f"deadlock at slot {slot}: next actions {[a[p] for a, p in zip(lists, position) if p < len(a)]}"
        )
        slot += 1
    return slot


def held_peaks(lists):
    """Per rank, the most stage activations held at once: F keeps one, W (after I) or B lets it go."""
    peaks = []
    for actions in lists:
        held = peak = 0
        for a in actions:
            held += {"F": 1, "I": 0, "W": -1, "B": -1}[a.kind]
            peak = max(peak, held)
        peaks.append(peak)
    return peaks


@pytest.mark.parametrize("schedule", list(V_SCHEDULES))
@pytest.mark.parametrize("pp", [1, 2, 3, 4, 5, 6, 8])
@pytest.mark.parametrize("m", [1, 2, 5, 16])
def test_each_action_once_on_its_rank_and_the_orders_run_without_deadlock(schedule, pp, m):
    n_stages = 2 * pp
    lists = action_lists(schedule, pp, m, n_stages)
    assert len(lists) == pp
    seen = Counter((a.stage, a.kind, a.microbatch) for actions in lists for a in actions)
    assert seen == Counter((s, k, mb) for s in range(n_stages) for k in "FIW" for mb in range(m))
    ranks = stage_ranks(schedule, pp, n_stages)
    for rank, actions in enumerate(lists):
        assert {a.stage for a in actions} == {rank, n_stages - 1 - rank}
        assert all(ranks[a.stage] == rank for a in actions)
        for stage in (rank, n_stages - 1 - rank):
            for kind in "FIW":  # each stage runs each kind in micro-batch order (torch's loss list relies on it)
                assert [a.microbatch for a in actions if a.stage == stage and a.kind == kind] == list(range(m))
    replay(lists, n_stages)


def test_v_half_literal_orders_pp2():
    assert [render(r) for r in action_lists(Schedule.V_HALF, 2, 4, 4)] == [
        "0F0 0F1 0F2 3F0 3I0 3W0 3F1 3I1 0I0 3W1 0W0 3F2 0F3 3I2 0I1 3W2 0W1 3F3 3I3 3W3 0I2 0W2 0I3 0W3",
        "1F0 2F0 1F1 2F1 2I0 2W0 1I0 1W0 1F2 2F2 2I1 2W1 1I1 1W1 1F3 2F3 2I2 2W2 1I2 1W2 2I3 2W3 1I3 1W3",
    ]


def test_v_min_literal_orders_pp2():
    assert [render(r) for r in action_lists(Schedule.V_MIN, 2, 4, 4)] == [
        "0F0 3F0 3I0 3W0 0F1 0I0 0W0 3F1 3I1 3W1 0F2 0I1 0W1 3F2 3I2 3W2 0F3 0I2 0W2 3F3 3I3 3W3 0I3 0W3",
        "1F0 2F0 2I0 1I0 1F1 2F1 2W0 1W0 2I1 1I1 1F2 2F2 2W1 1W1 2I2 1I2 1F3 2F3 2W2 1W2 2I3 1I3 2W3 1W3",
    ]


@pytest.mark.parametrize(
    "schedule,pp,peaks",
    [
        # In V-stage activations (half a 1F1B stage). 1F1B's first rank holds p whole stages = 2p: 4 at pp=2, 8 at 4.
        (Schedule.V_HALF, 2, [4, 4]),  # (p+2)//2 = 2 whole stages: no saving at pp=2
        (Schedule.V_MIN, 2, [2, 4]),  # rank 0 holds one whole stage, rank 1 two
        (Schedule.V_HALF, 4, [6, 6, 6, 6]),  # 3 whole stages against 1F1B's 4
        (Schedule.V_MIN, 4, [4, 4, 4, 4]),  # 2 against 4
    ],
)
def test_held_activations_literal(schedule, pp, peaks):
    assert held_peaks(action_lists(schedule, pp, 4 * pp, 2 * pp)) == peaks
    assert max(held_peaks([one_f_one_b(0, pp, 4 * pp)])) == pp  # whole stages, so 2 * pp V-stage activations


@pytest.mark.parametrize("schedule", list(V_SCHEDULES))
@pytest.mark.parametrize("pp", range(1, 13))
def test_every_rank_stays_within_the_papers_cap(schedule, pp):
    cap = activation_cap(V_SCHEDULES[schedule], pp)
    for m in (pp, 4 * pp):
        assert max(held_peaks(action_lists(schedule, pp, m, 2 * pp))) <= 2 * cap


def test_activation_cap_formulas():
    assert [activation_cap("half", p) for p in (2, 4, 8, 16)] == [2, 3, 5, 9]
    assert [activation_cap("min", p) for p in (2, 4, 8, 16)] == [2, 2, 4, 6]


@pytest.mark.parametrize("pp", [2, 4, 8])
def test_bubbles_against_1f1b_with_equal_f_i_w(pp):
    """Unit-cost makespan minus the 6 x m slots of work per rank; 1F1B's bubble is (p-1) x 6 here (T_F+T_B+T_W of
    a whole stage). Paper: V-Half about 1/2 of it, V-Min about 2/3."""
    m = 4 * pp
    one_f_one_b_bubble = (pp - 1) * PERIOD
    v_half = replay(action_lists(Schedule.V_HALF, pp, m, 2 * pp), 2 * pp) - PERIOD * m
    v_min = replay(action_lists(Schedule.V_MIN, pp, m, 2 * pp), 2 * pp) - PERIOD * m
    assert v_half <= 0.6 * one_f_one_b_bubble
    assert v_min <= 0.7 * one_f_one_b_bubble


@pytest.mark.parametrize("memory", ["half", "min"])
def test_building_block_slots_differ_modulo_the_period(memory):
    for pp in range(1, 65):
        for rank in range(pp):
            slots = list(_block(memory, pp, rank).values())
            assert len({s % PERIOD for s in slots}) == 4, (pp, rank, slots)


def test_v_shape_actions_is_what_action_lists_returns():
    assert v_shape_actions("min", 3, 6) == action_lists(Schedule.V_MIN, 3, 6, 6)


@pytest.mark.parametrize("schedule", list(V_SCHEDULES))
def test_v_schedules_need_two_stages_per_rank(schedule):
    with pytest.raises(InvalidCandidateError, match="exactly 2 stage"):
        validate_schedule(schedule, pipeline_degree=2, n_microbatches=4, n_stages=2)
    validate_schedule(schedule, pipeline_degree=4, n_microbatches=1, n_stages=8)  # any micro-batch count
