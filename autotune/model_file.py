"""Load a user's model file and check it keeps the contract (build_model, make_batch, loss_fn, build_optimizer)."""

from __future__ import annotations

import hashlib
import importlib.util
import sys
import traceback
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from torch import nn

from autotune.compat import is_batch_norm
from autotune.errors import ModelFileError
from autotune.models import BlockModel, Role, SharedParameter, check_blocks, check_cut, cut_model, split_points_from
from autotune.models.check import head_rows
from autotune.models.materialize import materialize, parameters_on_meta, release_block
from autotune.models.tensor_parallel import TpPlanHook, tp_plan_hook

REQUIRED = ("build_model", "make_batch", "loss_fn")
HOOKS = ("build_optimizer", "init_weights", "load_state")
"""Optional functions of a model file."""
SEED = 0
"""Each block's initialisation is seeded from this and the block's name, so every rank, the profiler and a
reference get the same values for it (autotune.models.materialize)."""


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """A loaded model file: its functions and what building the model (on the meta device) and cutting it into
    blocks (autotune.models) revealed. A "layer" is a block: what stages are cut between."""

    path: Path
    """Absolute path of the model file."""
    build_model: Callable[[], Any]
    make_batch: Callable[[int], Any]
    loss_fn: Callable[[Any, torch.Tensor], torch.Tensor]
    build_optimizer: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer] | None
    """None: AdamW with torch's defaults."""
    layer_names: tuple[str, ...]
    """Class name of each block's module, in model order."""
    parameter_bytes: tuple[int, ...]
    """Bytes of parameters of each block; a parameter shared by several blocks counts in the first only."""
    batchnorm_layers: tuple[int, ...] = ()
    """Blocks holding a BatchNorm module at any depth (statistics per micro-batch under pipelining)."""
    split_at: tuple[str, ...] | None = None
    """The module names / globs the model was cut at (--split-at, else the file's SPLIT_AT / split_points(model));
    None: autotune's own choice."""
    family: str = "sequential"
    """How it was cut: sequential, hf-decoder, hf-gpt2, timm-vit, tv-resnet or traced (autotune.models)."""
    block_names: tuple[str, ...] = ()
    """Module name of each block in the model ("model.layers.3"; "+" joins several)."""
    layer_roles: tuple[Role, ...] = ()
    """embedding | block | head | other, per block."""
    shared: tuple[SharedParameter, ...] = ()
    """Parameters held by more than one block (tied embeddings): trained as one, counted once."""
    init_weights: Callable[[nn.Module], Any] | None = None
    """The file's init_weights(module), called on each module after its own initialiser when a block is
    materialised (autotune.models.materialize); None: the module's own initialiser alone."""
    load_state: Callable[[list[str]], Mapping[str, torch.Tensor]] | None = None
    """The file's load_state(names) -> {name: tensor}: real weights for the parameters and buffers a rank holds
    (names as in model.state_dict()); setup_pipeline calls it, trials do not. None: initialised weights."""
    precision: str | None = None
    """The file's PRECISION ("fp32" | "bf16"): the default when --precision is not given; None: the device's."""
    tp_plan: TpPlanHook | None = None
    """The file's TP_PLAN ({module glob: style}) or tp_plan(model) function: its tensor-parallel plan, before the
    model's own (autotune.models.tensor_parallel.tp_plan_of); None: the model's own plan, if any."""

    @property
    def n_layers(self) -> int:
        return len(self.layer_names)

    @property
    def has_batchnorm(self) -> bool:
        return bool(self.batchnorm_layers)

    def describe_layer(self, index: int) -> str:
        """"3 (model.layers.2, LlamaDecoderLayer)", or "3 (Linear)" for an nn.Sequential."""
        name = self.block_names[index] if index < len(self.block_names) else ""
        kind = self.layer_names[index]
        return f"{index} ({name}, {kind})" if name and name != str(index) else f"{index} ({kind})"


