"""torch's private surface, behind one door: every private torch name autotune uses is named here and only here.

    what autotune needs                      private torch name (module)
    a schedule's per-rank action lists       get_schedule_ops (pipelining._schedule_visualizer), with
                                             _PipelineScheduleRuntime._prepare_schedule_with_comms and
                                             _add_reduce_grad patched out while it runs (pipelining.schedules: the
                                             runtime's lowering, dropped)
    running its own orders (VHalf, VMin)     _PipelineScheduleRuntime, _Action, _ComputationType,
                                             _prepare_schedule_with_comms (pipelining.schedules)
    V placement on torch 2.11 with gloo      PipelineStage._get_init_p2p_neighbors_ops (self-sends dropped)
    live tensor bytes on CPU                 TorchDispatchMode, is_traceable_wrapper_subclass
                                             (utils._python_dispatch), tree_flatten (utils._pytree)
    saved activations that are parameters    Tensor._base
    BatchNorm anywhere in a layer            _BatchNorm (nn.modules.batchnorm)
    reading torch's failures                 its error texts (broken connections, out of memory) and source paths
    a rank's completed compute actions       PipelineStage.forward_one_chunk, backward_one_chunk,
                                             backward_weight_one_chunk (what torch's schedules call per action)
    what a split backward's I holds and      stage_backward_input (pipelining._backward), run on one block by the
    keeps for its W                          profiler
    split backwards of FSDP2 stages that     PipelineStage.backward_maybe_with_nosync (where torch's stage reads
    reshard after forward                    the weights its input-only backward leaves for W)
    storage for FSDP2 shards built on meta   nn.Module._apply (FSDPModule overrides it to re-pad its shards)

Importing this module checks the torch version against the tested range (a TorchVersionWarning outside it, no
more); a symbol is looked up when first needed, and a missing one is a TorchAPIError (exit 4) that names it, the
installed torch and the tested range. The pipelining modules are imported only when needed (~1-2 s).
tests/unit/test_compat.py checks every symbol and the signatures autotune calls, on each torch CI runs.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import re
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any
from unittest import mock

import torch

from autotune.errors import AutotuneError

TESTED_TORCH = ("2.11.0", "2.14.1")
"""The oldest and the newest torch the test suite runs on (CI runs it on both)."""


class TorchVersionWarning(UserWarning):
    """The installed torch is outside the tested range: it may work, nothing says it does."""


class TorchAPIError(AutotuneError):
    """The installed torch lacks an API autotune needs (exit 4: like a missing device, this environment cannot run
    it); the message names the symbol and the torch versions that have it."""

    exit_code = 4


def _version_tuple(version: str) -> tuple[int, int, int]:
    match = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", version)
    if match is None:
        return (0, 0, 0)
    major, minor, patch = match.groups()
    return int(major), int(minor), int(patch or 0)


def tested_range_text() -> str:
    return f"torch {TESTED_TORCH[0]} to {TESTED_TORCH[1]}"


def check_torch_version(version: str | None = None) -> str | None:
    """Warn (TorchVersionWarning) when torch is outside the tested range; return the warning's text, or None."""
    version = version or torch.__version__
    installed = _version_tuple(version)
    oldest, newest = (_version_tuple(v) for v in TESTED_TORCH)
    if oldest <= installed and installed[:2] <= newest[:2]:
        return None
    text = (
        f"autotune is tested with {tested_range_text()}; torch {version} is installed. It may work; if a command "
        f"fails inside torch, install a tested one: pip install 'torch>={TESTED_TORCH[0]},<={TESTED_TORCH[1]}'"
    )
    warnings.warn(text, TorchVersionWarning, stacklevel=2)
    return text


check_torch_version()


# --- looking symbols up -------------------------------------------------------------------------------------------

_PIPELINING_SCHEDULES = "torch.distributed.pipelining.schedules"
_VISUALIZER = "torch.distributed.pipelining._schedule_visualizer"
_BACKWARD = "torch.distributed.pipelining._backward"

