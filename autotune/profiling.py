"""Measure a model's per-block costs on one device (autotune.costs.Profile), block by block: each block made real
(beside the window's others: WINDOW_BLOCKS), timed with hooks in one pass through the window's blocks, its saved bytes
counted with saved-tensor hooks and its optimizer step timed, at several micro-batch sizes; of blocks that are the
same, a few measured (IN_PLACE_COPIES). Nothing needs the whole model on the device."""

from __future__ import annotations

import contextlib
import gc
import logging
import math
import random
import statistics
import time
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from autotune.candidate import PRECISIONS, Precision
from autotune.compat import (
    around_autograd_passes,
    checkpoint_frames,
    clear_cublas_workspaces,
    stage_backward_input,
    stage_backward_weight,
    view_base,
)
from autotune.costs import BackwardBytes, CheckpointPasses, LayerProfile, Profile, TensorParallelLayer
from autotune.devices import keep_freed_cpu_memory, return_freed_cpu_memory
from autotune.errors import InfeasibleError, ModelFileError, UsageError
from autotune.model_file import SEED, ModelSpec, build_optimizer, build_skeleton, make_batch, map_inputs
from autotune.models.hf import Layer as HFLayer
from autotune.models.materialize import home_blocks, materialize, release_block
from autotune.models.signature import TensorSpec, block_signature
from autotune.runtime import loss_input
from autotune.trial.memory import is_out_of_memory, requested_bytes
from autotune.units import format_bytes

logger = logging.getLogger(__name__)

MAX_DEFAULT_SIZES = 6
QUICK_BLOCK_MS = 1.0
QUICK_BLOCK_SAMPLES = 4
"""A block whose forward takes under QUICK_BLOCK_MS gets this many plain / checkpointed samples per round."""
WINDOW_BLOCKS = 32
WINDOW_PARAMETER_BYTES = 64 * 2**20
"""Blocks measured one after another (a window) are timed in one pass through all of them, as a stage runs its
layers: a block timed alone, over and over, runs with its weights and inputs warm in the caches and measured
13-29 % faster than inside a pass of the model (the mlp recipe's layers at micro-batch 1 on the CPU), so timings
of small blocks only match a stage's in place. A window holds at most this many blocks and parameter bytes (with a
memory limit, at most a sixteenth of it), so a model larger than the device is still measured a block at a time."""
IN_PLACE_COPIES = 4
"""Of blocks that are the same, this many in a row are measured in the window and the rest take the last one's
figures; the window goes on past those (their shapes unchanged), so the block after them runs after one of them.
The first of a run follows a different block (an embedding) and ran ~20 % slower than the later ones in a GPT; with
two copies in place the GPT recipe's blocks measured 5-7 % faster than inside the whole model (a smaller working set
in the caches), with four as fast."""


class ProgressFn(Protocol):
    """Told after each block: how many of how many are done, and which."""

    def __call__(self, completed: int, total: int, description: str) -> None: ...


def default_micro_batch_sizes(batch_size: int, *, limit: int = MAX_DEFAULT_SIZES) -> list[int]:
    """Powers of two dividing B, plus B itself; at most `limit` of them, spread evenly in log scale, 1 and B kept."""
    if batch_size < 1:
        raise UsageError(f"batch size must be at least 1, got {batch_size}")
    sizes = sorted({1 << k for k in range(batch_size.bit_length()) if batch_size % (1 << k) == 0} | {batch_size})
    if len(sizes) <= limit:
        return sizes
    picks = {round(i * (len(sizes) - 1) / (limit - 1)) for i in range(limit)}
    return [sizes[i] for i in sorted(picks)]


def profile_model(
    spec: ModelSpec,
    *,
    batch_size: int,
    micro_batch_sizes: list[int] | None = None,
    device: str = "cpu",
    repeats: int = 5,
    progress: ProgressFn | None = None,
    every_block: bool = False,
    memory_limit_bytes: int | None = None,
    precision: Precision = "fp32",
    state_shards: int = 1,
) -> Profile:
    """Measure every block on its own (a one-block stage, as a pipeline stage runs it) at each micro-batch size.

    The model is built with its parameters on the meta device; blocks are materialised on the device
    (autotune.models.materialize) a window at a time (consecutive measured blocks up to WINDOW_BLOCKS and
    WINDOW_PARAMETER_BYTES; a block over that budget is a window of its own, so at most one large block's
    parameters, gradients, optimizer state and activations are there at once), measured and released. The first
    block gets make_batch's inputs; a later block gets the previous block's outputs, or, after a block that was not
    run and changed shapes, tensors of the shapes and dtypes it gave (random floats, zero integers). Side inputs
    (masks) and what a stage derives from them come from the model's own code. Of blocks with the same signature
    (autotune.models.signature: class, structure, parameter shapes and dtypes, cost-changing attributes such as a
    sliding window, input shapes) IN_PLACE_COPIES in a row are measured and the rest take the last one's figures;
    every_block measures all.

    Per window and size, in one pass through its blocks (each read at its own boundaries, in place, as a stage runs
    its layers): a forward and a full backward, then a forward and a backward that asks only for the input
    gradients (autograd skips the weight-grad work); weight-grad time is the difference. Saved bytes come from an
    untimed pass with saved_tensors_hooks; the optimizer step's time, state and temporaries from the block's own
    parameters. Whole-model optimizer figures are sums over the blocks; the checkpointing ratios come from the
    dominant block's window checkpointed once as one stage (_sample_stage_checkpoint).

    Out of memory (a CUDA allocation, or on CPU the live-tensor tracker passing memory_limit_bytes) at a size makes
    that size and the larger ones infeasible (Profile.infeasible_micro_batch_sizes); at every size, or for a block's
    parameters, gradients and optimizer state alone, it raises InfeasibleError; state_shards: the most ways sharded
    data parallelism may split that state (the GPUs, when shard layouts are planned): the block's state then needs to
    fit under memory_limit_bytes x state_shards. A size at which a block fails to train for another reason (a
    BatchNorm over one value per channel) while a larger size trains is left out with the sizes below it
    (Profile.too_small_micro_batch_sizes); failing at every size, the block is named. On CPU torch runs one thread (one
    thread per rank is the stand-in); the caller's thread count is restored afterwards.

    precision bf16 runs each block's forward under torch.autocast(bfloat16), as the replicate runtime trains, so
    times, saved-activation and output bytes are bf16's, and the loss as the runtime runs it, outside autocast on
    the last block's output made float32 (runtime.loss_input); the bfloat16 copies autocast makes of the
    block's weights (saved for the backward) are counted apart (LayerProfile.autocast_copy_bytes)."""
    if repeats < 1:
        raise UsageError(f"repeats must be at least 1, got {repeats}")
    if precision not in PRECISIONS:
        raise UsageError(f"precision {precision!r} is not one of {', '.join(PRECISIONS)}; pass --precision fp32|bf16")
    sizes = sorted(set(micro_batch_sizes)) if micro_batch_sizes else default_micro_batch_sizes(batch_size)
    if not micro_batch_sizes and spec.has_batchnorm and len(sizes) > 1:
        sizes = [m for m in sizes if m > 1]  # BatchNorm cannot train on one sample
    if sizes[0] < 1:
        raise UsageError(f"micro-batch sizes must be at least 1, got {sizes[0]}; pass --micro-batch-size 1 or more")
    if device not in ("cpu", "cuda") and not device.startswith("cuda:"):
        raise UsageError(f"cannot profile on device {device!r}; use cpu or cuda")
    if memory_limit_bytes is not None and memory_limit_bytes <= 0:
        raise UsageError(f"memory limit must be positive, got {memory_limit_bytes} bytes")
    threads = torch.get_num_threads()
    cuda = device.startswith("cuda")
    if device == "cpu":
        torch.set_num_threads(1)
        keep_freed_cpu_memory()  # as the ranks do: without it, times swing with the allocator's history
    index = _cuda_index(device) if cuda else None
    if cuda:
        clear_cublas_workspaces()  # what an earlier profile of this process left: measured afresh below
        torch.cuda.synchronize(index)
        allocated_before = torch.cuda.memory_allocated(index)
        if memory_limit_bytes is not None:
            total = torch.cuda.get_device_properties(index).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, memory_limit_bytes / total), index)
    workspace_bytes = 0
    call_ms = host_ms = 0.0
    idle: IdleResume | None = None
    try:
        clock: _Clock = _CudaClock() if cuda else _CpuClock()
        host = None if cuda else HostProbe(clock)
        measured, sizes, input_bytes, target_bytes, infeasible, too_small = _Walk(
            spec, sizes, torch.device(device), repeats, clock, memory_limit_bytes,
            host.between_blocks(progress) if host else progress,
            autocast=precision == "bf16", state_shards=state_shards,
        ).results(every_block=every_block)
        call_ms = _optimizer_call_ms(spec, torch.device(device), clock, repeats)
        if host is not None:
            host.sample()
            idle = idle_resume_probe()
            host.sample()
            host_ms = host.lowest()
    finally:
        # The walk (its batches and the tensors handed between blocks) is out of scope here, so what is still
        # allocated below is the libraries' workspaces alone, and the tuner keeps no model after profiling.
        torch.set_num_threads(threads)
        gc.collect()
        if not cuda:
            return_freed_cpu_memory()
        else:
            torch.cuda.synchronize(index)
            workspace_bytes = max(0, torch.cuda.memory_allocated(index) - allocated_before)
            clear_cublas_workspaces()
            if memory_limit_bytes is not None:
                torch.cuda.set_per_process_memory_fraction(1.0, index)
            torch.cuda.empty_cache()
    at = range(len(sizes))
    saved, saved_inputs, handoffs = _saved_without_handoffs(measured, sizes)
    last = measured[-1]
    ratios = [_checkpoint_ratios(*_stage_ratio_pairs(dominant.sizes[m]))
              for dominant in [_dominant(measured, sizes)] for m in sizes]
    return Profile(
        micro_batch_sizes=tuple(sizes),
        layers=tuple(
            LayerProfile(
                name=spec.layer_names[i],
                parameter_bytes=spec.parameter_bytes[i],
                forward_ms=tuple(r.sizes[m].forward_ms for m in sizes),
                backward_input_ms=tuple(r.sizes[m].backward_input_ms for m in sizes),
                backward_weight_ms=tuple(r.sizes[m].backward_weight_ms for m in sizes),
                saved_bytes=tuple(saved[i][k] for k in at),
                output_bytes=tuple(r.sizes[m].output_bytes for m in sizes),
                wire_output_bytes=tuple(_wire_nbytes(r.outputs[m]) for m in sizes),
                saved_input_bytes=tuple(saved_inputs[i][k] for k in at),
                saved_handoff_bytes=tuple(handoffs[i][k] for k in at) if any(handoffs[i]) else (),
                saved_output_bytes=tuple(r.sizes[m].saved_output_bytes for m in sizes),
                backward_bytes=tuple(b for m in sizes if (b := r.sizes[m].backward_bytes) is not None),
                checkpoint_weight_bytes=tuple(r.sizes[m].checkpoint_weight_bytes for m in sizes)
                if any(r.sizes[m].checkpoint_weight_bytes for m in sizes) else (),
                checkpoint_passes=tuple(c for m in sizes if (c := r.sizes[m].checkpoint_passes) is not None)
                if all(r.sizes[m].checkpoint_passes is not None for m in sizes) else (),
                split_input_extra_ms=tuple(r.sizes[m].split_input_extra_ms for m in sizes),
                split_weight_extra_ms=tuple(r.sizes[m].split_weight_extra_ms for m in sizes),
                parameter_groups=r.parameter_groups,
                autocast_copy_bytes=r.sizes[sizes[0]].autocast_copy_bytes,
            )
            for i, r in enumerate(measured)
        ),
        input_bytes=tuple(input_bytes[m] for m in sizes),
        target_bytes=tuple(target_bytes[m] for m in sizes),
        loss_forward_ms=tuple(last.sizes[m].loss_forward_ms for m in sizes),
        loss_backward_ms=tuple(last.sizes[m].loss_backward_ms for m in sizes),
        loss_saved_bytes=tuple(last.sizes[m].loss_saved_bytes for m in sizes),
        loss_input_bytes=tuple(last.sizes[m].loss_input_bytes for m in sizes),
        loss_backward_bytes=tuple(last.sizes[m].loss_backward_bytes for m in sizes),
        checkpoint_forward_ratio=tuple(r[0] for r in ratios),
        checkpoint_recompute_ratio=tuple(r[1] for r in ratios),
        optimizer_step_ms=sum(r.optimizer_ms for r in measured),
        optimizer_state_bytes=sum(r.optimizer_state_bytes for r in measured),
        optimizer_peak_bytes=_whole_step_peak(measured),
        device="cuda" if cuda else "cpu",
        model=str(spec.path),
        batch_size=batch_size,
        repeats=repeats,
        torch_version=torch.__version__,
        shared_parameters=tuple((p.blocks, p.nbytes) for p in spec.shared),
        infeasible_micro_batch_sizes=tuple(infeasible),
        too_small_micro_batch_sizes=tuple(too_small),
        device_workspace_bytes=workspace_bytes,
        optimizer_call_ms=call_ms,
        host_call_ms=host_ms,
        idle_resume_ms=idle.penalties if idle else (),
        idle_resume_window_ms=idle.window_ms if idle else 0.0,
        precision=precision,
        tensor_parallel_layers=_tensor_parallel_layers(spec),
    )