def load_model_file(path: str | Path, *, split_at: Sequence[str] | None = None) -> ModelSpec:
    """Import the file, check its functions, build the model on the meta device and cut it into blocks.

    split_at: module names / globs to cut between (the CLI's --split-at); None: the file's SPLIT_AT or
    split_points(model), else autotune's own choice (autotune.models.cut_model)."""
    path = Path(path)
    module = _import(path)
    functions = {}
    for name in REQUIRED:
        fn = getattr(module, name, None)
        if not callable(fn):
            raise ModelFileError(
                f"{path}: no function {name}() — a model file defines build_model(), make_batch(batch_size) and "
                f"loss_fn(output, target) (build_optimizer(params) is optional); add {name}"
            )
        functions[name] = fn
    hooks = {name: getattr(module, name, None) for name in HOOKS}
    for name, hook in hooks.items():
        if hook is not None and not callable(hook):
            raise ModelFileError(f"{path}: {name} is not a function; define it as a function or remove it")

    model = _build_on_meta(path, functions["build_model"])
    if split_at is None and isinstance(model, nn.Module):
        try:
            found = split_points_from(module, model)
        except ModelFileError as exc:
            raise ModelFileError(f"{path}: {exc}") from exc
        split_at = tuple(found) if found else None
    split_at = tuple(split_at) if split_at else None
    blocks = _cut(path, model, split_at, functions["make_batch"])
    try:
        tp_plan = tp_plan_hook(module)
    except ModelFileError as exc:
        raise ModelFileError(f"{path}: {exc}") from exc
    precision = getattr(module, "PRECISION", None)
    if precision is not None and precision not in ("fp32", "bf16"):
        raise ModelFileError(f"{path}: PRECISION = {precision!r}; set it to 'fp32' or 'bf16', or remove it")
    shared_bytes = [0] * blocks.n_blocks
    for p in blocks.shared_parameters():
        for block in p.blocks[1:]:
            shared_bytes[block] += p.nbytes
    return ModelSpec(
        path=path.resolve(),
        build_model=functions["build_model"],
        make_batch=functions["make_batch"],
        loss_fn=LossFn(path=path, fn=functions["loss_fn"], output_class=blocks.output_class),
        build_optimizer=hooks["build_optimizer"],
        init_weights=hooks["init_weights"],
        load_state=hooks["load_state"],
        layer_names=blocks.block_types,
        parameter_bytes=tuple(b - s for b, s in zip(blocks.parameter_bytes(), shared_bytes)),
        batchnorm_layers=tuple(
            i for i, block in enumerate(blocks.blocks) if any(is_batch_norm(m) for m in block.modules())
        ),
        split_at=split_at,
        family=blocks.family,
        block_names=blocks.names,
        layer_roles=blocks.roles,
        shared=blocks.shared_parameters(),
        precision=precision,
        tp_plan=tp_plan,
    )


class LossFn:
    """The user's loss_fn as every stage, check and profile calls it: (last stage's output, targets) -> loss.

    The last stage ends with the logits tensor. A model that returns them in a class of its own (a Hugging Face
    family's CausalLMOutputWithPast) may have a loss_fn written for that class (`out.logits`): on the first call,
    when loss_fn fails on the tensor with the error such code raises on a tensor (AttributeError, KeyError,
    TypeError, IndexError) and runs on the output class, that is what it gets from then on. A loss_fn that works
    on neither raises one line saying what it receives."""

    def __init__(self, *, path: Path, fn: Callable[[Any, torch.Tensor], torch.Tensor], output_class: type | None):
        self.path = Path(path)
        self.fn = fn
        self.output_class = output_class
        self.wraps: bool | None = None
        """None until the first call decides; True: loss_fn takes output_class(logits=...)."""

    def __call__(self, output: Any, target: torch.Tensor) -> torch.Tensor:
        if self.wraps is None and isinstance(output, torch.Tensor):
            try:
                loss = self.fn(output, target)
            except (AttributeError, KeyError, TypeError, IndexError) as exc:
                loss = self._first_call_on_the_output_class(exc, output, target)
            else:
                self.wraps = False
            return loss
        if self.wraps and isinstance(output, torch.Tensor):
            output = self.output_class(logits=output)  # type: ignore[misc]
        return self.fn(output, target)

    def _first_call_on_the_output_class(
        self, failed: BaseException, output: torch.Tensor, target: torch.Tensor
    ) -> torch.Tensor:
        if self.output_class is not None:
            try:
                loss = self.fn(self.output_class(logits=output), target)
            except Exception:  # noqa: BLE001 - the user's code; the first error is the one to report
                pass
            else:
                self.wraps = True
                return loss
        receives = f"the model's output tensor (the logits) of shape {tuple(output.shape)}"
        if self.output_class is not None:
            receives += f" (or, if it reads `.logits`, a {self.output_class.__name__} holding it)"
        raise ModelFileError(
            f"{_where(self.path, failed)}: loss_fn raised {_one_line(failed)}; loss_fn(output, target) receives "
            f"{receives} and the targets of one micro-batch: write it for that"
        ) from failed

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "wraps": None}  # each process decides on its own first call