SYMBOLS: tuple[tuple[str, str], ...] = (
    (_VISUALIZER, "get_schedule_ops"),
    (_PIPELINING_SCHEDULES, "_PipelineScheduleRuntime"),
    (_PIPELINING_SCHEDULES, "_Action"),
    (_PIPELINING_SCHEDULES, "_ComputationType"),
    (_BACKWARD, "stage_backward_input"),
    (_BACKWARD, "stage_backward_weight"),
    ("torch.utils._python_dispatch", "TorchDispatchMode"),
    ("torch.utils._pytree", "tree_flatten"),
    ("torch.nn.modules.batchnorm", "_BatchNorm"),
)
"""Every private (module, name) autotune needs."""

OPTIONAL_SYMBOLS: tuple[tuple[str, str], ...] = (
    (_PIPELINING_SCHEDULES, "_add_reduce_grad"),
    ("torch.utils.checkpoint", "_CheckpointFrame"),
)
"""Private names used only to go faster or to measure more: without them autotune still works."""


def symbol(module: str, name: str) -> Any:
    """module.name, or a TorchAPIError naming what is missing and what to install."""
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        raise TorchAPIError(
            f"torch {torch.__version__} has no {module}.{name}, which autotune needs; install a tested torch "
            f"({tested_range_text()}): pip install 'torch>={TESTED_TORCH[0]},<={TESTED_TORCH[1]}'"
        ) from None


def missing_symbols() -> list[str]:
    """The needed private names this torch lacks (empty on a tested torch)."""
    missing = []
    for module, name in SYMBOLS:
        try:
            symbol(module, name)
        except TorchAPIError:
            missing.append(f"{module}.{name}")
    return missing


# --- schedules: torch's orders, and ours on torch's runtime -------------------------------------------------------

_COMPUTE_KINDS = {"FORWARD": "F", "FULL_BACKWARD": "B", "BACKWARD_INPUT": "I", "BACKWARD_WEIGHT": "W"}
"""torch's compute action types by member name: their values changed from ints (torch 2.9) to letters (2.11)."""


def schedule_actions(
    schedule: str, pipeline_degree: int, n_microbatches: int, stages_per_rank: int
) -> list[list[tuple[int, str, int, bool]]]:
    """torch's own per-rank compute order of a built-in schedule as (stage, kind F|B|I|W, micro-batch, fused with
    the next), without any process group. DualPipeV's fused OVERLAP_F_B actions are listed as their sub-actions one
    after the other (as the runtime runs them), the first fused with the second; communication, FSDP and
    gradient-reduction actions are dropped. Raises torch's own ValueError for a combination the schedule refuses."""
    get_schedule_ops = symbol(_VISUALIZER, "get_schedule_ops")
    schedules = importlib.import_module(_PIPELINING_SCHEDULES)
    visualizer = importlib.import_module(_VISUALIZER)
    # Building a schedule also lowers its compute order for the runtime (the last step of the multi-stage classes'
    # __init__): it checks the order, inserts FSDP unshard/reshard actions (a pass quadratic in the list length),
    # gradient reductions, and sends and receives (a replay of the whole schedule); together about 3/4 of the time
    # of a 128-node plan's schedules. The compute order (pipeline_order) is set before and is all that is read
    # here (compile_graph checks it), so the lowering is skipped; so are the gradient reductions the single-stage
    # classes add to their order themselves (dropped below anyway).
    with contextlib.ExitStack() as stack:
        runtime = symbol(_PIPELINING_SCHEDULES, "_PipelineScheduleRuntime")
        stack.enter_context(mock.patch.object(runtime, "_prepare_schedule_with_comms", _no_lowering))
        if hasattr(schedules, "_add_reduce_grad"):
            stack.enter_context(mock.patch.object(schedules, "_add_reduce_grad", _unchanged))
        if getattr(visualizer, "mock", None) is mock:
            stack.enter_context(mock.patch.object(visualizer, "mock", _REUSED_AUTOSPECS))
        ops = get_schedule_ops(schedule, pipeline_degree, n_microbatches, num_stages_per_rank=stages_per_rank)
    return [compute_actions(rank_ops) for rank_ops in ops]


