"""The planner ranks replicate and shard (FSDP2) layouts side by side, in the profile's precision."""

from __future__ import annotations

import pytest

from autotune.costs import LayerCost, Profile
from autotune.errors import UsageError
from autotune.plan import plan
from autotune.simulate import LinkModel

LINK = LinkModel(bandwidth_bytes_per_s=1e9, latency_s=0.0, per_action_overhead_ms=0.0, optimizer_bytes_per_s=1e9)


def heavy(n_layers: int, *, precision: str = "bf16") -> Profile:
    """Layers of 4 MB of parameters and little activation: their state decides the memory."""
    layers = [LayerCost(forward_ms=1.0, backward_input_ms=1.0, backward_weight_ms=1.0, saved_bytes=10_000,
                        output_bytes=1000, parameter_bytes=4_000_000)] * n_layers
    return Profile.from_layer_costs(layers, micro_batch_size=1, input_bytes=100, precision=precision)


def test_plan_lists_shard_layouts_beside_replicate_ones_pure_fsdp_included():
    planned = plan(heavy(4), gpus=4, batch_size=8, memory_limit_bytes=None, link=LINK, prune_within=None)
    kinds = {(p.candidate.pipeline_degree, p.candidate.data_parallel_degree, p.candidate.data_parallel_mode,
              p.candidate.reshard_after_forward) for p in planned}
    assert {(1, 4, "replicate", False), (1, 4, "shard", False)} <= kinds  # pure FSDP
    assert {(2, 2, "replicate", False), (2, 2, "shard", False), (4, 1, "replicate", False)} <= kinds
    assert not any(p.candidate.sharded and p.candidate.data_parallel_degree == 1 for p in planned)
    # with no limit, keeping the stages gathered always fits: resharding after forward could only be slower
    assert not any(p.candidate.reshard_after_forward for p in planned)
    assert {p.candidate.precision for p in planned} == {"bf16"}  # the profile's
    entry = next(p for p in planned if p.candidate.sharded).to_dict()
    assert entry["precision"] == "bf16" and entry["data_parallel_mode"] == "shard"
    assert isinstance(entry["fsdp_reshard_after_forward"], bool)
    replicas_only = plan(heavy(4), gpus=4, batch_size=8, memory_limit_bytes=None, link=LINK,
                         data_parallel_modes=("replicate",))
    assert replicas_only and not any(p.candidate.sharded for p in replicas_only)
    with pytest.raises(UsageError, match="not a choice of replicate, shard"):
        plan(heavy(4), gpus=4, batch_size=8, memory_limit_bytes=None, data_parallel_modes=("zero3",))


def test_under_a_limit_only_sharding_fits_the_planner_ranks_it_first():
    """One layer (no pipeline possible) of 8 MB over 4 ranks in bf16: a replica holds 4 x 8 MB = 32 MB of float32
    state; sharded, 6 MB of parameter and AdamW shards + a 4 MB bf16 working copy + 8 MB of unsharded float32
    gradients, and at worst a backward's fresh 4 MB of bf16 weight gradients on top."""
    profile = Profile.from_layer_costs([LayerCost(forward_ms=1.0, backward_input_ms=1.0, backward_weight_ms=1.0,
                                                  saved_bytes=10_000, output_bytes=1000, parameter_bytes=8_000_000)],
                                       micro_batch_size=1, input_bytes=100, precision="bf16")
    limit = 25_000_000
    planned = plan(profile, gpus=4, batch_size=8, memory_limit_bytes=limit, link=LINK)
    assert planned[0].estimate.feasible and planned[0].candidate.sharded
    assert max(planned[0].estimate.peak_memory_bytes) < limit
    replicas = [p for p in planned if not p.candidate.sharded]
    assert replicas and not any(p.estimate.feasible for p in replicas)
    assert all(max(p.estimate.peak_memory_bytes) > 32_000_000 for p in replicas)