def build_blocks(
    spec: ModelSpec, *, only: Collection[int] | None = None, device: torch.device | str = "cpu"
) -> BlockModel:
    """Build the model with its parameters on the meta device (buffers real, on the CPU), cut it into the blocks
    the spec describes, and materialise the blocks in `only` (default: all) on `device`, each initialised on its
    own and deterministically (autotune.models.materialize): a rank, the profiler and a reference agree."""
    blocks = build_skeleton(spec)
    indices = range(blocks.n_blocks) if only is None else only
    try:
        materialize(blocks.model, blocks.blocks, blocks.names, indices, device=device,
                    init_weights=spec.init_weights, seed=SEED)
    except ModelFileError:
        raise
    except Exception as exc:  # the model's own initialisers and the file's init_weights can raise anything
        raise ModelFileError(f"{_where(spec.path, exc)}: initialising the model's blocks failed: "
                             f"{_one_line(exc)}; define init_weights(module) in the model file") from exc
    return blocks


def _build_on_meta(path: Path, build_model: Callable[[], Any]) -> Any:
    """build_model() with every tensor it makes on the meta device (no storage, no initialisation run); where the
    model's own code needs a value from a tensor it made (torchvision's RegNet turns its computed stage widths into
    a list: "Cannot copy out of meta tensor"), again with only its parameters moved there (build_skeleton's way)."""
    try:
        with torch.device("meta"):
            return _call_user(path, "build_model", build_model)
    except ModelFileError:
        with parameters_on_meta():
            return _call_user(path, "build_model", build_model)


def build_skeleton(spec: ModelSpec) -> BlockModel:
    """The model cut into blocks, every parameter on the meta device (no storage), buffers real."""
    with parameters_on_meta():
        model = _call_user(spec.path, "build_model", spec.build_model)
    blocks = _cut(spec.path, model, spec.split_at, spec.make_batch)
    if blocks.n_blocks != spec.n_layers:
        raise ModelFileError(
            f"{spec.path}: build_model() gave {blocks.n_blocks} blocks now and {spec.n_layers} on the meta device; "
            f"build the same model every time"
        )
    return blocks


def _cut(path: Path, model: Any, split_at: Sequence[str] | None, make_batch_fn: Callable[[int], Any]) -> BlockModel:
    """cut_model with the batch's inputs (which arguments the forward gets), errors prefixed with the file."""
    inputs = None
    if isinstance(model, nn.Module) and not isinstance(model, nn.Sequential):
        batch = _call_user(path, "make_batch", make_batch_fn, 2)
        if isinstance(batch, (tuple, list)) and len(batch) == 2:
            inputs = batch[0]
    try:
        blocks = cut_model(model, split_at=split_at, inputs=inputs)
    except ModelFileError as exc:
        raise ModelFileError(f"{path}: {exc}") from exc
    if blocks.n_blocks == 0:
        raise ModelFileError(f"{path}: build_model() returned an empty model; return at least one layer")
    return blocks


