"""Measure a model's per-layer costs on one device (autotune.costs.Profile): every layer timed in place with hooks,
saved bytes counted with saved-tensor hooks, the optimizer step timed, at several micro-batch sizes."""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from autotune.costs import LayerProfile, Profile
from autotune.devices import keep_freed_cpu_memory
from autotune.errors import ModelFileError, UsageError
from autotune.model_file import ModelSpec, build_blocks, build_optimizer, make_batch, map_inputs
from autotune.trial.memory import is_out_of_memory

logger = logging.getLogger(__name__)

MAX_DEFAULT_SIZES = 6


class ProgressFn(Protocol):
    """Told after each profiled micro-batch size: how many of how many are done, and which size."""

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
) -> Profile:
    """Measure every layer in place (hooks inside one pass of the whole model) at each micro-batch size.

    Per repeat: a forward and a full backward, then a forward and a backward that asks only for the gradient of the
    first float activation (autograd then skips the weight-grad work); weight-grad time is the difference. One
    untimed pass with saved_tensors_hooks counts saved bytes. On CPU torch runs one thread (one thread per rank is
    the stand-in); the caller's thread count is restored afterwards."""
    if repeats < 1:
        raise UsageError(f"repeats must be at least 1, got {repeats}")
    sizes = sorted(set(micro_batch_sizes)) if micro_batch_sizes else default_micro_batch_sizes(batch_size)
    if not micro_batch_sizes and spec.has_batchnorm and len(sizes) > 1:
        sizes = [m for m in sizes if m > 1]  # BatchNorm cannot train on one sample
    if sizes[0] < 1:
        raise UsageError(f"micro-batch sizes must be at least 1, got {sizes[0]}; pass --micro-batch-size 1 or more")
    if device not in ("cpu", "cuda") and not device.startswith("cuda:"):
        raise UsageError(f"cannot profile on device {device!r}; use cpu or cuda")
    threads = torch.get_num_threads()
    if device == "cpu":
        torch.set_num_threads(1)
        keep_freed_cpu_memory()  # as the ranks do: without it, times swing with the allocator's history
    try:
        layers = _Whole(spec, device)
        clock: _Clock = _CudaClock() if device.startswith("cuda") else _CpuClock()
        total = len(sizes) + repeats
        samples = []
        for done, m in enumerate(sizes):
            inputs, targets = make_batch(spec, m)
            try:
                samples.append(_SizeSamples(spec, layers, map_inputs(inputs, lambda t: t.to(device)),
                                            targets.to(device), clock))
            except (ModelFileError, UsageError):
                raise
            except Exception as exc:  # the user's model can raise anything
                if is_out_of_memory(exc):
                    raise
                text = " ".join(f"{type(exc).__name__}: {exc}".split())[:300]
                raise ModelFileError(
                    f"{spec.path}: a training step at micro-batch size {m} failed ({text}); profile sizes the model "
                    f"can run, e.g. --micro-batch-size {','.join(str(x) for x in sizes if x != m) or 'N'}"
                ) from exc
            if progress is not None:
                progress(done + 1, total, f"warm-up at micro-batch size {m}")
        # Round-robin over the sizes, so that a stretch of interference on a shared machine slows every size a
        # little rather than one size a lot (that would bend the cost curve in M, and with it the choice of B/M).
        checkpoint_rounds = max(2, (repeats + 1) // 2)
        for round_ in range(repeats):
            for size in samples:
                size.sample(with_checkpoint=round_ < checkpoint_rounds)
            if progress is not None:
                progress(len(sizes) + round_ + 1, total, f"timing round {round_ + 1} of {repeats}")
        measured = [size.result() for size in samples]
        optimizer_ms, state_bytes, optimizer_peak = _profile_optimizer(spec, layers, clock, repeats)
    finally:
        torch.set_num_threads(threads)
    n = len(layers)
    return Profile(
        micro_batch_sizes=tuple(sizes),
        layers=tuple(
            LayerProfile(
                name=spec.layer_names[i],
                parameter_bytes=spec.parameter_bytes[i],
                forward_ms=tuple(s.forward_ms[i] for s in measured),
                backward_input_ms=tuple(s.backward_input_ms[i] for s in measured),
                backward_weight_ms=tuple(s.backward_weight_ms[i] for s in measured),
                saved_bytes=tuple(s.saved_bytes[i] for s in measured),
                output_bytes=tuple(s.output_bytes[i] for s in measured),
                parameter_groups=sum(1 for module in layer.modules() if next(module.parameters(recurse=False), None)
                                     is not None),
            )
            for i, layer in zip(range(n), layers.blocks)
        ),
        input_bytes=tuple(s.input_bytes for s in measured),
        loss_forward_ms=tuple(s.loss_forward_ms for s in measured),
        loss_backward_ms=tuple(s.loss_backward_ms for s in measured),
        loss_saved_bytes=tuple(s.loss_saved_bytes for s in measured),
        checkpoint_forward_ratio=tuple(s.checkpoint_forward_ratio for s in measured),
        checkpoint_recompute_ratio=tuple(s.checkpoint_recompute_ratio for s in measured),
        optimizer_step_ms=optimizer_ms,
        optimizer_state_bytes=state_bytes,
        optimizer_peak_bytes=optimizer_peak,
        device="cuda" if device.startswith("cuda") else "cpu",
        model=str(spec.path),
        batch_size=batch_size,
        repeats=repeats,
        torch_version=torch.__version__,
        shared_parameters=tuple((p.blocks, p.nbytes) for p in spec.shared),
    )


class _Whole:
    """The model as one stage over all its blocks (autotune.models): what the hooks time, block by block."""

    def __init__(self, spec: ModelSpec, device: str) -> None:
        block_model = build_blocks(spec)
        self.blocks = list(block_model.blocks)
        self.split_inputs = block_model.split_inputs
        self.module = block_model.stage(0, block_model.n_blocks).to(device)
        self.module.train()

    def __len__(self) -> int:
        return len(self.blocks)

    def __call__(self, args: tuple[torch.Tensor, ...], side: dict[str, Any]) -> Any:
        return self.module(*args, **side)

    def parameters(self) -> list[nn.Parameter]:
        return list(self.module.parameters())

    def zero_grad(self, *, set_to_none: bool = True) -> None:
        self.module.zero_grad(set_to_none=set_to_none)


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


@dataclass(frozen=True, kw_only=True)
class _SizeResult:
    forward_ms: list[float]
    backward_input_ms: list[float]
    backward_weight_ms: list[float]
    saved_bytes: list[int]
    output_bytes: list[int]
    input_bytes: int
    loss_forward_ms: float
    loss_backward_ms: float
    loss_saved_bytes: int
    checkpoint_forward_ratio: float
    checkpoint_recompute_ratio: float


class _SizeSamples:
    """Everything timed at one micro-batch size, gathered over the rounds of profile_model."""

    def __init__(
        self, spec: ModelSpec, layers: _Whole, inputs: Any, targets: torch.Tensor, clock: _Clock
    ) -> None:
        self.spec, self.layers, self.targets, self.clock = spec, layers, targets, clock
        self.inputs = layers.split_inputs(inputs)
        inputs = self.inputs
        self.saved, self.loss_saved, self.output_bytes = _saved_bytes(spec, layers, inputs, targets)
        self.forward: list[list[float]] = []
        self.full: list[list[float]] = []
        self.partial: list[list[float]] = []
        self.loss_forward: list[float] = []
        self.loss_backward: list[float] = []
        self.plain: list[tuple[float, float]] = []
        self.checkpointed: list[tuple[float, float]] = []
        self._pass(full=True)  # warm-up (allocator, lazy init)
        self._pass(full=False)
        _whole_pass(spec, layers, inputs, targets, clock, checkpointed=True)

    def _pass(self, *, full: bool) -> tuple[list[float], float, list[float], float]:
        return _timed_pass(self.spec, self.layers, self.inputs, self.targets, self.clock, full=full)

    def sample(self, *, with_checkpoint: bool) -> None:
        """One round: a full and an input-grad-only pass (with an untimed full pass first, as the previous round
        ran another size); with_checkpoint: also the model plain and checkpointed as one unit."""
        self._pass(full=True)
        for is_full, into in ((True, self.full), (False, self.partial)):
            f, lf, b, lb = self._pass(full=is_full)
            self.forward.append(f)
            into.append(b)
            self.loss_forward.append(lf)
            if is_full:
                self.loss_backward.append(lb)
        if with_checkpoint:
            args = (self.spec, self.layers, self.inputs, self.targets, self.clock)
            self.plain.append(_whole_pass(*args, checkpointed=False))
            self.checkpointed.append(_whole_pass(*args, checkpointed=True))
        self.layers.zero_grad(set_to_none=True)

    def result(self) -> _SizeResult:
        n = len(self.layers)
        med_forward = [statistics.median(r[i] for r in self.forward) for i in range(n)]
        med_full = [statistics.median(r[i] for r in self.full) for i in range(n)]
        med_input = [statistics.median(r[i] for r in self.partial) for i in range(n)]
        # A layer whose input-grad backward looks slower than its full one (noise) has no weight-grad work left.
        med_input = [min(i, f) for i, f in zip(med_input, med_full)]
        checkpoint_forward, checkpoint_recompute = _checkpoint_ratios(self.plain, self.checkpointed)
        return _SizeResult(
            forward_ms=med_forward,
            backward_input_ms=med_input,
            backward_weight_ms=[f - i for f, i in zip(med_full, med_input)],
            saved_bytes=self.saved,
            output_bytes=self.output_bytes,
            input_bytes=_nbytes(self.inputs[0]),
            loss_forward_ms=statistics.median(self.loss_forward),
            loss_backward_ms=statistics.median(self.loss_backward),
            loss_saved_bytes=self.loss_saved,
            checkpoint_forward_ratio=checkpoint_forward,
            checkpoint_recompute_ratio=checkpoint_recompute,
        )


def _whole_pass(
    spec: ModelSpec,
    layers: _Whole,
    inputs: tuple[tuple[torch.Tensor, ...], dict[str, Any]],
    targets: torch.Tensor,
    clock: _Clock,
    *,
    checkpointed: bool,
) -> tuple[float, float]:
    """Forward and backward times of the whole model, plain or checkpointed as one unit (as the runtime
    checkpoints a stage); the loss stays outside, as on the last stage."""
    start = clock.mark()
    args, side = inputs
    output = checkpoint(layers.module, *args, use_reentrant=False, **side) if checkpointed else layers(args, side)
    middle = clock.mark()
    spec.loss_fn(output, targets).backward()
    end = clock.mark()
    clock.sync()
    return clock.ms(start, middle), clock.ms(middle, end)


def _checkpoint_ratios(
    plain: Sequence[tuple[float, float]], checkpointed: Sequence[tuple[float, float]]
) -> tuple[float, float]:
    """From (forward, backward) times of the model plain and checkpointed: checkpointed forward / plain forward, and
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


def _timed_pass(
    spec: ModelSpec,
    layers: _Whole,
    inputs: tuple[tuple[torch.Tensor, ...], dict[str, Any]],
    targets: torch.Tensor,
    clock: _Clock,
    *,
    full: bool,
) -> tuple[list[float], float, list[float], float]:
    """One forward and one backward with a timestamp at each layer boundary.

    Forward: pre-hook and hook of each layer. Backward: a hook on each layer's output fires when that output's
    gradient is complete, i.e. when backward enters the layer; the layer's backward ends when the previous layer's
    output hook fires (the first layer's, when backward returns).

        forward   |pre0 ... post0|pre1 ... post1| ... |postN-1| loss |
        backward  |bwd start| loss |gradN-1| layer N-1 |gradN-2| ... |grad0| layer 0 |end|

    full=False asks torch.autograd.grad for the gradient of the first float activation only, so the backward
    computes input gradients and skips weight gradients; layers before that activation (an embedding of token
    ids) get 0 input-grad time."""
    n = len(layers)
    pre: list[Any] = [None] * n
    post: list[Any] = [None] * n
    grad: list[Any] = [None] * n
    outputs: list[torch.Tensor | None] = [None] * n
    args, side = inputs
    x = args[0]
    if not full and x.is_floating_point():
        x = x.detach().requires_grad_(True)
    handles = []
    for i, layer in enumerate(layers.blocks):
        handles.append(layer.register_forward_pre_hook(_pre_hook(pre, i, clock)))
        handles.append(layer.register_forward_hook(_post_hook(post, grad, outputs, i, clock)))
    try:
        output = layers((x, *args[1:]), side)
        loss_start = clock.mark()
        loss = spec.loss_fn(output, targets)
        loss_end = clock.mark()
        if not loss.requires_grad:
            raise ModelFileError(
                f"{spec.path}: the loss does not depend on any parameter (requires_grad is False); "
                f"build_model() must return layers with trainable parameters"
            )
        backward_start = clock.mark()
        if full:
            loss.backward()
        else:
            target = x if x.requires_grad else next((o for o in outputs if o is not None and o.requires_grad), None)
            if target is not None:
                torch.autograd.grad(loss, [target])
        backward_end = clock.mark()
    finally:
        for handle in handles:
            handle.remove()
    clock.sync()
    forward_ms = [clock.ms(pre[i], post[i]) for i in range(n)]
    first_grad = 0 if full or x.requires_grad else next(
        (i + 1 for i, o in enumerate(outputs) if o is not None and o.requires_grad), n
    )
    backward_ms = []
    for i in range(n):
        end = grad[i - 1] if i > 0 else backward_end
        if i < first_grad or grad[i] is None:
            backward_ms.append(0.0)
        elif end is None:  # previous output needed no gradient (integer): this layer's backward runs to the end
            backward_ms.append(clock.ms(grad[i], backward_end))
        else:
            backward_ms.append(clock.ms(grad[i], end))
    loss_backward_ms = clock.ms(backward_start, grad[n - 1]) if grad[n - 1] is not None else 0.0
    return forward_ms, clock.ms(loss_start, loss_end), backward_ms, loss_backward_ms


def _pre_hook(marks: list[Any], i: int, clock: _Clock) -> Any:
    def hook(module: nn.Module, args: Any) -> None:
        marks[i] = clock.mark()

    return hook


def _post_hook(marks: list[Any], grads: list[Any], outputs: list[Any], i: int, clock: _Clock) -> Any:
    def on_grad(_: torch.Tensor) -> None:
        grads[i] = clock.mark()

    def hook(module: nn.Module, args: Any, output: Any) -> None:
        marks[i] = clock.mark()
        # Several tensors may leave a block: the first one needing a gradient stands for them all.
        tensors = [output] if isinstance(output, torch.Tensor) else output if isinstance(output, tuple) else []
        first = next((t for t in tensors if isinstance(t, torch.Tensor) and t.requires_grad), None)
        if first is not None:
            first.register_hook(on_grad)
            outputs[i] = first

    return hook


def _saved_bytes(
    spec: ModelSpec, layers: _Whole, inputs: tuple[tuple[torch.Tensor, ...], dict[str, Any]], targets: torch.Tensor
) -> tuple[list[int], int, list[int]]:
    """Bytes autograd saves for backward, per layer (a storage counts once, for the first layer saving it;
    parameters and views of them are skipped), plus the loss's, plus each layer's output bytes."""
    n = len(layers)
    parameter_storages = {p.untyped_storage().data_ptr() for p in layers.parameters()}
    seen: set[int] = set()
    saved = [0] * (n + 1)  # index n: the loss
    output_bytes = [0] * n
    current = [0]

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        ptr = storage.data_ptr()
        if ptr and ptr not in parameter_storages and ptr not in seen:
            seen.add(ptr)
            saved[current[0]] += storage.nbytes()
        return tensor

    def enter(i: int) -> Any:
        def hook(module: nn.Module, args: Any) -> None:
            current[0] = i

        return hook

    def leave(i: int) -> Any:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            output_bytes[i] = _nbytes(output)

        return hook

    handles = [h for i, layer in enumerate(layers.blocks)
               for h in (layer.register_forward_pre_hook(enter(i)), layer.register_forward_hook(leave(i)))]
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            output = layers(*inputs)
            current[0] = n
            loss = spec.loss_fn(output, targets)
        del loss, output
    finally:
        for handle in handles:
            handle.remove()
    return saved[:n], saved[n], output_bytes


def _profile_optimizer(
    spec: ModelSpec, layers: _Whole, clock: _Clock, repeats: int
) -> tuple[float, int, int]:
    """Median time of one optimizer step over the whole model, the state it keeps, and the most bytes a step
    allocates on top (AdamW's foreach temporaries: 0.2-1x the parameters on the recipes)."""
    params = [p for p in layers.parameters() if p.requires_grad]
    if not params:
        return 0.0, 0, 0
    for p in params:
        p.grad = torch.zeros_like(p)
    optimizer = build_optimizer(spec, params)
    optimizer.step()  # creates the state
    times = []
    for _ in range(repeats):
        start = clock.mark()
        optimizer.step()
        end = clock.mark()
        clock.sync()
        times.append(clock.ms(start, end))
    state = sum(_nbytes(v) for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor))
    transient = _step_transient_bytes(optimizer, params[0].device)
    layers.zero_grad(set_to_none=True)
    return statistics.median(times), state, transient


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


def _nbytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (tuple, list)):
        return sum(_nbytes(v) for v in value)
    return 0