def _unchanged(actions: Any, *args: Any, **kwargs: Any) -> Any:
    return actions


def _no_lowering(self: Any, *args: Any, **kwargs: Any) -> None:
    return None


class _ReusedAutospecs:
    """unittest.mock as get_schedule_ops sees it, except that create_autospec makes each spec once per process.

    get_schedule_ops stands a mock.create_autospec(PipelineStage) in for the stages on every call, which took about
    half of its time (~25 ms a call, 2 s of a 15 s plan over 128 nodes). The stand-in only answers the schedule's
    questions: get_schedule_ops sets what the schedule reads from it (group_rank, group_size, num_stages, submod)
    on each call, the schedule sets stage_index_to_group_rank itself, and the rest (is_first, is_last, has_backward)
    are mock attributes either way, so one stand-in serves every call (tests/unit/test_compat.py compares the lists
    with fresh ones)."""

    def __init__(self) -> None:
        self._made: dict[Any, Any] = {}

    def __getattr__(self, name: str) -> Any:
        return getattr(mock, name)

    def create_autospec(self, spec: Any, *args: Any, **kwargs: Any) -> Any:
        key = (spec, args, tuple(sorted(kwargs.items())))
        if key not in self._made:
            self._made[key] = mock.create_autospec(spec, *args, **kwargs)
        return self._made[key]


_REUSED_AUTOSPECS = _ReusedAutospecs()


def compute_actions(rank_ops: Sequence[Any]) -> list[tuple[int, str, int, bool]]:
    """One rank's torch actions (_Action, or None for an idle step) as (stage, kind F|B|I|W, micro-batch, fused
    with the next): a fused action as its sub-actions, each but the last fused with the next (the runtime posts
    their sends after the last), everything but compute dropped."""
    actions = []
    kinds = _compute_kinds()
    for op in rank_ops:
        if op is None:
            continue
        subs = [(sub.stage_index, kind, sub.microbatch_index) for sub in op.sub_actions or (op,)
                if (kind := kinds.get(sub.computation_type)) is not None]
        actions.extend((*sub, k < len(subs) - 1) for k, sub in enumerate(subs))
    return actions


@functools.cache
def _compute_kinds() -> dict[Any, str]:
    """_COMPUTE_KINDS by torch's enum members themselves (reading .name costs more than the rest of the walk)."""
    members = symbol(_PIPELINING_SCHEDULES, "_ComputationType")
    return {member: _COMPUTE_KINDS[member.name] for member in members if member.name in _COMPUTE_KINDS}


def runtime_schedule(
    stages: Sequence[Any],
    *,
    n_microbatches: int,
    loss_fn: Callable[..., torch.Tensor],
    order: Sequence[Sequence[tuple[int, str, int]]],
) -> Any:
    """A schedule torch does not ship, run by torch's own runtime (as torchtitan's CSV schedules are): `order` holds
    every rank's compute actions as (stage, kind F|B|I|W, micro-batch); torch validates them, infers the stage ->
    rank placement from them and inserts the sends and receives. Gradients are left unscaled (scale_grads=False),
    as for torch's own schedules in autotune.runtime."""
    runtime = symbol(_PIPELINING_SCHEDULES, "_PipelineScheduleRuntime")
    action = symbol(_PIPELINING_SCHEDULES, "_Action")
    kinds = symbol(_PIPELINING_SCHEDULES, "_ComputationType")
    by_letter = {letter: getattr(kinds, name) for name, letter in _COMPUTE_KINDS.items()}
    schedule = runtime(list(stages), n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=False)
    schedule.pipeline_order = {
        rank: [action(stage, by_letter[kind], microbatch) for stage, kind, microbatch in actions]
        for rank, actions in enumerate(order)
    }
    schedule._prepare_schedule_with_comms(schedule.pipeline_order)
    return schedule


