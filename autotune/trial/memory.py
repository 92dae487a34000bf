"""Peak memory of one training step on a rank: the CUDA allocator's peak, or on CPU a tracker of live tensor bytes;
and on both, the peak of saved activations alone (SavedActivationBytes).

What the CPU tracker counts: the bytes of every tensor storage alive in the rank's process at the start of the
tracked step (parameters, gradients, optimizer state, the global batch, torch's receive buffers), plus every storage
an operator creates during the step until it is freed (activations, gradients, temporaries, optimizer updates).
Views and in-place results share their input's storage and are counted once. A DTensor (FSDP2's sharded parameters,
gradients and optimizer state) counts as its local shard; FSDP2's all-gather and reduce-scatter buffers are plain
tensors, counted while they live; its gathered parameters live in storages it resizes in place (no operator creates
them), followed through compat.fsdp_storage_resizes. Not counted: memory outside tensors
(Python objects, gloo's own buffers, allocator slack), so it reads lower than RSS but tracks what the GPU allocator
would hold.
"""

from __future__ import annotations

import gc
import warnings
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from autotune.compat import (
    ALLOCATION_BYTES,
    OUT_OF_MEMORY_TEXT,
    TorchDispatchMode,
    fsdp_storage_resizes,
    stored_tensors,
    tree_flatten,
    view_base,
)


class MemoryLimitExceeded(RuntimeError):
    """The tracked live bytes passed the memory limit: the trial counts as out of memory."""

    def __init__(self, live_bytes: int, limit_bytes: int) -> None:
        super().__init__(
            f"tracked live tensor memory {live_bytes} bytes passed the memory limit of {limit_bytes} bytes"
        )
        self.live_bytes = live_bytes


class LiveTensorBytes(TorchDispatchMode):
    """Counts live tensor-storage bytes while active; `peak_bytes` is the high-water mark. `alive`: the tensors
    alive at entry, whose storages an op may hand back (in place, a view) and must not count as new; None looks at
    every tensor in the process (a trial's step); the profiler's backward peaks name the few a block's pass can
    touch (looking at every object is slow, and only differences between two points inside are wanted)."""

    def __init__(self, limit_bytes: int | None = None, *, alive: Iterable[torch.Tensor] | None = None) -> None:
        super().__init__()
        self.limit_bytes = limit_bytes
        # not kept past __enter__: the finalizers on their storages hold this tracker, and would hold them too
        self._alive = None if alive is None else list(alive)
        self.live_bytes = 0
        self.peak_bytes = 0
        self.restart_peak_at_next_op = False
        """Set: the next op first takes the high-water mark back to what is alive (what was let go of in between,
        not counted)."""
        self._live: dict[int, int] = {}

    def __enter__(self) -> LiveTensorBytes:
        if self._alive is None:
            gc.collect()
            with warnings.catch_warnings():  # isinstance() on some torch module objects warns about deprecations
                warnings.simplefilter("ignore")
                tensors = [obj for obj in gc.get_objects() if isinstance(obj, torch.Tensor) and not obj.is_meta]
        else:
            tensors, self._alive = self._alive, []
        for tensor in tensors:
            self._track(tensor)
        self._resizes = fsdp_storage_resizes(self.resized)
        self._resizes.__enter__()
        return super().__enter__()  # type: ignore[return-value]

    def __exit__(self, *exc: Any) -> Any:
        try:
            return super().__exit__(*exc)
        finally:
            self._resizes.__exit__(*exc)

    def resized(self, tensor: torch.Tensor, nbytes: int) -> None:
        """A storage resized in place (FSDP2 gathering a unit's parameters, or freeing them): its new byte count."""
        storage = tensor.untyped_storage()
        key = id(storage)
        if key not in self._live:
            self._live[key] = 0
            weakref.finalize(storage, self._free, key)
        self.live_bytes += nbytes - self._live[key]
        self._live[key] = nbytes
        if self.live_bytes > self.peak_bytes:
            self.peak_bytes = self.live_bytes
            self._new_peak()
            if self.limit_bytes is not None and self.live_bytes > self.limit_bytes:
                raise MemoryLimitExceeded(self.live_bytes, self.limit_bytes)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if self.restart_peak_at_next_op:
            self.restart_peak_at_next_op = False
            self.peak_bytes = self.live_bytes
        out = func(*args, **(kwargs or {}))
        for tensor in tree_flatten(out)[0]:
            if isinstance(tensor, torch.Tensor):
                self._track(tensor)
        return out

    def _track(self, tensor: torch.Tensor) -> None:
        for stored in stored_tensors(tensor):  # a DTensor: its local shard (the mode sees no op inside DTensor's)
            self._track_storage(stored)

    def _track_storage(self, tensor: torch.Tensor) -> None:
        try:
            storage = tensor.untyped_storage()
        except (RuntimeError, NotImplementedError):
            return  # sparse tensors without a storage
        key = id(storage)
        if key in self._live:
            return
        nbytes = storage.nbytes()
        self._live[key] = nbytes
        weakref.finalize(storage, self._free, key)
        self.live_bytes += nbytes
        if self.live_bytes > self.peak_bytes:
            self.peak_bytes = self.live_bytes
            self._new_peak()
            if self.limit_bytes is not None and self.live_bytes > self.limit_bytes:
                raise MemoryLimitExceeded(self.live_bytes, self.limit_bytes)

    def _new_peak(self) -> None:
        """Called at each new high-water mark (PeakBreakdown looks at what is alive)."""

    def _free(self, key: int) -> None:
        self.live_bytes -= self._live.pop(key, 0)


