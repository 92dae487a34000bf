"""torch's private surface: every symbol autotune needs exists here with the signature autotune calls, the version
check warns outside the tested range, and no other module of the package names a private torch symbol."""

from __future__ import annotations

import inspect
import itertools
import re
import warnings
from pathlib import Path

import pytest
import torch

from autotune import compat
from autotune.schedules import Schedule, action_lists, default_stages_per_rank

PACKAGE = Path(compat.__file__).parent


def test_every_needed_symbol_exists():
    assert compat.missing_symbols() == []
    for module, name in compat.OPTIONAL_SYMBOLS:
        compat.symbol(module, name)  # present on the tested torch; its absence only costs speed


def test_signatures_autotune_calls():
    get_schedule_ops = compat.symbol("torch.distributed.pipelining._schedule_visualizer", "get_schedule_ops")
    assert list(inspect.signature(get_schedule_ops).parameters)[:4] == [
        "schedule", "pp_degree", "num_microbatches", "num_stages_per_rank"
    ]
    schedules = "torch.distributed.pipelining.schedules"
    runtime = compat.symbol(schedules, "_PipelineScheduleRuntime")
    init = next(c.__init__ for c in runtime.__mro__ if "stages" in inspect.signature(c.__init__).parameters)
    # _PipelineScheduleRuntime(*args, **kwargs) passes them on to its base
    assert {"stages", "n_microbatches", "loss_fn"} <= set(inspect.signature(init).parameters)
    assert "actions" in inspect.signature(runtime._prepare_schedule_with_comms).parameters
    action = compat.symbol(schedules, "_Action")
    assert action._fields[:4] == ("stage_index", "computation_type", "microbatch_index", "sub_actions")
    kinds = compat.symbol(schedules, "_ComputationType")
    assert {"FORWARD", "FULL_BACKWARD", "BACKWARD_INPUT", "BACKWARD_WEIGHT", "OVERLAP_F_B"} <= set(kinds.__members__)
    unshard = compat.symbol(schedules, "_add_unshard_reshard")
    assert next(iter(inspect.signature(unshard).parameters)) == "compute_actions"
    assert "__torch_dispatch__" in vars(compat.TorchDispatchMode)
    assert compat.tree_flatten((torch.ones(1), [torch.zeros(2)]))[0][1].shape == (2,)
    base = torch.ones(4)
    assert compat.view_base(base[:2]) is base and compat.view_base(base) is None
    assert compat.is_batch_norm(torch.nn.LazyBatchNorm1d()) and not compat.is_batch_norm(torch.nn.GroupNorm(1, 2))
    from torch.distributed.pipelining import PipelineStage

    assert all(callable(getattr(PipelineStage, name, None)) for name in compat.STAGE_COMPUTE_METHODS)
    backward = inspect.signature(PipelineStage.backward_maybe_with_nosync).parameters
    assert list(backward)[:4] == ["self", "backward_type", "bwd_kwargs", "last_backward"]
    from torch.distributed.fsdp import FSDPModule

    assert "_apply" in vars(FSDPModule)  # it re-pads the shards compat.give_shards_storage gives storage


@pytest.mark.parametrize("schedule", [Schedule.INTERLEAVED_ZERO_BUBBLE, Schedule.ZBV_ZERO_BUBBLE, Schedule.DUAL_PIPE_V,
                                      Schedule.INTERLEAVED_1F1B, Schedule.LOOPED_BFS], ids=lambda s: s.value)
