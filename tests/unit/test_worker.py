"""A rank's own exception, classified as its error file records it."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from autotune.trial.worker import _classify
from tests.unit.test_memory import CUDA_OOM, NCCL_PREFIX


def _raised(exc: BaseException, outer: str | None = None) -> BaseException:
    """exc as raised (with a traceback), or re-raised from it as torch's stages do ("Failed to run stage ...")."""
    try:
        try:
            raise exc
        except BaseException as inner:
            if outer is None:
                raise
            raise RuntimeError(outer) from inner
    except BaseException as caught:  # noqa: BLE001
        return caught


@pytest.mark.parametrize(("exc", "size"), [
    (torch.OutOfMemoryError(CUDA_OOM), 2 * 2**30),
    (dist.DistBackendError(NCCL_PREFIX + "Cuda failure 2 'out of memory'"), None),
    (dist.DistBackendError(NCCL_PREFIX + "Failed to CUDA calloc 6291456 bytes"), 6291456),
    (RuntimeError("[enforce fail at alloc_cpu.cpp:117] err == 0. DefaultCPUAllocator: can't allocate memory: you "
                  "tried to allocate 123456 bytes. Error code 12 (Cannot allocate memory)"), 123456),
])
def test_out_of_memory_under_a_stage_error_is_the_ranks_own_oom(exc, size):
    error = _classify(1, _raised(exc, outer="Failed to run stage backward for stage 1"))
    assert error["kind"] == "oom"
    assert error["bytes_requested"] == size
    assert error["comms"] is False  # NCCL's out of memory is this rank's failure, not a peer's broken link


def test_nccl_failure_of_a_peer_stays_a_comms_error():
    error = _classify(0, _raised(dist.DistBackendError(
        "NCCL error: remote process exited or there was a network error, NCCL version 2.21.5")))
    assert error["kind"] == "error" and error["comms"] is True and error["bytes_requested"] is None
