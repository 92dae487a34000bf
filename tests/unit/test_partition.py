import itertools
import random

import pytest

from autotune.candidate import uniform_split as uniform
from autotune.errors import InfeasibleError, InvalidCandidateError, UsageError
from autotune.partition import (
    additive_memory,
    balance_for_schedule,
    balance_min_max,
    balance_under_memory,
    bottleneck,
    min_memory_cap,
    part_costs,
    rank_loads,
)
from autotune.schedules import Schedule


def compositions(n, k):
    """Every split of n layers into k non-empty contiguous parts."""
    for cuts in itertools.combinations(range(1, n), k - 1):
        bounds = (0, *cuts, n)
        yield tuple(b - a for a, b in itertools.pairwise(bounds))


def test_uniform_gives_the_remainder_to_early_parts():
    assert uniform(10, 4) == (3, 3, 2, 2)
    assert uniform(4, 4) == (1, 1, 1, 1)
    with pytest.raises(InvalidCandidateError, match="5 stages need at least 5 layers but the model has 4"):
        uniform(4, 5)


def test_part_costs_and_bottleneck_literal():
    assert part_costs([1, 2, 3, 4, 5], (3, 2)) == [6, 9]
    assert bottleneck([1, 2, 3, 4, 5], (4, 1)) == 10


@pytest.mark.parametrize(
    "costs, parts, expected",
    [
        ([1, 2, 3, 4, 5], 2, (3, 2)),  # 6 | 9 beats 10 | 5
        ([5, 1, 1, 1, 1, 1], 2, (1, 5)),  # the heavy layer alone
        ([1, 1, 1, 1, 1, 1, 1, 1], 4, (2, 2, 2, 2)),
        ([10, 1, 1, 10], 3, (1, 2, 1)),
        ([0, 0, 0], 3, (1, 1, 1)),
    ],
)
def test_min_max_hand_worked(costs, parts, expected):
    assert balance_min_max(costs, parts) == expected


def test_min_max_matches_brute_force_on_random_costs():
    rng = random.Random(7)
    for _ in range(300):
        n = rng.randint(1, 9)
        k = rng.randint(1, n)
        costs = [rng.choice([0.0, 1.0, 2.5, rng.random() * 10]) for _ in range(n)]
        split = balance_min_max(costs, k)
        assert len(split) == k and sum(split) == n and min(split) >= 1
        best = min(bottleneck(costs, s) for s in compositions(n, k))
        assert bottleneck(costs, split) == pytest.approx(best, rel=1e-9, abs=1e-12), (costs, k, split)


def test_min_max_refuses_bad_input():
    with pytest.raises(InvalidCandidateError, match="3 stages need at least 3 layers"):
        balance_min_max([1.0, 2.0], 3)
    with pytest.raises(UsageError, match="non-negative"):
        balance_min_max([1.0, -2.0], 2)
    with pytest.raises(UsageError, match="at least one"):
        balance_min_max([1.0], 0)


def test_memory_cap_changes_the_split():
    costs = [1.0] * 6
    memory = additive_memory([10, 1, 1, 1, 1, 1])
    assert balance_min_max(costs, 2) == (3, 3)  # part 0 would hold 12 bytes
    assert balance_under_memory(costs, 2, stage_memory=memory, memory_cap=11) == (2, 4)


def test_memory_aware_matches_brute_force_on_random_costs():
    rng = random.Random(11)
    checked = 0
    for _ in range(300):
        n = rng.randint(2, 8)
        k = rng.randint(1, n)
        costs = [rng.random() * 10 for _ in range(n)]
        layer_bytes = [rng.randint(1, 20) for _ in range(n)]
        fixed = rng.choice([0, 5])
        memory = additive_memory(layer_bytes, fixed_bytes=fixed)
        cap = rng.randint(max(layer_bytes) + fixed, sum(layer_bytes) + fixed)
        fitting = [s for s in compositions(n, k)
                   if all(fixed + b <= cap for b in part_costs(layer_bytes, s))]
        if not fitting:
            with pytest.raises(InfeasibleError):
                balance_under_memory(costs, k, stage_memory=memory, memory_cap=cap)
            continue
        split = balance_under_memory(costs, k, stage_memory=memory, memory_cap=cap)
        assert all(fixed + b <= cap for b in part_costs(layer_bytes, split))
        assert bottleneck(costs, split) == pytest.approx(min(bottleneck(costs, s) for s in fitting), rel=1e-9)
        checked += 1
    assert checked > 100