# --- tensors and modules -------------------------------------------------------------------------------------------

try:
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten
except ImportError:  # pragma: no cover - a torch without them is outside any tested range

    class TorchDispatchMode:  # type: ignore[no-redef]
        """Stand-in that fails with the fix when used."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            symbol("torch.utils._python_dispatch", "TorchDispatchMode")

    def tree_flatten(tree: Any) -> Any:  # type: ignore[misc]
        return symbol("torch.utils._pytree", "tree_flatten")(tree)


def stored_tensors(tensor: torch.Tensor) -> list[torch.Tensor]:
    """The tensors holding a tensor's storage: a wrapper subclass's inner tensors (a DTensor's local shard: FSDP2's
    parameters and gradients), else the tensor itself."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    if not is_traceable_wrapper_subclass(tensor):
        return [tensor]
    names, _ = tensor.__tensor_flatten__()  # a DTensor's: its local tensor and (torch 2.14) its device mesh
    inner = [getattr(tensor, name) for name in names]
    return [t for value in inner if isinstance(value, torch.Tensor) for t in stored_tensors(value)]


@contextlib.contextmanager
def checkpoint_frames() -> Iterator[list[Any]]:
    """The frames torch's non-reentrant checkpoint makes inside the block (torch.utils.checkpoint._CheckpointFrame,
    one per checkpointed call): each keeps what a backward's recompute made, per autograd pass, in
    `frame.recomputed` (pass id -> {handle: tensor}). Empty where torch lacks the class (nothing recorded)."""
    import torch.utils.checkpoint as checkpoint_module

    frames: list[Any] = []
    original = getattr(checkpoint_module, "_CheckpointFrame", None)
    if original is None:
        yield frames
        return

    def recorded(*args: Any, **kwargs: Any) -> Any:
        frame = original(*args, **kwargs)
        frames.append(frame)
        return frame

    with mock.patch.object(checkpoint_module, "_CheckpointFrame", recorded):
        yield frames


@contextlib.contextmanager
def around_autograd_passes(before: Callable[[], None], after: Callable[[], None]) -> Iterator[None]:
    """Call before() and after() around each torch.autograd.grad inside the block (torch's split W runs one per
    parameter group: stage_backward_weight)."""
    grad = torch.autograd.grad

    def each(*args: Any, **kwargs: Any) -> Any:
        before()
        result = grad(*args, **kwargs)
        after()
        return result

    with mock.patch.object(torch.autograd, "grad", each):
        yield


def view_base(tensor: torch.Tensor) -> torch.Tensor | None:
    """The tensor a view was taken of (None for a tensor that is no view)."""
    return tensor._base


def clear_cublas_workspaces() -> None:
    """Hand cuBLAS's workspaces back to the caching allocator (they stay allocated for the life of each handle
    otherwise, ~32 MiB per thread and stream on Hopper). torch calls this itself before CUDA graph capture; it has no
    public name. A no-op where torch lacks it."""
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None and torch.cuda.is_initialized():
        clear()


def stage_backward_input(
    outputs: list[torch.Tensor], output_grads: list[torch.Tensor] | None, inputs: list[torch.Tensor],
    weights: list[torch.nn.Parameter],
) -> tuple[tuple[torch.Tensor | None, ...], list[dict[str, Any]]]:
    """A split backward's I as torch's stage runs it: the inputs' gradients (also left in their .grad), and the
    parameter groups holding what its W needs (the gradients of the weight ops' outputs); the outputs are detached
    in place."""
    if not any(isinstance(t, torch.Tensor) and t.requires_grad for t in inputs):
        # Nothing to differentiate for: torch >= 2.14 returns no gradients and lets go of the graph (the outputs
        # detached); torch 2.11's autograd.grad refuses an empty input list.
        for t in outputs:
            t.detach_()
        return tuple(None for _ in inputs), []
    run = symbol(_BACKWARD, "stage_backward_input")
    result: tuple[tuple[torch.Tensor | None, ...], list[dict[str, Any]]] = run(outputs, output_grads, inputs,
                                                                               iter(weights))
    return result


