import os
import platform
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from autotune.devices import cuda_memory_budget_bytes, device_memory_bytes
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


# The literal texts of each allocator's failure (torch 2.x CUDA caching allocator, torch's CPU allocator, NCCL as
# torch's ProcessGroupNCCL raises it, cuBLAS), with the refused size each states (None: the message has none).
CUDA_OOM = (
    "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.19 GiB of which 1.06 GiB is "
    "free. Including non-PyTorch memory, this process has 78.12 GiB memory in use. Of the allocated memory 76.50 GiB "
    "is allocated by PyTorch, and 1.10 GiB is reserved by PyTorch but unallocated. If reserved but unallocated memory "
    "is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  See "
    "documentation for Memory Management  (https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)"
)
NCCL_PREFIX = (
    "NCCL error in: /pytorch/torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:3356, unhandled cuda error (run with "
    "NCCL_DEBUG=INFO for details), NCCL version 2.21.5\nncclUnhandledCudaError: Call to CUDA function failed.\n"
    "Last error:\n"
)
OUT_OF_MEMORY_MESSAGES = [
    (torch.OutOfMemoryError, CUDA_OOM, 2 * 2**30),
    (RuntimeError, "CUDA out of memory. Tried to allocate 20.00 MiB (GPU 0; 15.78 GiB total capacity; 14.56 GiB "
                   "already allocated; 3.75 MiB free; 14.77 GiB reserved in total by PyTorch)", 20 * 2**20),
    (RuntimeError, "[enforce fail at alloc_cpu.cpp:117] err == 0. DefaultCPUAllocator: can't allocate memory: you "
                   "tried to allocate 123456 bytes. Error code 12 (Cannot allocate memory)", 123456),
    (RuntimeError, "[enforce fail at C:\\actions-runner\\_work\\pytorch\\c10\\core\\impl\\alloc_cpu.cpp:81] data. "
                   "DefaultCPUAllocator: not enough memory: you tried to allocate 1981808640 bytes.", 1981808640),
    (dist.DistBackendError, NCCL_PREFIX + "Cuda failure 2 'out of memory'", None),
    (dist.DistBackendError, NCCL_PREFIX + "Cuda failure 'out of memory'", None),
    (dist.DistBackendError, NCCL_PREFIX + "Failed to CUDA calloc 6291456 bytes", 6291456),
    (dist.DistBackendError,
     "NCCL error in: /pytorch/torch/csrc/distributed/c10d/NCCLUtils.cpp:77, unhandled system error (run with "
     "NCCL_DEBUG=INFO for details), NCCL version 2.21.5\nncclSystemError: System call (e.g. socket, malloc) or "
     "external library call failed or device error. \nLast error:\nCuda failure 'out of memory'", None),
    (RuntimeError, "CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`", None),
]


@pytest.mark.parametrize(("kind", "message", "size"), OUT_OF_MEMORY_MESSAGES)
def test_allocator_messages_are_oom_with_the_refused_size(kind, message, size):
    exc = kind(message)
    assert is_out_of_memory(exc)
    assert requested_bytes(exc) == size


@pytest.mark.parametrize("message", [
    NCCL_PREFIX + "Cuda failure 1 'invalid argument'",
    "NCCL error: remote process exited or there was a network error, NCCL version 2.21.5\nncclRemoteError: A call "
    "failed possibly due to a network error or a remote process exiting prematurely.",
    "Expected all tensors to be on the same device, but found at least two devices, cuda:0 and cpu!",
])
def test_other_failures_are_not_oom(message):
    assert not is_out_of_memory(RuntimeError(message))


_FREE_24_MIB = """
import os, sys, torch
from autotune.devices import keep_freed_cpu_memory
if sys.argv[1] == "keep":
    assert keep_freed_cpu_memory() is True
def resident():
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
before = resident()
t = torch.empty(6 * 2**20).fill_(1.0)
del t
print(resident() - before)
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")
def test_cpu_stand_in_keeps_freed_memory_for_reuse():
    # A freed 24 MiB tensor: with glibc's defaults it was mmapped and goes back to the system (the next one of that
    # size page-faults afresh, as the profiler's rounds over micro-batch sizes did); with keep_freed_cpu_memory it
    # stays in the heap for reuse, as CUDA's caching allocator keeps it. In a fresh process, as the profiler and
    # every rank are (the test process's heap carries what earlier tests left; an in-process page-fault count here
    # was flaky and passed without the call too).
    def kept(mode: str) -> int:
        out = subprocess.run([sys.executable, "-c", _FREE_24_MIB, mode], capture_output=True, text=True, timeout=120,
                             check=True)
        return int(out.stdout.split()[-1])

    assert kept("keep") > 16 * 2**20
    assert kept("default") < 8 * 2**20


_GLOO_THREADS = """
import os, sys, time, torch.distributed as dist
from autotune.devices import GLOO_DEVICE_THREAD, idle_gloo_device_threads
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
for _ in range(40):  # the thread names itself once it runs: on a busy host that came after the listing (a skip)
    tids = [int(t) for t in os.listdir("/proc/self/task")
            if open(f"/proc/self/task/{t}/comm").read().strip() == GLOO_DEVICE_THREAD]
    if tids:
        break
    time.sleep(0.05)