def test_infeasible_memory_says_what_would_fit():
    memory = additive_memory([4, 4, 4, 4])
    # Two parts of 8 bytes each is the leanest split.
    assert min_memory_cap(4, 2, memory) == pytest.approx(8, rel=2e-3)
    with pytest.raises(InfeasibleError, match=r"under 7 B \(the leanest split needs 8 B per stage\)"):
        balance_under_memory([1.0] * 4, 2, stage_memory=memory, memory_cap=7)


def test_rank_loads_follow_loop_and_v_placement():
    costs = [1, 2, 3, 4]
    assert rank_loads(costs, (1, 1, 1, 1), Schedule.INTERLEAVED_1F1B, 2) == [4, 6]  # ranks hold 0,2 and 1,3
    assert rank_loads(costs, (1, 1, 1, 1), Schedule.ZBV_ZERO_BUBBLE, 2) == [5, 5]  # ranks hold 0,3 and 1,2
    assert rank_loads(costs, (2, 2), Schedule.GPIPE, 2) == [3, 7]


def test_single_stage_schedules_get_the_exact_min_max_split():
    costs = [1, 2, 3, 4, 5, 6, 7, 8]
    assert balance_for_schedule(costs, Schedule.ONE_F_ONE_B, 4, 4) == balance_min_max(costs, 4)


def test_v_placement_balances_ranks_not_stages():
    # Stages by min-max: [4][4][4][4] -> ranks (0,3) and (1,2) carry 8 each: already optimal. Make the last layers
    # heavy so that min-max per stage leaves one rank with two heavy stages.
    costs = [1, 1, 1, 1, 1, 1, 6, 6]
    split = balance_for_schedule(costs, Schedule.ZBV_ZERO_BUBBLE, 2, 4)
    best = min(max(rank_loads(costs, s, Schedule.ZBV_ZERO_BUBBLE, 2)) for s in compositions(8, 4))
    assert max(rank_loads(costs, split, Schedule.ZBV_ZERO_BUBBLE, 2)) == best
    seed = balance_min_max(costs, 4)
    assert max(rank_loads(costs, seed, Schedule.ZBV_ZERO_BUBBLE, 2)) > best  # the seed alone is not enough


@pytest.mark.parametrize(
    "schedule, pp, n_stages",
    [(Schedule.ZBV_ZERO_BUBBLE, 2, 4), (Schedule.INTERLEAVED_1F1B, 2, 4), (Schedule.LOOPED_BFS, 3, 6)],
)
def test_placement_aware_split_is_near_brute_force(schedule, pp, n_stages):
    rng = random.Random(3)
    optimal = 0
    for _ in range(40):
        n = rng.randint(n_stages, 10)
        costs = [rng.uniform(0, 10) for _ in range(n)]
        split = balance_for_schedule(costs, schedule, pp, n_stages)
        assert len(split) == n_stages and sum(split) == n and min(split) >= 1
        got = max(rank_loads(costs, split, schedule, pp))
        best = min(max(rank_loads(costs, s, schedule, pp)) for s in compositions(n, n_stages))
        seed = max(rank_loads(costs, balance_min_max(costs, n_stages), schedule, pp))
        assert got <= seed + 1e-9
        assert got <= 1.15 * best
        optimal += got <= best * (1 + 1e-9)
    assert optimal >= 32  # 80 %; measured 36-40 of 40


def test_placement_aware_split_is_deterministic():
    costs = [random.Random(5).random() for _ in range(30)]
    first = balance_for_schedule(costs, Schedule.ZBV_ZERO_BUBBLE, 4, 8)
    assert balance_for_schedule(costs, Schedule.ZBV_ZERO_BUBBLE, 4, 8) == first


def test_placement_aware_split_keeps_each_rank_under_the_cap():
    costs = [1.0] * 12
    layer_bytes = [1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 9, 9]
    memory = additive_memory(layer_bytes)
    split = balance_for_schedule(costs, Schedule.ZBV_ZERO_BUBBLE, 2, 4, stage_memory=memory, memory_cap=14)
    per_rank = rank_loads(layer_bytes, split, Schedule.ZBV_ZERO_BUBBLE, 2)
    assert max(per_rank) <= 14
    with pytest.raises(InfeasibleError, match="raise the memory limit"):
        balance_for_schedule(costs, Schedule.ZBV_ZERO_BUBBLE, 2, 4, stage_memory=memory, memory_cap=8)
    with pytest.raises(UsageError, match="together"):
        balance_for_schedule(costs, Schedule.ZBV_ZERO_BUBBLE, 2, 4, stage_memory=memory)