def _cuda_index(device: str) -> int:
    """The CUDA device index of "cuda" (the current device) or "cuda:N"; torch's memory calls want one."""
    parsed = torch.device(device)
    return parsed.index if parsed.index is not None else torch.cuda.current_device()


def _tensor_parallel_layers(spec: ModelSpec) -> tuple[TensorParallelLayer, ...]:
    """What the model's tensor-parallel plan does to each block (models.tensor_parallel.tp_layer_terms); () without
    a plan, or with one that does not fit (the profile is still good for tp 1; a tp trial says what is wrong)."""
    from autotune.models.tensor_parallel import tp_layer_terms

    try:
        return tp_layer_terms(spec)
    except ModelFileError as exc:
        logger.warning("no tensor-parallel terms in the profile: %s", exc)
        return ()


def _whole_step_peak(measured: Sequence[_BlockResult]) -> int:
    """A whole-model step's temporaries from the blocks' steps: a foreach or fused step (torch's default on CUDA)
    makes temporaries for all its tensors at once, so they add up; a per-tensor step (torch's default on CPU) makes
    them one tensor at a time, so the largest block's stands for the model's."""
    peaks = [r.optimizer_peak_bytes for r in measured]
    if not peaks:
        return 0
    return sum(peaks) if any(r.optimizer_grouped for r in measured) else max(peaks)


def _dominant(measured: Sequence[_BlockResult], sizes: Sequence[int]) -> _BlockResult:
    """The measured block whose kind takes most of the model's forward time: its checkpointing ratios stand for the
    model's, from its window checkpointed once as one stage (as a stage is), or, where it was timed alone, from the
    block checkpointed on its own (a checkpoint's fixed cost then weighs most in the smallest blocks; the kind that
    dominates the time is the one whose ratio matters)."""
    share: dict[int, float] = {}
    for r in measured:
        share[id(r.sizes)] = share.get(id(r.sizes), 0.0) + sum(r.sizes[m].forward_ms for m in sizes)
    return max(measured, key=lambda r: share[id(r.sizes)])


def _saved_without_handoffs(
    measured: Sequence[_BlockResult], sizes: Sequence[int]
) -> tuple[list[list[int]], list[list[int]], list[list[int]]]:
    """Saved bytes per block and size, a storage counted once: inside a stage, a block's output that it saves is the
    storage the next block saves as its input, so the next block's count drops it (the first block saving a storage
    keeps it, as in one pass over the whole model); of those, the bytes of the block's input (what a stage
    starting at the block saves of the tensor it received: the memory model counts that tensor once); and the
    bytes dropped (a stage starting at the block on a wire that casts saves a copy of its own)."""
    saved, inputs, handoffs = [], [], []
    for i, r in enumerate(measured):
        row, into, handed = [], [], []
        for m in sizes:
            here = r.sizes[m]
            shared = min(measured[i - 1].sizes[m].saved_output_bytes, here.saved_input_bytes) if i else 0
            row.append(max(0, here.saved_bytes - shared))
            into.append(min(row[-1], here.saved_input_bytes - shared))
            handed.append(here.saved_bytes - row[-1])
        saved.append(row)
        inputs.append(into)
        handoffs.append(handed)
    return saved, inputs, handoffs


@dataclass(kw_only=True)
class _SizeResult:
    """One block at one micro-batch size (medians over the rounds)."""

    forward_ms: float = 0.0
    backward_input_ms: float = 0.0
    backward_weight_ms: float = 0.0
    saved_bytes: int = 0
    saved_input_bytes: int = 0
    """Of saved_bytes, the block's input storages."""
    saved_output_bytes: int = 0
    """Of saved_bytes, the block's output storages."""
    backward_bytes: BackwardBytes | None = None
    """What the block's backward holds on top of what was alive before it (_backward_bytes)."""
    autocast_copy_bytes: int = 0
    """The bfloat16 copies of the block's parameters autocast made and autograd saved (not in saved_bytes)."""
    checkpoint_weight_bytes: int = 0
    """The block checkpointed, its split W's peak beyond what was alive and its weight gradients (0: none)."""
    checkpoint_passes: CheckpointPasses | None = None
    """The same W pass by pass (None: not measured)."""
    output_bytes: int = 0
    loss_forward_ms: float = 0.0
    loss_backward_ms: float = 0.0
    loss_saved_bytes: int = 0
    loss_input_bytes: int = 0
    """The last block: its output as the loss gets it (float32 in bf16), which the last stage keeps."""
    loss_backward_bytes: int = 0
    """The last block: the peak of the loss's backward over what was alive before it (_loss_bytes)."""
    plain: tuple[float, float] = (0.0, 0.0)
    """(forward, backward) of the block as a stage, the fastest of the rounds."""
    checkpointed: tuple[float, float] = (0.0, 0.0)
    """The same, checkpointed as a stage is."""
    stage_plain: tuple[float, float] = (0.0, 0.0)
    """(forward, backward) of the blocks timed together with this one (its window) as one stage, the fastest of the
    rounds; (0, 0) where the block was timed alone."""
    stage_checkpointed: tuple[float, float] = (0.0, 0.0)
    """The same stage checkpointed once, as the runtime checkpoints a stage."""
    split_input_extra_ms: float = 0.0
    """torch's split backward of the block as a stage: its I beyond the input gradients' share of a whole backward
    (_split_extras)."""
    split_weight_extra_ms: float = 0.0
    """Its W beyond the weight gradients' share."""


@dataclass(kw_only=True)
class _BlockResult:
    index: int
    sizes: dict[int, _SizeResult]
    outputs: dict[int, list[TensorSpec]]
    """Shapes and dtypes of the block's outputs per size: the next block's inputs."""
    parameter_groups: int
    optimizer_ms: float
    optimizer_state_bytes: int
    optimizer_peak_bytes: int
    optimizer_grouped: bool
    """The step works on all its tensors at once (foreach or fused)."""


@dataclass(kw_only=True)
class _Open:
    """A block of the window being measured: real on the device, what is measured of it alone taken, its timing
    (in the window's passes) to come."""

    index: int
    block: nn.Module
    unit: _Unit | None
    samples: dict[int, _SizeSamples]
    optimizer: tuple[float, int, int, bool]

    @property
    def outputs(self) -> dict[int, tuple[torch.Tensor, ...]]:
        return {m: samples.outputs for m, samples in self.samples.items()}