def stage_backward_weight(weights: list[torch.nn.Parameter], param_groups: list[dict[str, Any]]) -> None:
    """A split backward's W as torch's stage runs it: one autograd pass per parameter group that stage_backward_input
    returned, the weights' gradients accumulated in their .grad."""
    symbol(_BACKWARD, "stage_backward_weight")(iter(weights), param_groups)


def is_batch_norm(module: torch.nn.Module) -> bool:
    """BatchNorm of any kind (1d/2d/3d, lazy, synchronized)."""
    return isinstance(module, symbol("torch.nn.modules.batchnorm", "_BatchNorm"))


# --- reading torch's failures -------------------------------------------------------------------------------------

COMMS_ERROR_TEXTS = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Read error",
    "Broken pipe",
    "Socket Timeout",
    "Timed out waiting",
    "NCCL communicator was aborted",
    "ProcessGroupGloo",
    "ECONNRESET",
)
"""What gloo / NCCL errors say when a peer is gone: a rank that failed only so is a victim, not the culprit."""

OUT_OF_MEMORY_TEXT = re.compile(
    r"CUDA out of memory"  # torch's CUDA caching allocator (torch.OutOfMemoryError)
    r"|can't allocate memory|not enough memory: you tried to allocate"  # torch's CPU allocator (POSIX, Windows)
    r"|Cuda failure (?:\d+ )?'out of memory'"  # NCCL's "Last error:" when a CUDA call it made ran out
    r"|Failed to CUDA [cm]alloc \d+ bytes"  # NCCL's own buffers (its ncclCudaCalloc / ncclCudaMalloc)
    r"|CUBLAS_STATUS_ALLOC_FAILED"  # cuBLAS could not allocate its workspace
)
"""What torch's CPU and CUDA allocators, NCCL (as torch's DistBackendError carries it) and cuBLAS say when an
allocation fails (beside torch.OutOfMemoryError and MemoryError). NCCL's reads, e.g.:
"NCCL error in: .../ProcessGroupNCCL.cpp:3356, unhandled cuda error (run with NCCL_DEBUG=INFO for details), NCCL
version 2.21.5 / ncclUnhandledCudaError: Call to CUDA function failed. / Last error: / Cuda failure 2 'out of memory'"
(older NCCL: "Cuda failure 'out of memory'")."""

ALLOCATION_BYTES = re.compile(
    r"(?i:tried to allocate)\s+(?P<number>[0-9.]+)\s*(?P<unit>bytes|[KMGT]iB)?"
    r"|Failed to CUDA [cm]alloc (?P<nccl_bytes>[0-9]+) bytes"
)
"""The refused allocation in an out-of-memory message: CUDA's "Tried to allocate 2.00 GiB", the CPU allocator's
"you tried to allocate 123456 bytes" (number and unit), NCCL's "Failed to CUDA calloc 6291456 bytes" (nccl_bytes)."""

STAGE_COMPUTE_METHODS = ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk")
"""The PipelineStage methods torch's schedules call once per compute action (F; B or I; W): wrapped to count a
rank's progress (autotune.trial.progress)."""

TORCH_DISTRIBUTED_PATH = "torch/distributed"
"""In a stack frame's file name: the frame is inside torch.distributed (a rank waiting on its peers)."""

TORCH_PATH = "/torch/"
"""In a stack frame's file name: the frame is inside torch."""


_FSDP_STORAGE_MODULES = (
    "torch.distributed.fsdp._fully_shard._fsdp_param",
    "torch.distributed.fsdp._fully_shard._fsdp_param_group",
)
"""Where FSDP2 calls alloc_storage / free_storage by module-level name (torch 2.11-2.14)."""


