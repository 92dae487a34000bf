from collections import Counter

import pytest

from autotune.errors import InvalidCandidateError, UsageError
from autotune.schedules import (
    SYNCHRONOUS_SCHEDULES,
    Schedule,
    action_lists,
    allowed_schedules,
    check_async_allowed,
    default_stages_per_rank,
    one_f_one_b,
    parse_schedule,
    schedules_for,
    stage_ranks,
    validate_schedule,
)


def render(actions):
    return " ".join(str(a) for a in actions)


def test_parse_schedule_is_case_insensitive_and_lists_names_on_error():
    assert parse_schedule("1f1b") is Schedule.ONE_F_ONE_B
    assert parse_schedule("zbvzerobubble") is Schedule.ZBV_ZERO_BUBBLE
    with pytest.raises(UsageError, match="one of: GPipe, 1F1B"):
        parse_schedule("pipedream")


def test_one_f_one_b_literal_orders():
    assert render(one_f_one_b(0, 2, 4)) == "0F0 0F1 0B0 0F2 0B1 0F3 0B2 0B3"
    assert render(one_f_one_b(1, 2, 4)) == "1F0 1B0 1F1 1B1 1F2 1B2 1F3 1B3"


def test_gpipe_literal_orders():
    assert [render(r) for r in action_lists(Schedule.GPIPE, 2, 3, 2)] == [
        "0F0 0F1 0F2 0B0 0B1 0B2",
        "1F0 1F1 1F2 1B0 1B1 1B2",
    ]


def test_placements():
    assert stage_ranks(Schedule.INTERLEAVED_1F1B, 2, 4) == [0, 1, 0, 1]
    assert stage_ranks(Schedule.ZBV_ZERO_BUBBLE, 2, 4) == [0, 1, 1, 0]
    assert stage_ranks(Schedule.GPIPE, 4, 4) == [0, 1, 2, 3]


@pytest.mark.parametrize("schedule", list(Schedule))
@pytest.mark.parametrize("pp,m", [(2, 4), (3, 6), (4, 8)])
def test_every_action_list_runs_each_forward_and_backward_once(schedule, pp, m):
    n_stages = pp * default_stages_per_rank(schedule)
    lists = action_lists(schedule, pp, m, n_stages)
    seen = Counter((a.stage, "F" if a.kind == "F" else "B", a.microbatch) for r in lists for a in r if a.kind != "W")
    assert seen == Counter((s, k, mb) for s in range(n_stages) for k in "FB" for mb in range(m))
    ranks = stage_ranks(schedule, pp, n_stages)
    for rank, actions in enumerate(lists):
        assert all(ranks[a.stage] == rank for a in actions)


@pytest.mark.parametrize(
    "schedule,pp,m,stages,match",
    [
        (Schedule.ONE_F_ONE_B, 4, 2, 4, "at least as many micro-batches as stages"),
        (Schedule.ZBV_ZERO_BUBBLE, 2, 4, 2, "exactly 2 stage"),
        (Schedule.INTERLEAVED_1F1B, 2, 4, 2, "at least 2 stages per rank"),
        (Schedule.INTERLEAVED_1F1B, 4, 9, 8, "multiple of"),
        (Schedule.DUAL_PIPE_V, 2, 3, 4, "at least 2 x pp"),
        (Schedule.GPIPE, 2, 4, 3, "evenly"),
        (Schedule.TWO_BW, 4, 3, 4, "third weight version"),
    ],
)
def test_invalid_schedules_are_refused_with_the_fix(schedule, pp, m, stages, match):
    with pytest.raises(InvalidCandidateError, match=match):
        validate_schedule(schedule, pipeline_degree=pp, n_microbatches=m, n_stages=stages)


def test_micro_batch_advice_names_no_flag_the_search_lacks():
    # `autotune search` has no --microbatches; its logs and report show these messages too (issue 13, item 9)
    for schedule, pp in ((Schedule.ONE_F_ONE_B, 4), (Schedule.DUAL_PIPE_V, 4)):
        with pytest.raises(InvalidCandidateError, match="or more micro-batches") as info:
            n_stages = pp * default_stages_per_rank(schedule)
            validate_schedule(schedule, pipeline_degree=pp, n_microbatches=2, n_stages=n_stages)
        assert "--microbatches" not in str(info.value)


def test_2bw_is_opt_in_and_runs_one_steps_1f1b():
    """2BW is asynchronous: never among the default schedules, refused without --allow-async (one line naming the
    flag), and its per-step order is 1F1B's (the runtime runs consecutive steps as one 1F1B)."""
    assert parse_schedule("2bw") is Schedule.TWO_BW
    assert Schedule.TWO_BW not in SYNCHRONOUS_SCHEDULES
    assert allowed_schedules(False) == SYNCHRONOUS_SCHEDULES
    assert Schedule.TWO_BW in allowed_schedules(True)
    with pytest.raises(UsageError, match="2BW is asynchronous .* pass --allow-async"):
        check_async_allowed([Schedule.ONE_F_ONE_B, Schedule.TWO_BW], allow_async=False)
    check_async_allowed([Schedule.TWO_BW], allow_async=True)
    check_async_allowed(SYNCHRONOUS_SCHEDULES, allow_async=False)
    assert action_lists(Schedule.TWO_BW, 2, 4, 2) == action_lists(Schedule.ONE_F_ONE_B, 2, 4, 2)
    assert schedules_for(1, [Schedule.ONE_F_ONE_B, Schedule.TWO_BW]) == [Schedule.ONE_F_ONE_B]