moved = idle_gloo_device_threads()
print(len(tids), moved, sorted({os.sched_getscheduler(t) == os.SCHED_IDLE for t in tids}),
      os.sched_getscheduler(0) == os.SCHED_IDLE)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="SCHED_IDLE and /proc are Linux's")
@pytest.mark.parametrize("switch", ["1", "0"])
def test_opt_in_puts_gloo_device_threads_under_sched_idle(switch):
    # gloo's tcp device thread spins while a post holds its pair's lock; under SCHED_IDLE it yields the core to the
    # rank's own thread (bench/gloo_cross.py). Only that thread: the rank's main thread keeps its policy. In a fresh
    # process (a policy set here would stay with the test process's threads); opt-in with AUTOTUNE_GLOO_LOOP_IDLE=1.
    env = {**os.environ, "AUTOTUNE_GLOO_LOOP_IDLE": switch}
    out = subprocess.run([sys.executable, "-c", _GLOO_THREADS], capture_output=True, text=True, timeout=120,
                         check=True, env=env).stdout.split("\n")[-2].split(" ", 2)
    threads, moved, rest = int(out[0]), int(out[1]), out[2]
    if threads == 0:
        pytest.skip("this torch's gloo does not name its device thread (2.11's does not, 2.14.1's does)")
    if switch == "1":
        assert (moved, rest) == (threads, "[True] False")
    else:
        assert (moved, rest) == (0, "[False] False")


def test_default_cuda_limit_leaves_headroom_for_context_nccl_and_fragmentation(monkeypatch):
    h100 = 85_031_714_816  # an 80 GB H100's total_memory (79.19 GiB)
    budget = cuda_memory_budget_bytes(h100)
    assert budget == int((h100 - 2 * 2**30) * 0.95)
    assert 73 * 2**30 < budget < 74 * 2**30
    small = 4 * 2**30  # a small card keeps at least 3/4 of its memory less fragmentation
    assert cuda_memory_budget_bytes(small) == int(3 * 2**30 * 0.95)

    class Properties:
        total_memory = h100

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: Properties())
    assert device_memory_bytes("cuda") == budget
    assert device_memory_bytes("cpu") is None


def test_peak_breakdown_names_what_is_alive_at_the_peak():
    from autotune.trial.memory import PeakBreakdown

    kept = torch.zeros(1000)  # 4000 bytes, alive before and after
    tracker = PeakBreakdown(lambda: {"kept": [kept.untyped_storage().data_ptr()]})
    with tracker:
        tracker.phase = "1F0"
        a = kept + 1  # 4000
        b = a * 2  # 4000: the peak, a and b alive
        del a
        tracker.phase = "1B0"
        c = b[:10] + 1  # 40, after the peak
    assert tracker.peak_phase == "1F0"
    assert tracker.breakdown["kept"] == 4000
    assert tracker.breakdown["other:add.Tensor in 1F0"] == 4000
    assert tracker.breakdown["other:mul.Tensor in 1F0"] == 4000
    assert tracker.peak_bytes >= 12000 and not any("1B0" in k for k in tracker.breakdown)
    del b, c


def test_trackers_see_a_dtensors_local_shard(tmp_path):
    """FSDP2's parameters, gradients and optimizer state are DTensors: the live-bytes tracker counts what an op on one
    makes as its local shard (the mode sees no op inside DTensor's own dispatch), and the saved-activation counter
    takes DTensors to exclude."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    from autotune.trial.memory import SavedActivationBytes

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        shard = DTensor.from_local(torch.ones(1000), mesh, [Shard(0)])
        with LiveTensorBytes() as tracker:
            base = tracker.live_bytes
            doubled = shard * 2  # a new 4000-byte local shard
            assert isinstance(doubled, DTensor) and tracker.live_bytes - base == 4000
        assert SavedActivationBytes(exclude=[shard])._excluded == {shard.to_local().untyped_storage().data_ptr()}
    finally:
        dist.destroy_process_group()


def test_tracker_follows_fsdp2s_storage_resizes():
    """FSDP2 gathers a unit's parameters into storages it resizes in place (alloc_storage / free_storage), which no
    operator creates: the tracker counts them from the resize to the free, at their size."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param

    gathered = torch.empty(1024)  # 4 KiB
    _fsdp_param.free_storage(gathered)  # as FSDP2 keeps it between steps: no bytes
    with LiveTensorBytes() as tracker:
        start = tracker.live_bytes
        _fsdp_param.alloc_storage(gathered)  # the all-gather's destination
        assert tracker.live_bytes - start == 4096 and tracker.peak_bytes >= start + 4096
        _fsdp_param.free_storage(gathered)  # reshard
        assert tracker.live_bytes == start
    _fsdp_param.alloc_storage(gathered)
    assert gathered.untyped_storage().nbytes() == 4096  # outside a tracker the functions are torch's own again
    _fsdp_param.free_storage(gathered)
    with LiveTensorBytes() as probe:
        base = probe.live_bytes
    with LiveTensorBytes(limit_bytes=base + 1024), pytest.raises(MemoryLimitExceeded):
        _fsdp_param.alloc_storage(gathered)  # a gathered unit past the limit: out of memory