@contextlib.contextmanager
def fsdp_storage_resizes(on_resize: Callable[[torch.Tensor, int], None]) -> Iterator[None]:
    """FSDP2 gathers a unit's parameters into storages it keeps and resizes in place (alloc_storage / free_storage:
    UntypedStorage.resize_, which no TorchDispatchMode sees). While active, each such resize also calls
    on_resize(tensor, its storage's new byte count). A torch without these names: nothing is followed."""
    patches = []
    for name in _FSDP_STORAGE_MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        for fn_name in ("alloc_storage", "free_storage"):
            original = getattr(module, fn_name, None)
            if original is not None:
                patches.append(mock.patch.object(module, fn_name, _following(original, on_resize)))
    with contextlib.ExitStack() as stack:
        for patch in patches:
            stack.enter_context(patch)
        yield


def _following(original: Callable[[torch.Tensor], None],
               on_resize: Callable[[torch.Tensor, int], None]) -> Callable[[torch.Tensor], None]:
    def resize(tensor: torch.Tensor) -> None:
        original(tensor)
        on_resize(tensor, tensor.untyped_storage().nbytes())

    return resize


def give_shards_storage(module: torch.nn.Module, device: torch.device) -> None:
    """Storage on `device` for the FSDP2 shards (DTensors) of a module sharded on the meta device, each parameter
    swapped in place (a DTensor is a wrapper subclass: nn.Module._apply keeps its identity), and FSDP2 re-pads its
    shards after (FSDPModule._apply), as for module.to_empty(), but leaving the real buffers and parameters outside
    FSDP2 as they are (to_empty would empty the buffers and give a tied parameter two new objects)."""
    from torch.distributed.tensor import DTensor

    def storage(t: torch.Tensor) -> torch.Tensor:
        return torch.empty_like(t, device=device) if isinstance(t, DTensor) and t.is_meta else t

    module._apply(storage)


def unshard_before_split_backward(stage: Any) -> Any:
    """torch's input-only backward (I, split-backward schedules: ZBVZeroBubble, InterleavedZeroBubble, DualPipeV,
    VHalf, VMin) finds the weights whose gradients W computes later through the stage module's registered parameters
    at that moment, and W maps them back the same way. An FSDP2 unit that resharded after a forward
    (reshard_after_forward) has its sharded DTensors registered then, not the unsharded parameters the forward's
    graph used: W finds nothing (those gradients stay None) or fails (a KeyError on an AccumulateGrad) (torch 2.11
    and 2.14). So, before an I or a W, the stage's units are gathered (FSDPModule.unshard: a no-op for a unit
    gathered already), as a full backward's pre-backward hooks would do."""
    from torch.distributed.fsdp import FSDPModule

    original = stage.backward_maybe_with_nosync

    def backward_maybe_with_nosync(backward_type: Any, bwd_kwargs: dict[str, Any], last_backward: bool = False) -> Any:
        if backward_type in ("input", "weight"):
            for module in stage.submod.modules():
                if isinstance(module, FSDPModule):
                    module.unshard()
        return original(backward_type, bwd_kwargs, last_backward=last_backward)

    stage.backward_maybe_with_nosync = backward_maybe_with_nosync
    return stage


def prepare_stage(stage: Any) -> Any:
    """torch 2.11 warms up each stage's point-to-point links on its first step, with its neighbour stages even when
    one lives on the same rank (V placement), and gloo cannot send to its own rank ("Pair is not connected"): those
    warm-up sends and receives are dropped. Later torch warms up differently; there this changes nothing."""
    original = getattr(stage, "_get_init_p2p_neighbors_ops", None)
    if original is not None:
        own = stage.group_rank
        stage._get_init_p2p_neighbors_ops = lambda: [op for op in original() if getattr(op, "group_peer", None) != own]
    return stage
