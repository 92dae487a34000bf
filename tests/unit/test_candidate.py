import pytest

from autotune.candidate import Candidate, Measurement, TrialError, uniform_split
from autotune.errors import InvalidCandidateError
from autotune.schedules import Schedule


def make(**kw):
    base = dict(schedule=Schedule.ONE_F_ONE_B, pipeline_degree=2, global_batch_size=32, n_microbatches=4,
                layers_per_stage=(5, 5))
    base.update(kw)
    return Candidate(**base)


def test_uniform_split_gives_remainder_to_early_stages():
    assert uniform_split(10, 4) == (3, 3, 2, 2)
    assert uniform_split(8, 2) == (4, 4)


def test_derived_sizes():
    c = make(global_batch_size=64, n_microbatches=4, data_parallel_degree=2, pipeline_degree=2)
    assert (c.micro_batch_size, c.replica_batch_size, c.world_size) == (8, 32, 4)


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(global_batch_size=30), "cannot be cut into 1 replica"),
        (dict(layers_per_stage=(4, 5)), "covers 9 layers but the model has 10"),
        (dict(layers_per_stage=(10, 0)), "empty stage"),
        (dict(n_microbatches=1), "at least as many micro-batches"),
        (dict(schedule=Schedule.ZBV_ZERO_BUBBLE), "exactly 2 stage"),
        (dict(pipeline_degree=11, layers_per_stage=(1,) * 11), "need at least 11 layers"),
        (dict(schedule=Schedule.TWO_BW, data_parallel_degree=2, data_parallel_mode="shard"),
         "2BW .* does not run with FSDP2-sharded replicas; use replicated data parallelism"),
        (dict(schedule=Schedule.TWO_BW, tensor_parallel_degree=2), "2BW .* does not run with tensor parallelism"),
    ],
)
def test_invalid_candidates(kw, match):
    with pytest.raises(InvalidCandidateError, match=match):
        make(**kw).validate(10)


def test_round_trips_through_dict():
    c = make(activation_checkpointing=True, wire_dtype="bfloat16")
    assert Candidate.from_dict(c.to_dict()) == c
    m = Measurement(candidate=c, status="oom", error=TrialError(rank=1, kind="oom", message="x", bytes_requested=9))
    assert Measurement.from_dict(m.to_dict()) == m
    on_cuda = Measurement(candidate=c, status="ok", step_time_ms=1.0, peak_memory_bytes=(10, 20),
                          peak_reserved_bytes=(12, 22), device_used_bytes=(900, 910), device="cuda",
                          losses=(2.5, 2.25))
    assert Measurement.from_dict(on_cuda.to_dict()) == on_cuda
    assert "peak_reserved_bytes" not in m.to_dict()  # a CPU trial has no allocator beyond its tensors