def make_batch(spec: ModelSpec, batch_size: int) -> tuple[Any, torch.Tensor]:
    """Call the user's make_batch and check it returns (inputs, targets) with batch_size rows. inputs may be a tensor,
    a tuple of tensors (the forward's positional arguments) or a dict (its keyword arguments)."""
    batch = _call_user(spec.path, "make_batch", spec.make_batch, batch_size)
    if not (
        isinstance(batch, (tuple, list)) and len(batch) == 2 and isinstance(batch[1], torch.Tensor)
        and input_tensors(batch[0]) is not None
    ):
        raise ModelFileError(
            f"{spec.path}: make_batch({batch_size}) returned {_describe(batch)}; return a tuple (inputs, targets): "
            f"inputs a tensor, a tuple or a dict of tensors, targets a tensor"
        )
    inputs, targets = batch
    for what, tensor in [*(input_tensors(inputs) or []), ("targets", targets)]:
        if tensor.dim() == 0 or tensor.shape[0] != batch_size:
            shape = tuple(tensor.shape)
            raise ModelFileError(
                f"{spec.path}: make_batch({batch_size}) returned {what} of shape {shape}; the first dimension "
                f"must be the batch size asked for ({batch_size})"
            )
    return inputs, targets


def input_tensors(inputs: Any) -> list[tuple[str, torch.Tensor]] | None:
    """(name, tensor) of each input, or None when inputs are not a tensor, tuple or dict of tensors."""
    if isinstance(inputs, torch.Tensor):
        return [("inputs", inputs)]
    if isinstance(inputs, (tuple, list)) and inputs and all(isinstance(t, torch.Tensor) for t in inputs):
        return [(f"inputs[{i}]", t) for i, t in enumerate(inputs)]
    if isinstance(inputs, Mapping) and inputs and all(isinstance(t, torch.Tensor) for t in inputs.values()):
        return [(f"inputs[{k!r}]", t) for k, t in inputs.items()]
    return None