def test_skipping_torchs_lowering_gives_torchs_own_lists(schedule):
    from torch.distributed.pipelining import _schedule_visualizer

    # schedule_actions skips the runtime lowering (checks, FSDP, gradient reduction, sends and receives) that
    # torch's schedule classes run on construction; the compute order must come out as torch's own.
    for pp, m in [(4, 16), (8, 16), (3, 12)]:
        n_stages = pp * default_stages_per_rank(schedule)
        reference = _schedule_visualizer.get_schedule_ops(schedule.value, pp, m, num_stages_per_rank=n_stages // pp)
        lists = action_lists(schedule, pp, m, n_stages)
        assert [[(a.stage, a.kind, a.microbatch, a.fused_with_next) for a in rank] for rank in lists] == [
            compat.compute_actions(r) for r in reference
        ]
    # DualPipeV's OVERLAP_F_B pairs: the forward fused with the backward after it
    fused = [(a, b) for rank in lists for a, b in itertools.pairwise(rank) if a.fused_with_next]
    assert bool(fused) == (schedule is Schedule.DUAL_PIPE_V)
    assert all(a.kind == "F" and b.kind == "B" for a, b in fused)


def test_one_stand_in_stage_serves_every_schedule():
    # schedule_actions reuses one mocked PipelineStage across calls; torch's visualizer makes a fresh one each time.
    # Interleaving schedules (single- and multi-stage, different pp) checks that nothing one leaves on it leaks.
    from torch.distributed.pipelining import _schedule_visualizer

    for name, pp, m, v in [("DualPipeV", 4, 8, 2), ("GPipe", 2, 4, 1), ("Interleaved1F1B", 4, 8, 2),
                           ("InterleavedZeroBubble", 2, 6, 3), ("GPipe", 4, 8, 1), ("LoopedBFS", 3, 6, 2),
                           ("ZBVZeroBubble", 4, 8, 2), ("Interleaved1F1B", 2, 4, 3)]:
        reference = _schedule_visualizer.get_schedule_ops(name, pp, m, num_stages_per_rank=v)
        assert compat.schedule_actions(name, pp, m, v) == [compat.compute_actions(r) for r in reference]


@pytest.mark.parametrize("version", ["2.0.0", "2.8.1+cu126", "2.15.0", "3.0.0"])
def test_a_torch_outside_the_tested_range_is_warned_about_not_refused(version):
    expected = rf"tested with torch {compat.TESTED_TORCH[0]} to .*pip install"
    with pytest.warns(compat.TorchVersionWarning, match=expected):
        text = compat.check_torch_version(version)
    assert text is not None and version in text


@pytest.mark.parametrize("version", [*compat.TESTED_TORCH, "2.14.3+cpu"])
def test_a_tested_torch_is_not_warned_about(version):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert compat.check_torch_version(version) is None


def test_a_missing_symbol_is_an_autotune_error_that_names_it_and_the_fix():
    expected = r"no torch\.utils\.nothing_here, which autotune needs; install"
    with pytest.raises(compat.TorchAPIError, match=expected) as e:
        compat.symbol("torch.utils", "nothing_here")
    assert e.value.exit_code == 4


PRIVATE_TORCH_NAME = re.compile(
    r"torch[\w.]*\._[a-zA-Z]"  # torch.x._private or torch._private
    r"|from torch[\w.]* import [^\n]*\b_[a-zA-Z]"  # from torch.x import _private
    r"|\._base\b"  # Tensor._base
)


def _code(path):
    """The file's code without strings and comments (a message may tell the user to write torch._assert)."""
    import io
    import tokenize

    tokens = tokenize.generate_tokens(io.StringIO(path.read_text()).readline)
    skipped = {tokenize.STRING, tokenize.COMMENT, getattr(tokenize, "FSTRING_MIDDLE", tokenize.STRING)}
    return " ".join(t.string for t in tokens if t.type not in skipped)


def test_only_compat_names_private_torch_symbols():
    offenders = {
        str(path.relative_to(PACKAGE.parent)): match.group(0)
        for path in PACKAGE.rglob("*.py")
        if path.name != "compat.py"
        for match in [PRIVATE_TORCH_NAME.search(_code(path))]
        if match
    }
    assert offenders == {}
    assert PRIVATE_TORCH_NAME.search((PACKAGE / "compat.py").read_text())


def test_warm_up_sends_to_the_stages_own_rank_are_dropped():
    from types import SimpleNamespace

    ops = [SimpleNamespace(group_peer=0), SimpleNamespace(group_peer=1), SimpleNamespace(group_peer=1)]
    stage = SimpleNamespace(group_rank=1, _get_init_p2p_neighbors_ops=lambda: ops)
    assert compat.prepare_stage(stage)._get_init_p2p_neighbors_ops() == ops[:1]