class _Walk:
    """The blocks in model order: each measured (or its twin's measurement reused), its outputs the next's inputs."""

    def __init__(
        self,
        spec: ModelSpec,
        sizes: list[int],
        device: torch.device,
        repeats: int,
        clock: _Clock,
        memory_limit_bytes: int | None,
        progress: ProgressFn | None,
        *,
        autocast: bool = False,
        state_shards: int = 1,
    ) -> None:
        self.autocast = autocast
        self.state_shards = max(1, state_shards)
        self.spec, self.sizes, self.device, self.repeats, self.clock = spec, list(sizes), device, repeats, clock
        self.limit = memory_limit_bytes
        self.progress = progress
        self.infeasible: list[int] = []
        self.too_small: list[int] = []
        self._reported = 0  # the blocks whose figures are final and said to `progress`
        self.skeleton = build_skeleton(spec)
        self.home = home_blocks(self.skeleton.blocks)
        self.targets: dict[int, torch.Tensor] = {}
        self.side: dict[int, dict[str, Any]] = {}
        self.first: dict[int, tuple[torch.Tensor, ...]] = {}
        self.input_bytes: dict[int, int] = {}
        for m in self.sizes:
            inputs, targets = make_batch(spec, m)
            args, side = self.skeleton.split_inputs(map_inputs(inputs, lambda t: t.to(device)))
            self.first[m], self.side[m], self.targets[m] = args, side, targets.to(device)
            self.input_bytes[m] = _nbytes(args[0])

    def results(
        self, *, every_block: bool
    ) -> tuple[list[_BlockResult], list[int], dict[int, int], dict[int, int], list[int], list[int]]:
        """run()'s measurements with what profile_model needs of the walk, none of it a tensor or module: (per-block
        results, the sizes that fit, input and target bytes per size, the sizes that did not fit, the sizes too small
        to train)."""
        measured = self.run(every_block=every_block)
        targets = {m: _nbytes(t) for m, t in self.targets.items()}
        return (measured, list(self.sizes), dict(self.input_bytes), targets, list(self.infeasible),
                list(self.too_small))

    def run(self, *, every_block: bool) -> list[_BlockResult]:
        n = self.skeleton.n_blocks
        results: dict[int, _BlockResult] = {}
        timed: dict[Hashable, list[int]] = {}  # signature -> the blocks of it measured, in order
        copies: dict[int, int] = {}  # a block not measured -> the measured one whose figures it takes
        out_specs: dict[int, dict[int, list[TensorSpec]]] = {}
        carried: dict[int, tuple[torch.Tensor, ...]] | None = dict(self.first)
        specs = {m: [_spec(t) for t in args] for m, args in self.first.items()}
        window: list[_Open] = []
        try:
            for i in range(n):
                if not self.sizes:
                    break
                # Input shapes at the smallest size stand for all (they scale with it), and it is the size kept
                # last when larger ones run out of memory: the signature does not change when sizes are dropped.
                signature = block_signature(self.skeleton, i, [tuple(specs[self.sizes[0]])])
                same = [] if every_block else timed.get(signature, [])
                in_window = sum(1 for opened in window if opened.index in same)
                room = carried is not None and self._has_room(window, i)
                if same and not (0 < in_window < IN_PLACE_COPIES and room):
                    copies[i] = same[-1]  # the latest in place: with the most of the model before it
                    out_specs[i] = out_specs[same[-1]]
                    if carried is not None and any(out_specs[i][m] != specs[m] for m in self.sizes):
                        carried = None  # a block changing shapes was skipped: the next measured one gets made-up inputs
                    specs = out_specs[i]
                    self._resolve(copies, results)
                    continue
                if not room:
                    self._close(window, results)
                    self._resolve(copies, results)
                inputs = carried if carried is not None else {m: _synthesize(specs[m], self.device, seed=i)
                                                              for m in self.sizes}
                opened = self._open(i, inputs, window)
                window.append(opened)
                timed.setdefault(signature, []).append(i)
                carried = opened.outputs if i + 1 < n else None
                specs = out_specs[i] = {m: [_spec(t) for t in opened.outputs[m]] for m in self.sizes}
            self._close(window, results)
            self._resolve(copies, results)
        finally:
            self._release(window)
        if not self.sizes:
            raise InfeasibleError(
                f"{self.spec.path}: even micro-batch size {self.infeasible[0]} runs out of memory for one block "
                f"on its own{self._limit_text()}; use smaller micro-batches (--micro-batch-size), a smaller model, "
                f"or a device with more memory"
            )
        return [results[i] for i in range(len(results))]

    def _resolve(self, copies: dict[int, int], results: dict[int, _BlockResult]) -> None:
        """Give each block not measured its twin's figures once they are final, and report the blocks done in order."""
        for i, twin in copies.items():
            if i not in results and twin in results:
                results[i] = _BlockResult(**{**results[twin].__dict__, "index": i})
        n = self.skeleton.n_blocks
        while self._reported in results:
            self._report(self._reported, n, twin=self._reported in copies)
            self._reported += 1

    def _has_room(self, window: list[_Open], index: int) -> bool:
        """Whether block `index` may join the window (WINDOW_BLOCKS, WINDOW_PARAMETER_BYTES)."""
        if not window:
            return True
        budget = WINDOW_PARAMETER_BYTES if self.limit is None else min(WINDOW_PARAMETER_BYTES, self.limit // 16)
        return len(window) < WINDOW_BLOCKS and self._held(window) + self.spec.parameter_bytes[index] <= budget

    def _held(self, window: list[_Open]) -> int:
        """The parameter bytes of the window's blocks (real on the device)."""
        return sum(self.spec.parameter_bytes[opened.index] for opened in window)

    def _report(self, index: int, n: int, *, twin: bool) -> None:
        if self.progress is not None:
            self.progress(index + 1, n, f"block {index + 1} of {n}" + (" (as an earlier one)" if twin else ""))

    def _limit_text(self) -> str:
        if self.limit is None:
            return ""
        return f" under the memory limit of {format_bytes(self.limit)} (--memory-limit)"

    def _open(self, index: int, inputs: dict[int, tuple[torch.Tensor, ...]], window: list[_Open]) -> _Open:
        """Materialise block `index` beside the window's and take what is measured of it alone: its optimizer step
        and, per size that still fits, its tracked step, saved bytes and outputs (the next block's inputs). Under a
        memory limit the window's other blocks' parameters do not count against it: alone, the block would not
        hold them."""
        spec, skeleton = self.spec, self.skeleton
        # The window's blocks named too: a tied parameter's home group made real for this block must not release
        # what a block of the window runs (GPT-2's head shares the embedding's group, wpe included).
        materialize(skeleton.model, skeleton.blocks, skeleton.names, [*(o.index for o in window), index],
                    device=self.device, init_weights=spec.init_weights, seed=SEED)
        block = skeleton.blocks[index]
        held = self._held(window)
        try:
            stage = skeleton.stage(index, index + 1).to(self.device)
            stage.train()
            unit = _Unit(stage, block, last=index == skeleton.n_blocks - 1, autocast=self.autocast)
            own = [p for p in _unique(block.parameters()) if self.home[id(p)] == index and p.requires_grad]
            optimizer = self._optimizer(index, own, unit, held, lambda: self._gradients(index, unit, inputs))
            samples: dict[int, _SizeSamples] = {}
            failures: list[tuple[int, BaseException]] = []  # (size, error) of this block's failed training steps
            for m in list(self.sizes):
                try:
                    samples[m] = _SizeSamples(unit, self._inputs(index, inputs[m], m), self._loss(unit, m),
                                              self.clock, track_limit=self.limit + held
                                              if self.limit is not None and self.device.type == "cpu" else None)
                except (ModelFileError, UsageError):
                    raise
                except Exception as exc:  # the user's model can raise anything
                    if is_out_of_memory(exc):
                        self._drop_from(m, index, exc)
                        break
                    failures.append((m, exc))
                    if m != self.sizes[0] or m == self.sizes[-1]:  # not a size too small: the model fails
                        raise self._failed(index, failures) from exc
                    self._drop_to(m, index, exc)
            unit.zero_grad(set_to_none=True)
        except BaseException:
            self._free([block])
            raise
        return _Open(index=index, block=block, unit=unit, samples=samples, optimizer=optimizer)

    def _close(self, window: list[_Open], results: dict[int, _BlockResult]) -> None:
        """Time the window's blocks in place (WINDOW_BLOCKS): per round and size, one untimed pass through all of
        them, a timed full one and a timed input-grad one, then each block plain as a stage and the window
        checkpointed once as one (_sample_chain); then release them. A window that runs out of memory at some size
        is timed a block at a time instead."""
        if not window:
            return
        try:
            self._rounds([window])
        except Exception as exc:
            if len(window) == 1 or not is_out_of_memory(exc):
                raise
            logger.info("blocks %s-%s run out of memory timed together; timing them one at a time: %s",
                        window[0].index, window[-1].index, exc)
            for opened in window:
                for samples in opened.samples.values():
                    samples.clear()
            self._rounds([[opened] for opened in window])
        for opened in window:
            optimizer_ms, state_bytes, peak_bytes, grouped = opened.optimizer
            results[opened.index] = _BlockResult(
                index=opened.index,
                sizes={m: opened.samples[m].result() for m in self.sizes},
                outputs={m: [_spec(t) for t in opened.samples[m].outputs] for m in self.sizes},
                parameter_groups=sum(1 for module in opened.block.modules()
                                     if next(module.parameters(recurse=False), None) is not None),
                optimizer_ms=optimizer_ms,
                optimizer_state_bytes=state_bytes,
                optimizer_peak_bytes=peak_bytes,
                optimizer_grouped=grouped,
            )
        self._release(window)
        window.clear()

    def _rounds(self, chains: list[list[_Open]]) -> None:
        for _ in range(self.repeats):  # round-robin: interference slows every size a little, not one a lot
            for m in self.sizes:
                for chain in chains:
                    _sample_chain([opened.samples[m] for opened in chain], self.clock)

    def _release(self, window: list[_Open]) -> None:
        """Let go of the blocks' parameters (and the graphs and optimizer state that hold them)."""
        for opened in window:
            opened.samples.clear()
            opened.unit = None
        self._free([opened.block for opened in window])

    def _free(self, blocks: list[nn.Module]) -> None:
        """Release the blocks' parameters, once nothing of a pass holds them."""
        gc.collect()  # graphs and optimizer state held in reference cycles let go of the parameters
        for block in blocks:
            release_block(block)
        if blocks and self.device.type == "cuda":
            torch.cuda.empty_cache()

    def _gradients(self, index: int, unit: _Unit, inputs: dict[int, tuple[torch.Tensor, ...]]) -> None:
        """One forward and backward of the block at the smallest size: the gradients a step leaves (an embedding's
        rows that no token reached stay zero, as in a trial's steps). Any failure is left to the timed passes to
        report; the optimizer is then timed on stand-in gradients."""
        m = min(self.sizes)
        try:
            (args, side), _ = self._inputs(index, inputs[m], m)
            _chain_pass([unit], (args, side), self._loss(unit, m), self.clock, full=True)
        except Exception:  # noqa: BLE001 - out of memory or the model's own error: _SizeSamples says which
            logger.debug("block %s: no backward to take gradients from for the optimizer step", index,
                         exc_info=True)
            unit.zero_grad(set_to_none=True)

    def _optimizer(
        self, index: int, params: list[nn.Parameter], unit: _Unit, held: int, gradients: Callable[[], None]
    ) -> tuple[float, int, int, bool]:
        """The block's optimizer step: median time, state bytes, temporaries, whether it is foreach / fused, timed on
        the gradients one backward of the block leaves (`gradients`). With a memory limit on CPU, the block's
        parameters, gradients and state must fit under it (on CUDA the allocator enforces it); held: the window's
        other blocks' parameter bytes, not counted."""
        try:
            limit = self.limit * self.state_shards + held if self.limit is not None else None
            return _profile_optimizer(self.spec, params, unit, self.clock, self.repeats,
                                      limit=limit if self.device.type == "cpu" else None, gradients=gradients)
        except Exception as exc:
            if not is_out_of_memory(exc):
                raise
            needed = requested_bytes(exc)
            at_least = f" (at least {format_bytes(needed)} counted)" if needed else ""
            shards = (f", even sharded over {self.state_shards} replicas" if self.state_shards > 1 else
                      "; no pipeline split can hold it")
            fix = ("more GPUs to shard over, a device with more memory or a lighter optimizer" if self.state_shards > 1
                   else "sharded data parallelism (--data-parallel shard, with more GPUs), a device with more memory "
                        "or a lighter optimizer")
            raise InfeasibleError(
                f"{self.spec.path}: block {self.spec.describe_layer(index)} alone needs more memory for its "
                f"parameters, gradients and optimizer state{at_least} than the device has{self._limit_text()}"
                f"{shards}: use {fix}"
            ) from exc

    def _inputs(
        self, index: int, args: tuple[torch.Tensor, ...], m: int
    ) -> tuple[tuple[tuple[torch.Tensor, ...], dict[str, Any]], tuple[torch.Tensor, ...]]:
        """(arguments and side inputs for the full pass, arguments for the input-grad pass). A later block's float
        inputs need gradients, as a stage's received activations do; the model's own inputs do not, except the
        first float one in the input-grad pass."""
        if index == 0:
            x = args[0]
            partial = (x.detach().requires_grad_(True), *args[1:]) if x.is_floating_point() else args
            return (args, self.side[m]), partial
        made = tuple(t.detach().requires_grad_(True) if t.is_floating_point() else t for t in args)
        return (made, self.side[m]), made

    def _loss(self, unit: _Unit, m: int) -> Callable[[Any], torch.Tensor]:
        if unit.last:
            targets = self.targets[m]

            def loss(output: Any) -> torch.Tensor:  # as the last stage hands it over (runtime.StageBoundary)
                return self.spec.loss_fn(loss_input(output) if unit.autocast else output, targets)

            return loss
        return _Surrogate()

    def _drop_from(self, m: int, index: int, exc: BaseException) -> None:
        dropped = [s for s in self.sizes if s >= m]
        logger.info("micro-batch size %s runs out of memory for block %s%s: %s", m, index, self._limit_text(), exc)
        self.infeasible = sorted({*self.infeasible, *dropped})
        self.sizes = [s for s in self.sizes if s < m]

    def _drop_to(self, m: int, index: int, exc: BaseException) -> None:
        """Size m (the smallest left) failed to train for block `index`, for another reason than memory: leave it
        and the smaller ones out if a larger one runs (BatchNorm over one value per channel); _open goes on."""
        logger.info("micro-batch size %s fails to train block %s (trying larger ones): %s", m, index, exc)
        self.too_small = sorted({*self.too_small, *(s for s in self.sizes if s <= m)})
        self.sizes = [s for s in self.sizes if s > m]

    def _failed(self, index: int, failures: list[tuple[int, BaseException]]) -> ModelFileError:
        """The one line for a block whose training step fails: at one size, or at each size tried (the first
        size's error: the larger ones were tried in case it was too small)."""
        m, exc = failures[0]
        if len(failures) == 1:
            where = f"at micro-batch size {m}"
        else:
            where = f"at every micro-batch size tried ({', '.join(str(size) for size, _ in failures)}), first at {m}"
        text = " ".join(f"{type(exc).__name__}: {exc}".split())[:300]
        fix = "run the model's own forward and backward on make_batch's inputs to see it fail"
        if "in-place operation" in text or "modified inplace" in text:
            # a stage's input is a leaf that needs its gradient: the model's own forward never hands the block one
            fix = ("the block changes its input in place, which a pipeline stage's input (a leaf tensor that needs "
                   "its gradient) does not allow: do that out of place (`x = x * a`, not `x.mul_(a)`; "
                   "inplace=False on a module)")
        return ModelFileError(
            f"{self.spec.path}: a training step of block {self.spec.describe_layer(index)} failed {where} ({text}); "
            f"{fix}"
        )


class _Unit:
    """One block as a one-block stage on the device: what the hooks time. autocast: its forward runs under
    torch.autocast(bfloat16) (bf16 precision)."""

    def __init__(self, module: nn.Module, block: nn.Module, *, last: bool, autocast: bool = False) -> None:
        self.module, self.block, self.last, self.autocast = module, block, last, autocast

    def __call__(self, args: tuple[torch.Tensor, ...], side: dict[str, Any]) -> Any:
        with self.precision():
            return self.module(*args, **side)

    def precision(self) -> contextlib.AbstractContextManager[Any]:
        """The forward's precision: autocast to bfloat16, or nothing."""
        if not self.autocast:
            return contextlib.nullcontext()
        device = next((p.device.type for p in self.module.parameters()), "cpu")
        return torch.autocast(device_type=device, dtype=torch.bfloat16)

    def parameters(self) -> list[nn.Parameter]:
        return list(self.module.parameters())

    def zero_grad(self, *, set_to_none: bool = True) -> None:
        self.module.zero_grad(set_to_none=set_to_none)


class _Surrogate:
    """Stands for the rest of the model after a block that is not the last: sum(output * g) with a fixed random g
    per output, so the backward gets a gradient of the output's shape, as a stage gets one from the next."""

    def __init__(self) -> None:
        self.grads: list[torch.Tensor] | None = None

    def __call__(self, output: Any) -> torch.Tensor:
        tensors = [t for t in _flat(output) if t.is_floating_point()]
        if self.grads is None:
            generator = torch.Generator(tensors[0].device if tensors else "cpu").manual_seed(0)
            self.grads = [torch.randn(t.shape, dtype=t.dtype, device=t.device, generator=generator)
                          for t in tensors]
        total = torch.zeros((), device=tensors[0].device if tensors else None)
        for t, g in zip(tensors, self.grads):
            if t.requires_grad:
                total = total + (t * g).sum()
        return total


def _flat(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _flat(v)]
    return []


def _spec(t: torch.Tensor) -> TensorSpec:
    return tuple(t.shape), t.dtype


def _synthesize(specs: Sequence[TensorSpec], device: torch.device, *, seed: int) -> tuple[torch.Tensor, ...]:
    """Inputs of these shapes and dtypes: standard normal floats, zero integers (valid indices), true booleans."""
    generator = torch.Generator(device).manual_seed(seed)
    out = []
    for shape, dtype in specs:
        if dtype.is_floating_point:
            out.append(torch.randn(shape, dtype=dtype, device=device, generator=generator))
        elif dtype == torch.bool:
            out.append(torch.ones(shape, dtype=dtype, device=device))
        else:
            out.append(torch.zeros(shape, dtype=dtype, device=device))
    return tuple(out)


def _unique(params: Any) -> list[nn.Parameter]:
    seen: dict[int, nn.Parameter] = {}
    for p in params:
        seen.setdefault(id(p), p)
    return list(seen.values())


# --- measurement -------------------------------------------------------------------------------------------------


class _Clock(Protocol):
    def mark(self) -> Any: ...
    def ms(self, start: Any, end: Any) -> float: ...
    def sync(self) -> None: ...


class _CpuClock:
    def mark(self) -> float:
        return time.perf_counter()

    def ms(self, start: float, end: float) -> float:
        return (end - start) * 1e3

    def sync(self) -> None:
        pass


class _CudaClock:
    """CUDA events recorded on the current stream (autograd runs each node on its forward's stream)."""

    def mark(self) -> Any:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def ms(self, start: Any, end: Any) -> float:
        return float(start.elapsed_time(end))

    def sync(self) -> None:
        torch.cuda.synchronize()


class _SizeSamples:
    """One block at one micro-batch size: the untimed passes at construction (a tracked one under a memory limit,
    the saved-bytes one, warm-ups), then timed rounds, one per sample() call."""

    def __init__(
        self,
        unit: _Unit,
        inputs: tuple[tuple[tuple[torch.Tensor, ...], dict[str, Any]], tuple[torch.Tensor, ...]],
        loss: Callable[[Any], torch.Tensor],
        clock: _Clock,
        *,
        track_limit: int | None,
    ) -> None:
        (self.args, self.side), self.partial_args = inputs
        self.unit, self.loss, self.clock = unit, loss, clock
        if track_limit is not None:  # the block's training step at this size, counted like a trial's step
            from autotune.trial.memory import LiveTensorBytes

            with LiveTensorBytes(limit_bytes=track_limit):
                self._pass(full=True)
        (self.saved, self.loss_saved, self.output_bytes, self.saved_input, self.saved_output, self.copies,
         output) = _saved_bytes(unit, (self.args, self.side), loss)
        self.outputs = tuple(t.detach() for t in _flat(output))
        self.loss_input_bytes, self.loss_backward_bytes = (
            _loss_bytes(output, loss, cast=unit.autocast) if unit.last else (0, 0))
        del output  # and with it the pass's graph
        self.backward_bytes = _backward_bytes(unit, (self.args, self.side))
        self.checkpoint_weight_bytes, self.checkpoint_passes = _checkpoint_weight_bytes(
            unit, (self.args, self.side), loss)
        self.forward: list[float] = []
        self.full: list[float] = []
        self.partial: list[float] = []
        self.loss_forward: list[float] = []
        self.loss_backward: list[float] = []
        self.plain: list[tuple[float, float]] = []
        self.checkpointed: list[tuple[float, float]] = []
        self.split: list[tuple[float, float]] = []
        self.stage_plain: list[tuple[float, float]] = []
        self.stage_checkpointed: list[tuple[float, float]] = []
        self._pass(full=True)  # warm-up (allocator, lazy init)
        self._pass(full=False)
        _stage_pass([unit], (self.args, self.side), loss, clock, checkpointed=True)
        unit.zero_grad(set_to_none=True)

    def _pass(self, *, full: bool) -> tuple[list[float], float, list[float], float]:
        args = self.args if full else self.partial_args
        return _chain_pass([self.unit], (args, self.side), self.loss, self.clock, full=full)

    def clear(self) -> None:
        """Forget the timings taken so far (the window is timed again another way)."""
        for times in (self.forward, self.full, self.partial, self.loss_forward, self.loss_backward, self.plain,
                      self.checkpointed, self.split, self.stage_plain, self.stage_checkpointed):
            times.clear()

    def sample_checkpoint(self, *, alone: bool) -> None:
        """The block plain as a stage (what its split backward's extras are measured against) and under torch's split
        backward; alone (not timed with other blocks), also checkpointed, for the checkpointing ratios (a window's
        come from the window checkpointed once: _sample_stage_checkpoint)."""
        inputs = (self.args, self.side)
        # A block of well under a millisecond is easily hit by the machine's other work: more samples of it.
        quick = bool(self.forward) and min(self.forward) < QUICK_BLOCK_MS
        for _ in range(QUICK_BLOCK_SAMPLES if quick else 1):
            self.plain.append(_stage_pass([self.unit], inputs, self.loss, self.clock, checkpointed=False))
            if alone:
                self.checkpointed.append(_stage_pass([self.unit], inputs, self.loss, self.clock, checkpointed=True))
            self.split.append(_split_pass(self.unit, inputs, self.loss, self.clock))
        self.unit.zero_grad(set_to_none=True)

    def result(self) -> _SizeResult:
        full = statistics.median(self.full)
        partial = min(statistics.median(self.partial), full)  # noise: no weight-grad work left
        last = self.unit.last
        split_input, split_weight = _split_extras(self.plain, self.split, partial / full if full > 0 else 0.5)
        return _SizeResult(
            split_input_extra_ms=split_input,
            split_weight_extra_ms=split_weight,
            forward_ms=statistics.median(self.forward),
            backward_input_ms=partial,
            backward_weight_ms=full - partial,
            saved_bytes=self.saved,
            saved_input_bytes=self.saved_input,
            saved_output_bytes=self.saved_output,
            backward_bytes=self.backward_bytes,
            autocast_copy_bytes=self.copies,
            checkpoint_weight_bytes=self.checkpoint_weight_bytes,
            checkpoint_passes=self.checkpoint_passes,
            output_bytes=self.output_bytes,
            loss_forward_ms=statistics.median(self.loss_forward) if last else 0.0,
            loss_backward_ms=statistics.median(self.loss_backward) if last else 0.0,
            loss_saved_bytes=self.loss_saved if last else 0,
            loss_input_bytes=self.loss_input_bytes,
            loss_backward_bytes=self.loss_backward_bytes,
            plain=_fastest(self.plain),
            checkpointed=_fastest(self.checkpointed),
            stage_plain=_fastest(self.stage_plain),
            stage_checkpointed=_fastest(self.stage_checkpointed),
        )


def _fastest(pairs: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """The fastest forward and backward: they only enter ratios, and a block's few samples are easily hit by the
    machine's other work (interference only adds time), more so than a whole model's were."""
    if not pairs:
        return 0.0, 0.0
    return min(f for f, _ in pairs), min(b for _, b in pairs)


def _split_pass(
    unit: _Unit,
    inputs: tuple[tuple[torch.Tensor, ...], dict[str, Any]],
    loss_fn: Callable[[Any], torch.Tensor],
    clock: _Clock,
) -> tuple[float, float]:
    """I and W times of the block as a stage under a split backward, run as torch's stage runs them
    (stage_backward_input from the loss, then stage_backward_weight over the parameter groups it returned); (0, 0)
    for a block without floating inputs to take a gradient for (a first stage: its W is a whole backward)."""
    args, side = inputs
    received = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
    if not received:
        return 0.0, 0.0
    output = unit(args, side)
    loss = loss_fn(output)
    if not loss.requires_grad:
        return 0.0, 0.0
    parameters = unit.parameters()
    start = clock.mark()
    _, groups = stage_backward_input([loss], None, received, parameters)
    middle = clock.mark()
    stage_backward_weight(parameters, groups)
    end = clock.mark()
    clock.sync()
    for a in received:
        a.grad = None
    return clock.ms(start, middle), clock.ms(middle, end)


def _checkpoint_weight_bytes(
    unit: _Unit, inputs: tuple[tuple[torch.Tensor, ...], dict[str, Any]], loss_fn: Callable[[Any], torch.Tensor]
) -> tuple[int, CheckpointPasses | None]:
    """The block as a checkpointed stage under torch's split backward (the runtime's checkpoint, then
    stage_backward_input and stage_backward_weight): the peak of its W beyond what was alive before the W and the
    weight gradients the W made, from the allocator on CUDA, the live tensor-storage tracker on CPU; 0 for a block
    without floating inputs to take a gradient for (a first stage's W is a whole backward). And the same W pass by
    pass, as the last block of a stage and as an earlier one (costs.CheckpointPasses; None where torch's checkpoint
    does not show what its passes keep).

    Each of the W's autograd passes, one per parameter group, recomputes the stage, and what a pass recomputed and
    did not use stays until a pass walks the node that saved it or no group left reaches that node: a Hugging Face
    OPT's stage of three decoder layers (8 groups each) held 148 MB of recomputes in one W, 16x the 9.2 MB its
    backward rebuilds once."""
    args, side = inputs
    received = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
    if not received or not unit.parameters():
        return 0, None
    peak, free, _, _, _ = _checkpointed_weight(unit, args, side, loss_fn, hold=False)
    if free is None:
        return peak, None
    _, held, kept, let_go, input_kept = _checkpointed_weight(unit, args, side, loss_fn, hold=True)
    return peak, None if held is None else CheckpointPasses(free=free, held=held, kept=kept, let_go=let_go,
                                                            input_kept=input_kept)


def _checkpointed_weight(
    unit: _Unit, args: tuple[torch.Tensor, ...], side: dict[str, Any], loss_fn: Callable[[Any], torch.Tensor], *,
    hold: bool
) -> tuple[int, tuple[tuple[int, int, int], ...] | None, int, int, bool]:
    """One checkpointed forward, I and W of the block (_checkpoint_weight_bytes): (the W's peak; per pass that
    recomputes, its peaks recomputing and walking and what its recompute keeps once done, as CheckpointPasses counts
    them, None where the checkpoint's frame is out of reach; what one recompute keeps at the W's end; what the W let
    go of that was alive before it, counted where hold; whether the last pass's recompute still holds what the block
    saved of its input). hold: the output's graph kept alive throughout, as a later block's parameter groups keep
    an earlier block's."""
    received = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
    parameters = unit.parameters()
    unit.zero_grad(set_to_none=True)
    kept_grads = [a.grad for a in received]
    touched = [*parameters, *unit.module.buffers(), *_flat(args), *_flat(list(side.values()))]
    own = {t.untyped_storage().data_ptr() for t in touched if isinstance(t, torch.Tensor)}
    passes: list[tuple[int, int, int]] = []
    recomputes: list[Any] = []  # each pass's recompute's key in frame.recomputed
    input_kept = True
    try:
        with checkpoint_frames() as frames, _Meter(parameters[0].device, touched) as meter:
            with unit.precision():
                output = checkpoint(unit.module, *args, use_reentrant=False, **side)
            loss = loss_fn(output)
            if not loss.requires_grad:
                return 0, None, 0, 0, True
            root = loss.grad_fn if hold else None
            _, groups = stage_backward_input([loss], None, received, parameters)
            del output, loss
            meter.mark()
            frame = frames[0] if len(frames) == 1 else None
            ids: set[Any] = set()
            highest, recomputing = [0], [0]

            def before() -> None:
                ids.clear()
                ids.update(frame.recomputed.keys() if frame is not None else ())
                highest[0] = max(highest[0], meter.restart_peak())
                recomputing[0] = 0

            def recompute(*inner: Any, **kwargs: Any) -> Any:
                try:
                    return forward(*inner, **kwargs)
                finally:  # the recompute's peak; from its next op (its graph let go of) the pass's walk
                    recomputing[0] = meter.restart_peak()
                    highest[0] = max(highest[0], recomputing[0])
                    meter.restart_peak_at_next_op()

            def after() -> None:
                if frame is None:
                    return
                new = [k for k in frame.recomputed if k not in ids]
                if new:  # a pass that used no saved tensor recomputes nothing
                    passes.append((recomputing[0], meter.since()[0], _kept_bytes(frame.recomputed[new[-1]], own)))
                    recomputes.append(new[-1])

            forward, own_forward = unit.module.forward, unit.module.__dict__.get("forward")
            unit.module.forward = recompute  # type: ignore[method-assign]
            try:
                with around_autograd_passes(before, after):
                    stage_backward_weight(parameters, groups)
            finally:
                if own_forward is None:
                    del unit.module.forward
                else:
                    unit.module.forward = own_forward  # type: ignore[method-assign]
            left = meter.since()[1]  # held: every recompute's keeps still there
            if frame is not None and recomputes:  # the last recompute still holds the block's saved input?
                inputs = {a.untyped_storage().data_ptr() for a in received}
                input_kept = any(t.untyped_storage().data_ptr() in inputs
                                 for t in list(frame.recomputed[recomputes[-1]].values()))
            del groups, root
            made = sum(p.grad.untyped_storage().nbytes() for p in parameters if p.grad is not None)
            peak = max(highest[0], meter.since()[0])
    finally:
        unit.zero_grad(set_to_none=True)
        for a, grad in zip(received, kept_grads):
            a.grad = grad
    if frame is None or not passes:
        return max(0, peak - made), None, 0, 0, True
    # what the last pass's recompute keeps once done: what each recompute keeps of the block by then; and what the W
    # let go of that was there before it (the I's gradients for it, what the I's recompute kept for the W's walks)
    kept = passes[-1][2]
    return (max(0, peak - made), tuple((max(0, r - made), max(0, w - made), k) for r, w, k in passes), kept,
            max(0, len(passes) * kept + made - left), input_kept)


def _kept_bytes(recomputed: Any, own: set[int]) -> int:
    """What one pass's recompute keeps: its tensors' storages, each once, but those held anyway (parameters,
    inputs)."""
    seen = set(own)
    total = 0
    for tensor in list(recomputed.values()):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


def _split_extras(
    plain: Sequence[tuple[float, float]], split: Sequence[tuple[float, float]], input_share: float
) -> tuple[float, float]:
    """What torch's split backward costs beyond a whole one, for I and for W: the block's split I and W against the
    whole backward of the same block as a stage (`plain`'s), apportioned by the input gradients' share of it measured
    in place. Each walks the autograd graph again in Python (the I for the W's parameter groups, the W once per
    group): a GPT's two blocks at micro-batch 8 took 1.64 ms for I and 1.29 for W where a whole backward's parts were
    1.29 and 0.66 (so traced in its InterleavedZeroBubble trials, bench/action_trace.py). 0 where not measured."""
    measured = [pair for pair in split if pair != (0.0, 0.0)]
    if not measured or not plain:
        return 0.0, 0.0
    whole = statistics.median(b for _, b in plain)
    split_input = statistics.median(i for i, _ in measured)
    split_weight = statistics.median(w for _, w in measured)
    return max(0.0, split_input - whole * input_share), max(0.0, split_weight - whole * (1.0 - input_share))


def _stage_ratio_pairs(result: _SizeResult) -> tuple[list[tuple[float, float]], list[tuple[float, float]]]:
    """The (plain, checkpointed) times the checkpointing ratios come from: the block's window as one stage where it
    was timed with others, else the block alone as a stage."""
    if result.stage_plain[0] > 0 and result.stage_checkpointed[0] > 0:
        return [result.stage_plain], [result.stage_checkpointed]
    return [result.plain], [result.checkpointed]


def _checkpoint_ratios(
    plain: Sequence[tuple[float, float]], checkpointed: Sequence[tuple[float, float]]
) -> tuple[float, float]:
    """From (forward, backward) times of a stage plain and checkpointed: checkpointed forward / plain forward, and
    (checkpointed backward - plain backward) / plain forward.

    Recomputing is not just one more forward: the checkpointed forward still pays bookkeeping and the backward
    rebuilds every activation afresh (measured 1.1-1.9x a forward on the recipes, on CPU)."""
    if not plain or not checkpointed:
        return 1.0, 1.0
    forward = statistics.median(f for f, _ in plain)
    if forward <= 0:
        return 1.0, 1.0
    backward = statistics.median(b for _, b in plain)
    ratio = statistics.median(f for f, _ in checkpointed) / forward
    extra = (statistics.median(b for _, b in checkpointed) - backward) / forward
    return ratio, max(0.0, extra)


def _sample_chain(chain: Sequence[_SizeSamples], clock: _Clock) -> None:
    """One round of a window at one size: an untimed pass through its blocks (the previous round ran another
    size), a timed full pass and a timed input-grad pass, each block's times taken in place; then each block plain
    on its own, and the blocks as one stage plain and checkpointed once (a lone block: itself checkpointed)."""
    first, last = chain[0], chain[-1]
    units = [samples.unit for samples in chain]
    _chain_pass(units, (first.args, first.side), last.loss, clock, full=True)
    for full in (True, False):
        forward, loss_forward, backward, loss_backward = _chain_pass(
            units, (first.args if full else first.partial_args, first.side), last.loss, clock, full=full)
        for samples, f, b in zip(chain, forward, backward):
            samples.forward.append(f)
            (samples.full if full else samples.partial).append(b)
        last.loss_forward.append(loss_forward)
        if full:
            last.loss_backward.append(loss_backward)
    for samples in chain:
        samples.sample_checkpoint(alone=len(chain) == 1)
    if len(chain) > 1:
        _sample_stage_checkpoint(chain, clock)


def _sample_stage_checkpoint(chain: Sequence[_SizeSamples], clock: _Clock) -> None:
    """The window's blocks as one stage, plain and checkpointed once as the runtime checkpoints a stage: what the
    checkpointing ratios come from (_stage_ratio_pairs). One block checkpointed alone says little of a stage: on
    the 13-layer MLP of bench/models/mlp13.py (micro-batch 16, CPU) one block's ratios put a stage's checkpointing
    cost at 3.5 ms, the stage paid 1.6; on recipes/gpt.py one block said 1.8 ms where the stage paid 7.5
    (bench/results/checkpoint_cost_cuda.md)."""
    first, last = chain[0], chain[-1]
    units = [samples.unit for samples in chain]
    inputs = (first.args, first.side)
    quick = all(samples.forward for samples in chain) and sum(
        min(samples.forward) for samples in chain) < QUICK_BLOCK_MS
    for _ in range(QUICK_BLOCK_SAMPLES if quick else 1):
        plain = _stage_pass(units, inputs, last.loss, clock, checkpointed=False)
        checkpointed = _stage_pass(units, inputs, last.loss, clock, checkpointed=True)
        for samples in chain:
            samples.stage_plain.append(plain)
            samples.stage_checkpointed.append(checkpointed)
    for unit in units:
        unit.zero_grad(set_to_none=True)


def _stage_pass(
    units: Sequence[_Unit],
    inputs: tuple[tuple[torch.Tensor, ...], dict[str, Any]],
    loss_fn: Callable[[Any], torch.Tensor],
    clock: _Clock,
    *,
    checkpointed: bool,
) -> tuple[float, float]:
    """Forward and backward times of consecutive blocks (one, or a window) as one stage, each block's outputs the
    next's inputs, plain or checkpointed once for all of them as the runtime checkpoints a stage (each block's
    autocast entered inside, so the recompute runs in the forward's precision); the loss (or the stand-in for the
    rest of the model) outside."""

    def stage(*args: torch.Tensor, **side: Any) -> Any:
        output: Any = None
        for unit in units:
            output = unit(args, side)
            args = tuple(_flat(output))
        return output

    args, side = inputs
    start = clock.mark()
    output = checkpoint(stage, *args, use_reentrant=False, **side) if checkpointed else stage(*args, **side)
    middle = clock.mark()
    loss = loss_fn(output)
    if loss.requires_grad:
        loss.backward()
    end = clock.mark()
    clock.sync()
    return clock.ms(start, middle), clock.ms(middle, end)


def _chain_pass(
    units: Sequence[_Unit],
    inputs: tuple[tuple[torch.Tensor, ...], dict[str, Any]],
    loss_fn: Callable[[Any], torch.Tensor],
    clock: _Clock,
    *,
    full: bool,
) -> tuple[list[float], float, list[float], float]:
    """One forward and one backward through consecutive blocks (each a one-block stage, the one's outputs the
    next's inputs), with timestamps at each block's boundaries: (forward per block, loss forward, backward per
    block, loss backward) ms.

    Forward: each block's pre-hook and hook (what a stage computes once for all its layers, a Hugging Face layer's
    masks and rotary embeddings, is computed before the pre-hook: it is not the layer's). Backward: a hook on a
    block's output fires when backward enters the block; the block's backward ends when the previous block's output
    hook fires (the first block's, when backward returns).

        forward   |pre0 ... post0|pre1 ... post1| ... |postN-1| loss |
        backward  |bwd start| loss |gradN-1| block N-1 |gradN-2| ... |grad0| block 0 |end|

    full=False asks torch.autograd.grad for the gradients of the first block's float inputs (a stage's received
    activations), or, without any, of the first block output that has one, so the backward computes input
    gradients and skips weight gradients; the blocks before that output (an embedding of token ids) get 0."""
    n = len(units)
    marks: list[dict[str, Any]] = [{} for _ in range(n)]
    args, side = inputs
    handles = []
    for unit, block_marks in zip(units, marks):
        handles += [
            unit.block.register_forward_pre_hook(_prepare_context, with_kwargs=True),
            unit.block.register_forward_pre_hook(lambda module, a, into=block_marks: into.__setitem__(
                "pre", clock.mark())),
            unit.block.register_forward_hook(_post_hook(block_marks, clock)),
        ]
    try:
        outputs: list[list[torch.Tensor]] = []
        x = args
        for unit in units:
            output = unit(x, side)
            outputs.append(_flat(output))
            x = tuple(outputs[-1])
        loss_start = clock.mark()
        loss = loss_fn(output)
        loss_end = clock.mark()
        if units[-1].last and not loss.requires_grad:
            raise ModelFileError(
                "the loss does not depend on any parameter (requires_grad is False); build_model() must return "
                "layers with trainable parameters"
            )
        first_timed = 0
        backward_start = clock.mark()
        if loss.requires_grad:
            if full:
                loss.backward()
            else:
                wanted = [a for a in args if a.requires_grad]
                if not wanted:
                    first_timed = next((k + 1 for k, out in enumerate(outputs) if any(t.requires_grad for t in out)),
                                       n)
                    wanted = [t for t in outputs[first_timed - 1] if t.requires_grad] if first_timed <= n - 1 else []
                if wanted:
                    torch.autograd.grad(loss, wanted)
        backward_end = clock.mark()
    finally:
        for handle in handles:
            handle.remove()
    clock.sync()
    backward_ms = []
    for k in range(n):
        grad = marks[k].get("grad")
        end = marks[k - 1].get("grad") if k > first_timed else None
        if k < first_timed or grad is None:
            backward_ms.append(0.0)
        else:
            backward_ms.append(clock.ms(grad, end if end is not None else backward_end))
    last_grad = marks[-1].get("grad")
    loss_backward_ms = clock.ms(backward_start, last_grad) if last_grad is not None else 0.0
    return ([clock.ms(m["pre"], m["post"]) for m in marks], clock.ms(loss_start, loss_end), backward_ms,
            loss_backward_ms)


def _prepare_context(module: nn.Module, args: Any, kwargs: dict[str, Any]) -> None:
    """A Hugging Face layer reads what its stage computes once for all its layers (masks, rotary cos/sin): compute
    it before the layer's own timing starts."""
    context = kwargs.get("context")
    if isinstance(module, HFLayer) and context is not None and args:
        context.layer_call(module.index, args[0])


def _post_hook(marks: dict[str, Any], clock: _Clock) -> Any:
    def on_grad(_: torch.Tensor) -> None:
        marks.setdefault("grad", clock.mark())

    def hook(module: nn.Module, args: Any, output: Any) -> None:
        marks["post"] = clock.mark()
        # Several tensors may leave a block: each needing a gradient may be the first to get it.
        for t in _flat(output):
            if t.requires_grad:
                t.register_hook(on_grad)

    return hook


def _saved_bytes(
    unit: _Unit, inputs: tuple[tuple[torch.Tensor, ...], dict[str, Any]], loss_fn: Callable[[Any], torch.Tensor]
) -> tuple[int, int, int, int, int, int, Any]:
    """Bytes autograd saves for backward in the block (a storage counted once; parameters and views of them are
    skipped) and in the loss after it; the block's output bytes; of the block's saved bytes, those of its input
    storages and of its output storages; the bytes of the parameter copies autocast made that were saved (not in
    the block's saved bytes); and the output."""
    parameters = unit.parameters()
    parameter_storages = {p.untyped_storage().data_ptr() for p in parameters}
    parameter_ids = {id(p) for p in parameters}
    seen: dict[int, int] = {}
    saved = [0, 0, 0]  # the block, the loss, autocast's parameter copies
    current = [0]

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        ptr = storage.data_ptr()
        if ptr and ptr not in parameter_storages and ptr not in seen:
            seen[ptr] = 2 if _is_parameter_cast(tensor, parameter_ids) else current[0]
            saved[seen[ptr]] += storage.nbytes()
        # An alias without the graph: keeping the tensor itself would tie a saved output and the node saving it in
        # a cycle through C++ that Python's collector cannot see, and the pass's graph would outlive the profile
        # (3.7 GB of a 170 M-parameter GPT's on an H200). This pass is never run backward.
        return tensor.detach()

    args, side = inputs
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        output = unit(args, side)
        current[0] = 1
        loss = loss_fn(output)
    del loss

    def own(tensors: list[torch.Tensor]) -> int:
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
        return sum(nbytes for ptr, nbytes in storages.items() if seen.get(ptr) == 0)

    return saved[0], saved[1], _nbytes(output), own(list(args)), own(_flat(output)), saved[2], output


def _loss_bytes(output: Any, loss_fn: Callable[[Any], torch.Tensor], *, cast: bool) -> tuple[int, int]:
    """The last block's loss on its own output: (the bytes of the loss's input as the last stage keeps it, float32
    where `cast`, bf16's runtime.loss_input; the peak the loss's backward holds over what was alive before it, that
    input and what the loss saved included), from the allocator on CUDA, the live tensor-storage tracker on CPU.

    Not twice the output, as it was modelled: in bf16 the loss computes on the float32 copy, and cross-entropy's
    gradients of its log-probabilities and of that copy are float32 (a 32 k-vocabulary GPT's bf16 peak on an H200
    was 2.1 GB over the prediction at micro-batch 32, bench/results/cuda_loss_bytes.md). `loss_fn` casts (the
    profile's _loss): the backward runs through the cast to a leaf of the output's dtype, as the stage's does."""
    leaves = [t.detach().requires_grad_(True) if t.is_floating_point() else t.detach() for t in _flat(output)]
    if not any(t.requires_grad for t in leaves):
        return 0, 0
    it = iter(leaves)
    given = _rebuild(output, it)
    # what loss_input makes of it, without making it: floating tensors as float32
    held = sum(t.numel() * 4 if cast and t.is_floating_point() else _nbytes(t) for t in leaves)
    with _Meter(leaves[0].device, leaves) as meter:
        loss = loss_fn(given)
        if not loss.requires_grad:
            return held, 0
        meter.mark()
        loss.backward()
        peak, _ = meter.since()
    return held, max(0, peak)


def _rebuild(value: Any, tensors: Iterator[torch.Tensor]) -> Any:
    """`value` with its tensors replaced, in _flat's order, by the next of `tensors`."""
    if isinstance(value, torch.Tensor):
        return next(tensors)
    if isinstance(value, (tuple, list)):
        return type(value)(_rebuild(v, tensors) for v in value)
    return value


def _backward_bytes(unit: _Unit, inputs: tuple[tuple[torch.Tensor, ...], dict[str, Any]]) -> BackwardBytes:
    """What a backward of the block holds on top of what was alive before it (costs.BackwardBytes), each figure
    with the output's gradient made inside and handed in: a whole backward with no .grad and with .grad there, and
    torch's split backward's I (at most, and what it leaves for the W). The block's .grad is cleared and its inputs'
    .grad put back as they were."""
    args, side = inputs
    floats = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
    kept = [a.grad for a in floats]
    figures: dict[str, list[int]] = {"first": [], "later": [], "input_peak": [], "input_kept": []}
    for handed in (False, True):
        unit.zero_grad(set_to_none=True)
        for name in ("first", "later", "input"):
            for a in floats:
                a.grad = None
            peak, left = _backward_peak(unit, args, side, handed=handed, split=name == "input")
            if name == "input":
                figures["input_peak"].append(peak)
                figures["input_kept"].append(left)
            else:
                figures[name].append(peak)
    unit.zero_grad(set_to_none=True)
    for a, grad in zip(floats, kept):
        a.grad = grad
    return BackwardBytes(**{name: (made, handed) for name, (made, handed) in figures.items()})


class _Meter:
    """Bytes allocated past a mark, from the allocator on CUDA, the live tensor-storage tracker on CPU (entered with
    the meter; `alive`: the tensors alive at entry that an op may hand back, LiveTensorBytes)."""

    def __init__(self, device: torch.device, alive: Sequence[torch.Tensor]) -> None:
        from autotune.trial.memory import LiveTensorBytes

        self.device, self.cuda = device, device.type == "cuda"
        self.tracker = None if self.cuda else LiveTensorBytes(alive=alive)
        self.before = 0

    def __enter__(self) -> _Meter:
        if self.tracker is not None:
            self.tracker.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.tracker is not None:
            self.tracker.__exit__(*exc)

    def mark(self) -> None:
        """From here: what is alive now is the base, and the peak starts again."""
        if self.tracker is None:
            torch.cuda.synchronize(self.device)
            self.before = torch.cuda.memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            self.before = self.tracker.peak_bytes = self.tracker.live_bytes

    def restart_peak(self) -> int:
        """The peak so far over the mark; from here the peak starts again from what is alive now."""
        peak, _ = self.since()
        if self.tracker is None:
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            self.tracker.peak_bytes = self.tracker.live_bytes
        return peak

    def restart_peak_at_next_op(self) -> None:
        """On CPU: the peak starts again at the next op, from what is alive then (what is let go of before it is not
        counted); on CUDA nothing (the peak runs on from what is alive now)."""
        if self.tracker is not None:
            self.tracker.restart_peak_at_next_op = True

    def since(self) -> tuple[int, int]:
        """(the peak, what is alive now), each over the mark."""
        if self.tracker is None:
            torch.cuda.synchronize(self.device)
            peak, now = torch.cuda.max_memory_allocated(self.device), torch.cuda.memory_allocated(self.device)
        else:
            peak, now = self.tracker.peak_bytes, self.tracker.live_bytes
        return peak - self.before, now - self.before


def _backward_peak(
    unit: _Unit, args: tuple[torch.Tensor, ...], side: dict[str, Any], *, handed: bool, split: bool
) -> tuple[int, int]:
    """One forward and backward of the block: (the backward's peak over what was alive before it, what it leaves
    beside its inputs' gradients), from the allocator on CUDA, the live tensor-storage tracker on CPU. handed: the
    output's gradient is made first and handed in, held throughout (torch's stage hands in its receive buffer);
    else a product with a constant of the output's shape makes it inside the backward, counted, and lets go of it
    once used (as a later layer of a stage, or the loss, makes it). split: torch's I (stage_backward_input), which
    keeps the graph and the gradients its W needs; else a whole backward."""
    parameters = unit.parameters()
    device = next((p.device for p in parameters), torch.device("cpu"))
    touched = [*parameters, *(p.grad for p in parameters if p.grad is not None), *unit.module.buffers(),
               *_flat(args), *_flat(list(side.values()))]
    with _Meter(device, touched) as meter:
        output = unit(args, side)
        outputs = [t for t in _flat(output) if t.requires_grad]
        if not outputs:
            return 0, 0
        if split:  # torch's I detaches the outputs in place, which a view cannot be
            outputs = [t.clone() if view_base(t) is not None else t for t in outputs]
        constants = [torch.ones_like(t) for t in outputs]
        roots = outputs if handed else [sum((t * c).sum() for t, c in zip(outputs, constants))]
        grads = constants if handed else None
        meter.mark()
        if split:
            received = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
            _, groups = stage_backward_input(roots, grads, received, parameters)
        else:
            torch.autograd.backward(roots, grads)
        inputs_grads = sum(a.grad.untyped_storage().nbytes() for a in _flat(args) if a.grad is not None)
        peak, after = meter.since()
        if split:
            del groups  # and with them the graph the W would have used
    return max(0, peak), max(0, after - inputs_grads)


_VIEW_NODES = frozenset({
    "TBackward0", "TransposeBackward0", "PermuteBackward0", "ViewBackward0", "UnsafeViewBackward0",
    "ReshapeAliasBackward0", "ExpandBackward0", "UnsqueezeBackward0", "SqueezeBackward0", "AliasBackward0",
})


def _is_parameter_cast(tensor: torch.Tensor, parameter_ids: set[int]) -> bool:
    """Whether the tensor is (a view of) a dtype copy of one of the parameters: what autocast saves of a weight
    (Linear: its bfloat16 copy, transposed). Followed through the autograd graph: views, then the copy (ToCopy),
    then the parameter's AccumulateGrad."""
    node = tensor.grad_fn
    for _ in range(len(_VIEW_NODES) + 1):
        if node is None:
            return False
        name = node.name()
        if name.startswith("ToCopyBackward"):
            source = node.next_functions[0][0] if node.next_functions else None
            return id(getattr(source, "variable", None)) in parameter_ids
        if name not in _VIEW_NODES or not node.next_functions:
            return False
        node = node.next_functions[0][0]
    return False


OPTIMIZER_GRADIENT_STD = 1e-3
"""The spread of the stand-in gradient a parameter gets where the block's backward gave it none (any non-zero size
times the same)."""


def _profile_optimizer(
    spec: ModelSpec,
    params: list[nn.Parameter],
    unit: _Unit,
    clock: _Clock,
    repeats: int,
    *,
    limit: int | None,
    gradients: Callable[[], None] | None = None,
) -> tuple[float, int, int, bool]:
    """Median time of one optimizer step over the parameters, the state it keeps, and the most bytes a step
    allocates on top (AdamW's foreach temporaries: 0.2-1x the parameters on the recipes). With `limit`, the
    parameters, their gradients and the state must fit under it (live-tensor tracker).

    The step is timed on the gradients `gradients()` leaves (a backward of the block), not on zeros: where Adam's
    second moment is zero its sqrt takes a slow path on the CPU, so a step over zero gradients took twice a real
    one's time (AdamW over tail_heavy7's 1.3M parameters, one thread: 3.6 ms against 1.8, and 1.9-2.1 ms in its
    trials' own steps, traced by bench/action_trace.py), while an embedding's untouched rows do stay zero in a
    trial. A parameter the backward left without a gradient gets OPTIMIZER_GRADIENT_STD noise."""
    if not params:
        return 0.0, 0, 0, False
    if gradients is not None:
        gradients()
    generator = torch.Generator(device=params[0].device).manual_seed(SEED)
    for p in params:
        if p.grad is None:
            p.grad = torch.empty_like(p).normal_(0.0, OPTIMIZER_GRADIENT_STD, generator=generator)
    optimizer = build_optimizer(spec, params)
    foreach = optimizer.defaults.get("foreach")
    grouped = bool(optimizer.defaults.get("fused")) or bool(foreach) or (foreach is None
                                                                          and params[0].device.type == "cuda")
    if limit is not None:
        from autotune.trial.memory import LiveTensorBytes

        with LiveTensorBytes(limit_bytes=limit):
            optimizer.step()  # creates the state
    else:
        optimizer.step()
    step_ms = _median_step_ms(optimizer, clock, repeats)
    state = sum(_nbytes(v) for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor))
    transient = _step_transient_bytes(optimizer, params[0].device)
    unit.zero_grad(set_to_none=True)
    for p in params:
        p.grad = None
    return step_ms, state, transient, grouped


def _optimizer_call_ms(spec: ModelSpec, device: torch.device, clock: _Clock, repeats: int) -> float:
    """Median time of one optimizer step over a one-element parameter: what a step costs whatever it updates
    (Profile.optimizer_call_ms; on CUDA a foreach step's kernel launches). 0 when the model file's build_optimizer
    cannot be built on such a parameter (one written for the model's own, grouping them by name)."""
    param = nn.Parameter(torch.zeros(1, device=device))
    param.grad = torch.zeros_like(param)
    try:
        optimizer = build_optimizer(spec, [param])
        optimizer.step()
    except Exception:  # noqa: BLE001 - the user's build_optimizer may reject it any way: then no fixed term
        logger.debug("no optimizer call cost: build_optimizer refused a one-element parameter", exc_info=True)
        return 0.0
    return _median_step_ms(optimizer, clock, max(repeats, 5))


HOST_CALL_REPEATS = 51
"""Steps timed for Profile.host_call_ms (about 2-4 ms in all): a median of many, since one step is tens of us."""


def host_call_ms(clock: _Clock | None = None) -> float:
    """This host's Python and dispatch speed on the CPU at this moment: the median time of a plain
    torch.optim.AdamW step over a one-element parameter, the same whatever the model and its optimizer (one of
    HostProbe's samples)."""
    return HostProbe(clock).sample()


class HostProbe:
    """Profile.host_call_ms: host_call_ms's probe taken at several moments of a profile (before the walk, after
    each block, after the optimizer and idle probes), the lowest of them kept.

    One probe is a few milliseconds, and this host's speed goes through phases of seconds: on a 2-core EPYC VM,
    probes back to back for 8 s in each of six processes read 53-55 us at their lowest, 55-58 at their median in
    five and 88.5 in the sixth, and up to 137-162 in all (a pure-Python loop and a small MLP's step slower alike
    for a while); the first probe of a process read 59-82 us. A single probe that fell in a slow phase put x1.8 on
    the per-action costs of every prediction: the 7-pass calibration of 2026-12-07 12:36 took the tail-heavy MLP's
    probe at 99.5 us (two of its three profiles read 114 and 99.5, the third 57.1), over-predicted its every
    configuration (+10 to +49 %, MAPE 26.6 %) and its trials agreed with the third (12.1 % predicted from 57.1).
    The lowest is the host's speed outside those phases (bench/results/calibration_host_probe.md). It does not
    follow a period of hours where trials run slower than profiles: in the next calibration every probe read
    52-56 us and every model's trials ran 6-18 % slower than predicted (calibration_epyc_probe.md)."""

    def __init__(self, clock: _Clock | None = None) -> None:
        self.clock = clock or _CpuClock()
        param = nn.Parameter(torch.zeros(1))
        param.grad = torch.zeros_like(param)
        self.optimizer = torch.optim.AdamW([param])
        self.optimizer.step()
        self.samples: list[float] = []

    def sample(self) -> float:
        """One probe now: the median of HOST_CALL_REPEATS steps (ms)."""
        ms = _median_step_ms(self.optimizer, self.clock, HOST_CALL_REPEATS)
        self.samples.append(ms)
        return ms

    def between_blocks(self, progress: ProgressFn | None) -> ProgressFn:
        """Probes now (before the walk), and a progress function for the walk that probes after each block, then
        tells `progress`."""
        self.sample()

        def told(completed: int, total: int, description: str) -> None:
            self.sample()
            if progress is not None:
                progress(completed, total, description)
        return told

    def lowest(self) -> float:
        """The lowest probe taken."""
        return min(self.samples)


IDLE_GAPS_MS = (0.5, 2.0, 5.0, 20.0)
"""The idle gaps idle_resume_probe sleeps before its workload."""
IDLE_PROBE_ROUNDS = 10
"""Rounds of idle_resume_probe, each one back-to-back pair and one run after each gap (about 0.4 s in all)."""


@dataclass(frozen=True)
class IdleResume:
    """What idle_resume_probe measured (Profile.idle_resume_ms, Profile.idle_resume_window_ms)."""

    penalties: tuple[tuple[float, float], ...]
    """(gap ms, ms the workload took beyond back to back after sleeping that long), the gaps rising."""
    window_ms: float
    """The workload's own time back to back."""


def idle_resume_probe(rounds: int = IDLE_PROBE_ROUNDS) -> IdleResume:
    """How much slower torch's compute runs on this host right after its thread slept (Profile.idle_resume_ms): a
    small MLP's forward and backward (four 256-wide layers, batch 64: a millisecond or two, one thread) timed back
    to back and after sleeping each of IDLE_GAPS_MS, the gaps shuffled within each round so that the host's drift
    falls on all of them alike; per gap the median over the rounds less the back-to-back median.

    A pipeline's rank sleeps in its waits for the other ranks, and its next action pays for it: on a 2-core Xeon
    VM the same stage's forward and backward took 3.0 ms back to back and 4.1 ms after a 10 ms sleep (x1.26-1.30
    paired, 20 tiny linear forwards x1.75, a pure-Python loop of the same length x1.00-1.03: the caches and the
    host's scheduling, not the clock rate), and inside real trials the stage modules' compute over the profile's
    rose with the gap before the action (bench/action_trace.py's "after idle" table: 1F1B m8's last stage 1.34 x
    within 0.5 ms of its previous action, 1.94 x after over 5 ms)."""
    layers = [nn.Linear(256, 256) for _ in range(4)]
    model = nn.Sequential(*[m for layer in layers for m in (layer, nn.GELU())])
    inputs = torch.randn(64, 256)

    def work() -> None:
        model(inputs).sum().backward()

    def timed() -> float:
        start = time.perf_counter()
        work()
        return (time.perf_counter() - start) * 1e3

    for _ in range(5):
        work()
    gaps = [0.0, *IDLE_GAPS_MS]
    times: dict[float, list[float]] = {g: [] for g in gaps}
    order = list(gaps)
    shuffle = random.Random(0).shuffle
    for _ in range(rounds):
        shuffle(order)
        for gap in order:
            if gap:
                time.sleep(gap / 1e3)
            else:
                work()
            times[gap].append(timed())
    base = statistics.median(times[0.0])
    penalties = tuple((g, round(max(0.0, statistics.median(times[g]) - base), 4)) for g in IDLE_GAPS_MS)
    return IdleResume(penalties=penalties, window_ms=round(base, 4))


def _median_step_ms(optimizer: torch.optim.Optimizer, clock: _Clock, repeats: int) -> float:
    """Median time of `repeats` optimizer steps, each one's marks bracketing its own work and synchronised before the
    next, so a slow step (an allocation, a late kernel) is not what is reported."""
    times = []
    for _ in range(repeats):
        start = clock.mark()
        optimizer.step()
        end = clock.mark()
        clock.sync()
        times.append(clock.ms(start, end))
    return statistics.median(times)


def _step_transient_bytes(optimizer: torch.optim.Optimizer, device: torch.device) -> int:
    """Peak bytes of one optimizer step over what was live before it: the allocator's peak on CUDA, the live
    tensor-storage tracker (as trials use) on CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        optimizer.step()
        torch.cuda.synchronize(device)
        return max(0, torch.cuda.max_memory_allocated(device) - before)
    from autotune.trial.memory import LiveTensorBytes

    with LiveTensorBytes() as tracker:
        before = tracker.live_bytes
        optimizer.step()
    return max(0, tracker.peak_bytes - before)


def _wire_nbytes(specs: Sequence[TensorSpec]) -> int:
    """Bytes of a block's outputs on a bfloat16 wire (runtime.StageBoundary casts floating outputs to it)."""
    return sum(math.prod(shape) * (2 if dtype.is_floating_point else dtype.itemsize) for shape, dtype in specs)


def _nbytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (tuple, list)):
        return sum(_nbytes(v) for v in value)
    return 0