def test_equal_layers_within_noise_get_the_most_even_split():
    # Issue 13: 96 identical layers were planned as [16, 4, 2, 1, 2, 1, 2, 1, 1, 2, 2, 3, 16, 19, 19, 5].
    from autotune.costs import LayerCost, Profile
    from autotune.partition import evened
    from autotune.plan import plan

    rng = random.Random(0)
    noisy = [1.0 + rng.uniform(-0.03, 0.03) for _ in range(96)]
    raw = balance_for_schedule(noisy, Schedule.INTERLEAVED_1F1B, 8, 16)
    assert raw != (6,) * 16  # the min-max search alone chases the noise
    assert evened(noisy, raw, Schedule.INTERLEAVED_1F1B, 8) == (6,) * 16
    skewed = [1.0, 6.0, 6.0, 1.0, 1.0, 0.5, 0.5, 0.5]  # a real imbalance is kept
    assert evened(skewed, (2, 6), Schedule.ONE_F_ONE_B, 2) == (2, 6)
    # Layers so cheap that per-action overheads set the step: every split simulates within noise of the others,
    # and the planner ranked the one whose key sorted first.
    tiny = [0.001 * (1 + rng.uniform(-0.5, 0.5)) for _ in range(96)]
    layers = [LayerCost(forward_ms=t, backward_input_ms=t, backward_weight_ms=t, saved_bytes=100, output_bytes=10,
                        parameter_bytes=100) for t in tiny]
    profile = Profile.from_layer_costs(layers, micro_batch_size=8, input_bytes=10)
    for schedule in ("ZBVZeroBubble", "Interleaved1F1B", "1F1B"):
        planned = plan(profile, gpus=8, batch_size=64, memory_limit_bytes=None, schedules=[schedule],
                       layouts=[(8, 1)])
        n_stages = planned[0].candidate.n_stages
        assert planned[0].candidate.layers_per_stage == (96 // n_stages,) * n_stages


def test_a_more_even_split_ranked_above_a_faster_candidate_says_why():
    # Issue 26: `plan` lists a more even split of one configuration at that configuration's fastest speed, so it may
    # stand above a slightly faster candidate of another configuration; the entry must say so.
    from autotune.candidate import Candidate
    from autotune.plan import PlannedCandidate, _even_first
    from autotune.simulate import Estimate

    def planned(schedule, split, step_ms):
        candidate = Candidate(schedule=Schedule(schedule), pipeline_degree=2, global_batch_size=8, n_microbatches=2,
                              layers_per_stage=split)
        estimate = Estimate(step_time_ms=step_ms, throughput_samples_per_s=8000 / step_ms, bubble_fraction=0.1,
                            peak_memory_bytes=(1, 1), feasible=True, pipeline_time_ms=step_ms, optimizer_ms=0.0,
                            allreduce_ms=0.0)
        return PlannedCandidate(candidate=candidate, estimate=estimate)

    uneven_fast = planned("1F1B", (3, 1), 4.100)
    even_slower = planned("1F1B", (2, 2), 4.191)  # within 3 % of (3, 1), and even
    other = planned("GPipe", (3, 1), 4.159)       # faster than (2, 2), slower than (3, 1)
    far = planned("1F1B", (1, 3), 5.000)          # not within 3 %: ranked by its own speed
    ranked = _even_first([other, far, uneven_fast, even_slower])
    assert [p.candidate.layers_per_stage for p in ranked] == [(2, 2), (3, 1), (3, 1), (1, 3)]
    assert ranked[0].even_split_of == uneven_fast.candidate.key
    assert ranked[0].ranked_throughput_samples_per_s == uneven_fast.estimate.throughput_samples_per_s
    assert ranked[1].candidate.schedule is Schedule.ONE_F_ONE_B and ranked[1].even_split_of is None
    assert ranked[2].candidate.schedule is Schedule.GPIPE
    entries = [p.to_dict() for p in ranked]
    assert "more even split of" in entries[0]["ranked_as"] and entries[2]["ranked_as"] is None
    assert entries[3]["ranked_throughput_samples_per_s"] == far.estimate.throughput_samples_per_s
