"""Load a user's model file and check it keeps the contract (build_model, make_batch, loss_fn, build_optimizer)."""

from __future__ import annotations

import hashlib
import importlib.util
import sys
import traceback
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from torch import nn

from autotune.compat import is_batch_norm
from autotune.errors import ModelFileError

REQUIRED = ("build_model", "make_batch", "loss_fn")
SEED = 0
"""Every rank builds the model with this seed, so the slices of all ranks come from one model."""


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """A loaded model file: its functions and what building the model (on the meta device) revealed."""

    path: Path
    """Absolute path of the model file."""
    build_model: Callable[[], Any]
    make_batch: Callable[[int], Any]
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    build_optimizer: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer] | None
    """None: AdamW with torch's defaults."""
    layer_names: tuple[str, ...]
    """Class name of each layer, in model order."""
    parameter_bytes: tuple[int, ...]
    """Bytes of parameters of each layer."""
    batchnorm_layers: tuple[int, ...] = ()
    """Layers holding a BatchNorm module at any depth (statistics per micro-batch under pipelining)."""

    @property
    def n_layers(self) -> int:
        return len(self.layer_names)

    @property
    def has_batchnorm(self) -> bool:
        return bool(self.batchnorm_layers)


def load_model_file(path: str | Path) -> ModelSpec:
    """Import the file, check its functions, and build the model on the meta device to count its layers."""
    module = _import(Path(path))
    functions = {}
    for name in REQUIRED:
        fn = getattr(module, name, None)
        if not callable(fn):
            raise ModelFileError(
                f"{path}: no function {name}() — a model file defines build_model(), make_batch(batch_size) and "
                f"loss_fn(output, target) (build_optimizer(params) is optional); add {name}"
            )
        functions[name] = fn
    build_optimizer = getattr(module, "build_optimizer", None)
    if build_optimizer is not None and not callable(build_optimizer):
        raise ModelFileError(f"{path}: build_optimizer is not a function; define build_optimizer(params) or remove it")

    with torch.device("meta"):
        model = _call_user(Path(path), "build_model", functions["build_model"])
    layers = as_sequential(model, path=Path(path))
    return ModelSpec(
        path=Path(path).resolve(),
        build_model=functions["build_model"],
        make_batch=functions["make_batch"],
        loss_fn=functions["loss_fn"],
        build_optimizer=build_optimizer,
        layer_names=tuple(type(layer).__name__ for layer in layers),
        parameter_bytes=tuple(
            sum(p.numel() * p.element_size() for p in layer.parameters()) for layer in layers
        ),
        batchnorm_layers=tuple(
            i for i, layer in enumerate(layers)
            if any(is_batch_norm(m) for m in layer.modules())
        ),
    )


def build_layers(spec: ModelSpec, *, seed: int = SEED) -> nn.Sequential:
    """Build the model for real, seeded, as an nn.Sequential."""
    torch.manual_seed(seed)
    return as_sequential(_call_user(spec.path, "build_model", spec.build_model), path=spec.path)


def as_sequential(model: Any, *, path: Path) -> nn.Sequential:
    if isinstance(model, nn.Sequential):
        layers = model
    elif isinstance(model, (list, tuple)) and all(isinstance(m, nn.Module) for m in model):
        layers = nn.Sequential(*model)
    else:
        raise ModelFileError(
            f"{path}: build_model() returned {type(model).__name__}; return an nn.Sequential (or a list of modules) "
            f"whose layers run in order, so stages can be cut between them"
        )
    if len(layers) == 0:
        raise ModelFileError(f"{path}: build_model() returned an empty model; return at least one layer")
    return layers


def make_batch(spec: ModelSpec, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Call the user's make_batch and check it returns (inputs, targets) with batch_size rows."""
    batch = _call_user(spec.path, "make_batch", spec.make_batch, batch_size)
    if not (isinstance(batch, (tuple, list)) and len(batch) == 2 and all(isinstance(t, torch.Tensor) for t in batch)):
        raise ModelFileError(
            f"{spec.path}: make_batch({batch_size}) returned {_describe(batch)}; return a tuple (inputs, targets) "
            f"of two tensors"
        )
    for what, tensor in zip(("inputs", "targets"), batch):
        if tensor.dim() == 0 or tensor.shape[0] != batch_size:
            shape = tuple(tensor.shape)
            raise ModelFileError(
                f"{spec.path}: make_batch({batch_size}) returned {what} of shape {shape}; the first dimension "
                f"must be the batch size asked for ({batch_size})"
            )
    return batch[0], batch[1]


REAL_CHECK_MAX_BYTES = 256 * 2**20
"""Models with fewer parameter bytes are checked with a real forward; larger ones on the meta device."""


def check_model(spec: ModelSpec, batch_size: int) -> None:
    """Run make_batch, one forward on two samples and the loss, and check the results.

    Small models run for real on the CPU (milliseconds). Larger ones run on the meta device (no compute, no memory;
    the first use costs ~2 s of torch imports), falling back to a real forward when a layer cannot run there."""
    inputs, targets = make_batch(spec, batch_size)
    rows = min(batch_size, 2)
    output = target = None
    if sum(spec.parameter_bytes) > REAL_CHECK_MAX_BYTES:
        with torch.device("meta"):
            layers = as_sequential(_call_user(spec.path, "build_model", spec.build_model), path=spec.path)
        try:
            with torch.no_grad():
                output = layers(inputs[:rows].to("meta"))
            target = targets[:rows].to("meta")
        except (NotImplementedError, RuntimeError):
            output = None
    if output is None:
        layers = build_layers(spec)
        with torch.no_grad():
            output = _call_user(spec.path, "the model's forward", layers, inputs[:rows])
        target = targets[:rows]
    loss = _call_user(spec.path, "loss_fn", spec.loss_fn, output, target)
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise ModelFileError(
            f"{spec.path}: loss_fn(output, target) returned {_describe(loss)}; return a scalar tensor "
            f"(reduce with .mean() or .sum())"
        )


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