def test_resharding_after_forward_is_planned_where_keeping_the_stages_gathered_does_not_fit():
    """LoopedBFS, pp 2 x dp 2, 8 layers of 4 MB (fp32): a rank holds two stages of 2 layers (an 8 MB copy each).
    Kept gathered, both copies are there at the later stage's backwards (52.1 MB at the peak); resharded after
    forward, the earlier stage let go of its copy and gathers it again for its own backwards, when the later stage's
    gradient shards (4 MB) are there instead (48.0 MB), for more all-gathers."""
    profile = heavy(8, precision="fp32")
    kwargs = dict(gpus=4, batch_size=4, link=LINK, layouts=[(2, 2)], schedules=["LoopedBFS"],
                  data_parallel_modes=("shard",), prune_within=None)
    loose = plan(profile, memory_limit_bytes=60_000_000, **kwargs)
    assert loose and not any(p.candidate.reshard_after_forward for p in loose)
    tight = plan(profile, memory_limit_bytes=50_000_000, **kwargs)
    resharded = [p for p in tight if p.candidate.reshard_after_forward and p.estimate.feasible]
    assert resharded
    kept = {p.candidate.key: p for p in tight if not p.candidate.reshard_after_forward}
    same = next(p for p in resharded if p.candidate.key.replace("+reshard", "") in kept)
    twin = kept[same.candidate.key.replace("+reshard", "")]
    assert not twin.estimate.feasible and max(same.estimate.peak_memory_bytes) < max(twin.estimate.peak_memory_bytes)
    assert same.estimate.step_time_ms > twin.estimate.step_time_ms


def test_2bw_is_planned_only_when_allowed_and_ranks_above_1f1b_on_replicas():
    """Without async allowed no 2BW candidate; with it, 2BW at pp > 1 on replicated replicas only, ranked above
    1F1B at the same layout, B/M and split (no fill and drain per step), holding one more copy of the weights."""
    from autotune.schedules import Schedule, allowed_schedules

    profile = heavy(4, precision="fp32")
    assert not any(p.candidate.schedule is Schedule.TWO_BW
                   for p in plan(profile, gpus=4, batch_size=8, memory_limit_bytes=None, link=LINK, prune_within=None))
    planned = plan(profile, gpus=4, batch_size=8, memory_limit_bytes=None, link=LINK, prune_within=None,
                   schedules=allowed_schedules(True))
    two_bw = [p for p in planned if p.candidate.schedule is Schedule.TWO_BW]
    assert two_bw and all(p.candidate.pipeline_degree > 1 and not p.candidate.sharded for p in two_bw)
    by_key = {p.candidate.key: p for p in planned}
    pairs = [(p, by_key[p.candidate.key.replace("2BW", "1F1B")]) for p in two_bw
             if p.candidate.key.replace("2BW", "1F1B") in by_key]
    assert len(pairs) >= 3  # pp 4 at B/M 4 and 8, pp 2 x dp 2 at B/M 4
    for p, twin in pairs:
        assert p.estimate.step_time_ms < twin.estimate.step_time_ms
        assert max(p.estimate.peak_memory_bytes) > max(twin.estimate.peak_memory_bytes)


def test_the_planner_moves_a_boundary_where_a_stage_s_optimizer_step_hides_behind_the_other_s_backward():
    """Equal compute, the last layer's parameters heavy: with one micro-batch the last stage steps its optimizer
    while the first is still in its backward, so giving the first stage a layer more is faster than the balanced
    [2-2] (15 ms against 16: the last stage's forward and backward shrink, the first's grow where it waited). The
    balanced split alone would miss it; the refinement by simulation finds it and ranks it first."""
    link = LinkModel(bandwidth_bytes_per_s=1e9, latency_s=0.0, per_action_overhead_ms=0.0, optimizer_bytes_per_s=1e9)
    layers = [LayerCost(forward_ms=1.0, backward_input_ms=1.0, backward_weight_ms=0.0, saved_bytes=1000,
                        output_bytes=1000, parameter_bytes=b) for b in (1000, 1000, 1000, 10_000_000)]
    profile = Profile.from_layer_costs(layers, micro_batch_size=1, input_bytes=100, precision="fp32")
    planned = plan(profile, gpus=2, batch_size=1, memory_limit_bytes=None, link=link, layouts=[(2, 1)],
                   schedules=["GPipe"])
    times = {p.candidate.key: p.estimate.step_time_ms for p in planned}
    assert planned[0].candidate.key == "GPipe/m1/[3-1]"
    assert times["GPipe/m1/[3-1]"] == pytest.approx(15.0, abs=0.01)
    assert times["GPipe/m1/[2-2]"] == pytest.approx(16.0, abs=0.01)
