import platform
import resource

import pytest
import torch

from autotune.devices import keep_freed_cpu_memory
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


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")
def test_cpu_stand_in_reuses_freed_memory_without_page_faults():
    # Tensors of changing sizes up to 24 MiB, as a profile's rounds over micro-batch sizes make: with glibc's
    # defaults every round page-faulted ~86 MiB in afresh (22,000 faults); reused, none.
    assert keep_freed_cpu_memory() is True

    def one_round() -> None:
        for scale in (1, 4, 8, 1, 2, 6):
            for k in (1, 2, 3, 1, 2):
                torch.empty(2**18 * k * scale).fill_(1.0)

    for _ in range(10):
        one_round()
    faults = []
    for _ in range(3):  # the fewest of three rounds: other threads of the test process fault pages too
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        one_round()
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    assert min(faults) < 500, faults