def map_inputs(inputs: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """inputs (a tensor, tuple or dict of tensors) with fn applied to every tensor."""
    if isinstance(inputs, torch.Tensor):
        return fn(inputs)
    if isinstance(inputs, (tuple, list)):
        return type(inputs)(fn(t) for t in inputs)
    if isinstance(inputs, Mapping):
        return {k: fn(t) for k, t in inputs.items()}
    return inputs


REAL_CHECK_MAX_BYTES = 256 * 2**20
"""Models with fewer parameter bytes are checked with a real forward; larger ones on the meta device."""


def check_model(spec: ModelSpec, batch_size: int) -> None:
    """Run make_batch, one forward on two samples and the loss, and check the results.

    Small models run for real on the CPU (milliseconds): block by block, so that a block whose output cannot cross
    a stage is named, and, for a model cut by autotune, against the model's own forward. Larger ones run on the
    meta device (no compute, no memory); where the model's code reads a value (a Hugging Face mask asking whether a
    padding mask is all ones), under torch's fake tensors, which carry such values as symbols; and when neither
    can run them, for real block by block, one block's parameters on the CPU at a time (never the whole model)."""
    inputs, targets = make_batch(spec, batch_size)
    rows = min(batch_size, 2)
    small, target = head_rows(inputs, rows), targets[:rows]
    large = sum(spec.parameter_bytes) > REAL_CHECK_MAX_BYTES
    if large:
        meta = _cut(spec.path, _build_on_meta(spec.path, spec.build_model), spec.split_at, spec.make_batch)
        try:
            with torch.no_grad():
                output = meta.run(map_inputs(small, lambda t: t.to("meta")))
        except (NotImplementedError, RuntimeError, ModelFileError):
            pass
        else:
            _check_loss(spec, output, target.to("meta"))
            return
        if _fake_check(spec, meta, small, target):
            return
    blocks = build_skeleton(spec) if large else build_blocks(spec)
    try:
        if large:  # one block real at a time: the check must not need what the whole model needs
            output = check_blocks(blocks, inputs, rows=rows, before=lambda i: _materialize_block(spec, blocks, i),
                                  after=lambda i: release_block(blocks.blocks[i]))
        else:
            output = check_blocks(blocks, inputs, rows=rows)
            if blocks.family != "sequential":
                check_cut(blocks, inputs, rows=rows)
    except ModelFileError as exc:
        raise ModelFileError(f"{spec.path}: {exc}") from exc
    _check_loss(spec, output, target)


def _check_loss(spec: ModelSpec, output: Any, target: torch.Tensor) -> None:
    loss = _call_user(spec.path, "loss_fn", spec.loss_fn, output, target)
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise ModelFileError(
            f"{spec.path}: loss_fn(output, target) returned {_describe(loss)}; return a scalar tensor "
            f"(reduce with .mean() or .sum())"
        )


def _fake_check(spec: ModelSpec, meta: BlockModel, inputs: Any, target: torch.Tensor) -> bool:
    """The meta model's forward and the loss under FakeTensorMode with a shape environment (a value the code reads
    becomes a symbol instead of an error). False when the model cannot run there (the caller runs it for real);
    a loss_fn that fails on what the forward gives raises as it would for real."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    mode = FakeTensorMode(allow_non_fake_inputs=True, shape_env=ShapeEnv(), static_shapes=True)
    with mode, torch.no_grad():
        try:
            output = meta.run(map_inputs(inputs, lambda t: mode.from_tensor(t.to("meta"))))
        except Exception:  # noqa: BLE001 - the model's code under fake tensors can raise anything: run it for real
            return False
        _check_loss(spec, output, mode.from_tensor(target.to("meta")))
    return True


def _materialize_block(spec: ModelSpec, blocks: BlockModel, index: int) -> None:
    materialize(blocks.model, blocks.blocks, blocks.names, [index], init_weights=spec.init_weights, seed=SEED)


def build_optimizer(spec: ModelSpec, params: list[nn.Parameter]) -> torch.optim.Optimizer:
    if spec.build_optimizer is None:
        return torch.optim.AdamW(params)
    return _call_user(spec.path, "build_optimizer", spec.build_optimizer, params)


def fingerprint(path: Path) -> str:
    """Content hash of a model file, recorded in tuned configs."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()[:16]


def _import(path: Path) -> ModuleType:
    if path.is_dir():
        raise ModelFileError(f"{path}: is a directory; pass the path of a Python model file in it (see recipes/)")
    if not path.is_file():
        raise ModelFileError(f"{path}: no such file; pass the path of a Python model file (see recipes/)")
    name = "autotune_user_model_" + hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:12]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ModelFileError(f"{path}: cannot be imported as Python; pass a .py file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as exc:  # the user's code can raise anything
        sys.modules.pop(name, None)
        raise ModelFileError(f"{_where(path, exc)}: importing the model file failed: {_one_line(exc)}") from exc
    return module


def _call_user(path: Path, what: str, fn: Callable[..., Any], *args: Any) -> Any:
    try:
        return fn(*args)
    except ModelFileError:
        raise
    except Exception as exc:
        raise ModelFileError(f"{_where(path, exc)}: {what} raised {_one_line(exc)}") from exc


def _where(path: Path, exc: BaseException) -> str:
    """The user's own file and line where the exception arose (innermost frame in that file)."""
    if isinstance(exc, SyntaxError) and exc.filename and Path(exc.filename).resolve() == path.resolve():
        return f"{path}:{exc.lineno}"
    line = None
    for frame in traceback.extract_tb(exc.__traceback__):
        if Path(frame.filename).resolve() == path.resolve():
            line = frame.lineno
    return f"{path}:{line}" if line else str(path)


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or "(no message)"
    return f"{type(exc).__name__}: {text[:300]}"


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    if isinstance(value, (tuple, list)):
        return f"a {type(value).__name__} of {len(value)} ({', '.join(_describe(v) for v in value[:3])})"
    return f"a {type(value).__name__}"
