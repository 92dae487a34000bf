import pytest
import torch

from autotune.trial.memory import LiveTensorBytes, MemoryLimitExceeded, is_out_of_memory, requested_bytes


def test_tracker_counts_new_tensors_and_frees():
    with LiveTensorBytes() as tracker:
        base = tracker.live_bytes
        a = torch.ones(1000)  # 4000 bytes
        b = a * 2  # 4000 more
        del b
        view = a[:10]  # a view shares the storage: nothing new
        assert tracker.live_bytes - base == 4000
        del view
    assert tracker.peak_bytes - base == 8000


def test_tracker_enforces_limit():
    with pytest.raises(MemoryLimitExceeded), LiveTensorBytes(limit_bytes=1) as _:
        torch.ones(10)


def test_cpu_allocator_failure_is_oom_with_bytes():
    try:
        torch.empty(2**50)
    except RuntimeError as exc:
        assert is_out_of_memory(exc)
        assert requested_bytes(exc) == 2**52
    else:
        pytest.skip("this machine allocated 4 PiB")