class PeakBreakdown(LiveTensorBytes):
    """LiveTensorBytes that also says what was alive at the peak, by kind: a debugging aid (bench/memory_breakdown.py),
    slow (it looks at every live storage at each new high-water mark), never used by trials.

    kinds() names the storages the caller knows (parameters, gradients, optimizer state, receive buffers, ...): a
    mapping kind -> their storages' data_ptr()s, asked at each new peak; the first kind wins for a storage in
    several. Every other storage
    is "other:<op> in <phase>", the operator that created it and the phase it ran in (or "other:before" when it
    was alive at entry). `phase` is the
    caller's label for what is running (an action, the optimizer step); `breakdown` and `peak_phase` are the
    bytes per kind and the phase at the peak."""

    def __init__(self, kinds: Callable[[], dict[str, Iterable[int]]], limit_bytes: int | None = None) -> None:
        self._kinds = kinds
        self._op = "before"
        self._origin: dict[int, tuple[int, str]] = {}
        """storage key -> (data_ptr, the operator that created it and the phase then)."""
        self.phase = "before"
        self.peak_phase = "before"
        self.breakdown: dict[str, int] = {}
        super().__init__(limit_bytes)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self._op = str(getattr(func, "__name__", func))
        return super().__torch_dispatch__(func, types, args, kwargs)

    def _track_storage(self, tensor: torch.Tensor) -> None:
        try:
            storage = tensor.untyped_storage()
        except (RuntimeError, NotImplementedError):
            return
        if id(storage) not in self._live:
            self._origin[id(storage)] = (storage.data_ptr(), f"{self._op} in {self.phase}")
        super()._track_storage(tensor)

    def _new_peak(self) -> None:
        kind_of: dict[int, str] = {}
        for kind, pointers in self._kinds().items():
            for ptr in pointers:
                kind_of.setdefault(ptr, kind)
        breakdown: dict[str, int] = {}
        for key, nbytes in self._live.items():
            ptr, op = self._origin.get(key, (0, "before"))
            kind = kind_of.get(ptr, f"other:{op}") if ptr else f"other:{op}"
            breakdown[kind] = breakdown.get(kind, 0) + nbytes
        self.breakdown = breakdown
        self.peak_phase = self.phase


class SavedActivationBytes:
    """Counts the bytes autograd keeps for backward (saved activations) while they are kept; `peak_bytes` is the
    high-water mark.

    pack() wraps each saved tensor in a holder whose lifetime is counted, not the tensor's: a receive buffer or a
    stage output outlives the graph, but the graph lets go of its holder when the backward (W, after a split
    backward) is done. Each storage counts once however many holders share it (a layer's output saved again as the
    next layer's input). Not counted: parameters (and views of them, such as a Linear's weight.t(); FSDP2's gathered
    parameters are Parameters too), the storages in `exclude` (the step's batch: it lives anyway), and, with
    activation checkpointing, what checkpoint's own hooks keep and recompute. Under torch.autocast the bfloat16
    copies of weights that a micro-batch's graph keeps are counted: they live as long as its activations."""

    def __init__(self, exclude: Iterable[torch.Tensor] = ()) -> None:
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self.live_bytes = 0
        self.peak_bytes = 0
        self._excluded = {s.untyped_storage().data_ptr() for t in exclude for s in stored_tensors(t)}
        self._holders: dict[int, list[int]] = {}
        """storage data_ptr -> [live holders, storage bytes]."""

    def __enter__(self) -> SavedActivationBytes:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._hooks.__exit__(*exc)

    def _pack(self, tensor: torch.Tensor) -> Any:
        if isinstance(tensor, nn.Parameter) or isinstance(view_base(tensor), nn.Parameter):
            return tensor
        try:  # a DTensor (tensor parallelism's activations and weights): its local tensor's storage
            storage = stored_tensors(tensor)[0].untyped_storage()
            key = storage.data_ptr()
        except (RuntimeError, NotImplementedError, IndexError):
            return tensor
        if key == 0 or key in self._excluded:
            return tensor
        entry = self._holders.setdefault(key, [0, storage.nbytes()])
        if entry[0] == 0:
            self.live_bytes += entry[1]
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        entry[0] += 1
        # detach(): a tensor autograd saves may be the op's own output; holding it with its grad_fn would make a
        # reference cycle through autograd's graph (grad_fn -> holder -> tensor -> grad_fn).
        return _SavedHolder(tensor.detach(), lambda: self._release(key))

    @staticmethod
    def _unpack(packed: Any) -> torch.Tensor:
        return packed.tensor if isinstance(packed, _SavedHolder) else packed

    def _release(self, key: int) -> None:
        entry = self._holders[key]
        entry[0] -= 1
        if entry[0] == 0:
            self.live_bytes -= entry[1]
            del self._holders[key]


class _SavedHolder:
    __slots__ = ("_on_free", "tensor")

    def __init__(self, tensor: torch.Tensor, on_free: Callable[[], None]) -> None:
        self.tensor = tensor
        self._on_free = on_free

    def __del__(self) -> None:
        self._on_free()


_UNITS = {None: 1, "bytes": 1, "KiB": 1024, "MiB": 1024**2, "GiB": 1024**3, "TiB": 1024**4}


def is_out_of_memory(exc: BaseException) -> bool:
    return isinstance(exc, (MemoryLimitExceeded, torch.OutOfMemoryError, MemoryError)) or bool(
        OUT_OF_MEMORY_TEXT.search(str(exc))
    )


def requested_bytes(exc: BaseException) -> int | None:
    """The allocation an out-of-memory error was refused, as its message states it."""
    if isinstance(exc, MemoryLimitExceeded):
        return exc.live_bytes
    match = ALLOCATION_BYTES.search(str(exc))
    if not match:
        return None
    if match["nccl_bytes"] is not None:
        return int(match["nccl_bytes"])
    return int(float(match["number"]) * _UNITS[match["unit"]])
