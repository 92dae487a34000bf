"""Tensor parallelism inside a pipeline stage: where a model's plan comes from, which degrees it allows, and torch's
parallelize_module applied to the blocks of one stage over the tp dimension of the mesh.

A plan maps module-name globs (names in the model build_model() returns; `*` stands for one dotted part, as in
torch's parallelize_module and transformers' plans) to a style. It comes, in this order, from

    the model file      TP_PLAN = {"layers.*.attn.q": "colwise", ...} or def tp_plan(model) -> {...}; a value is a
                        style name below or a torch ParallelStyle (ColwiseParallel(), SequenceParallel(), ...)
    Hugging Face        the model's own plan, as transformers resolves it on the instance (model._tp_plan: the
                        config's base_model_tp_plan under the base model's prefix, the class's _tp_plan for the head,
                        the vocabulary-parallel embedding transformers 5.x adds), else the config's
                        base_model_tp_plan
    nothing             no tp > 1 for this model, and tp_plan_of says why

Style names are transformers' (its plans are data: module name -> name); each is applied with torch's own style:

    colwise                         ColwiseParallel()                      weight Shard(0), output Shard(-1)
    colwise_gather_output / _rep    ColwiseParallel(output_layouts=Replicate())
    rowwise                         RowwiseParallel()                      weight Shard(1), output all-reduced
    rowwise_split_input / _rep      RowwiseParallel(input_layouts=Replicate())
    embedding_rowwise               RowwiseParallel(input_layouts=Replicate()) on an nn.Embedding: vocab-parallel
    replicate                       nothing: every tp rank holds the whole module
    replicated_with_grad_allreduce  the module stays whole, but it sees only this rank's heads (Qwen3's per-head
                                    q_norm): its gradients are summed over the tp ranks after the backward
                                    (reduce_partial_gradients), once per step, so gradient accumulation over
                                    micro-batches stays exact

An attention whose projections are colwise works unchanged when it reshapes by `-1` heads (transformers' `view(
*input_shape, -1, head_dim)`): each rank sees heads / tp heads. So tp must divide the attention heads and key/value
heads as well as every dimension it shards (tp_plan_of records them: TensorParallelPlan.constraints).

A parameter held under two names (tied embeddings) is left whole: sharding it in one module would untie it.
"""

from __future__ import annotations

import copy
import fnmatch
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import ModuleType
from typing import TYPE_CHECKING, Any, Literal, get_args

import torch
from torch import nn

from autotune.errors import InvalidCandidateError, ModelFileError
from autotune.models.blocks import BlockModel, describe
from autotune.models.cut import file_setting
from autotune.models.hf import is_transformers_model

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.parallel import ParallelStyle

    from autotune.costs import TensorParallelLayer
    from autotune.model_file import ModelSpec

StyleName = Literal[
    "colwise", "colwise_gather_output", "colwise_rep", "rowwise", "rowwise_split_input", "rowwise_rep",
    "embedding_rowwise", "replicate", "replicated_with_grad_allreduce",
]
STYLE_NAMES: tuple[str, ...] = get_args(StyleName)
COLWISE = ("colwise", "colwise_gather_output", "colwise_rep")
"""Styles sharding a Linear's output features (an Embedding's embedding dim)."""
ROWWISE = ("rowwise", "rowwise_split_input", "rowwise_rep", "embedding_rowwise")
"""Styles sharding a Linear's input features (an Embedding's vocabulary)."""
PARTIAL_GRADIENT = "replicated_with_grad_allreduce"

Style = Any
"""A StyleName or a torch ParallelStyle (typed Any: torch's class is imported only where a plan is applied)."""
TpPlanHook = Callable[[nn.Module], Mapping[str, Any]] | Mapping[str, Any]
"""The model file's tp_plan(model) function or TP_PLAN mapping."""

HEAD_ATTRIBUTES = {
    "num_attention_heads": "attention heads",
    "num_heads": "attention heads",
    "n_head": "attention heads",
    "n_heads": "attention heads",
    "num_key_value_heads": "key/value heads",
    "num_kv_heads": "key/value heads",
    "n_kv_heads": "key/value heads",
}
"""Attributes naming head counts, on a Hugging Face (text) config or on a module the plan reaches."""


@dataclass(frozen=True, kw_only=True)
class TensorParallelPlan:
    """A model's tensor-parallel plan, checked against the model."""

    styles: Mapping[str, Style]
    """Module-name glob (in the model build_model() returns) -> style, in the plan's order (first match wins)."""
    source: str
    """Where it came from: "the model file's TP_PLAN", "LlamaForCausalLM's own plan (transformers 5.24.0)"."""
    constraints: Mapping[str, int]
    """What tp must divide: "attention heads" -> 32, "model.layers.*.mlp.up_proj out_features" -> 14336."""
    left_whole: tuple[str, ...] = ()
    """Plan entries not applied, each with why (a weight tied to another module's)."""

    @property
    def max_degree(self) -> int:
        """The largest tp every constraint allows (their greatest common divisor); every divisor of it works."""
        return math.gcd(*self.constraints.values()) if self.constraints else 1

    def limit(self) -> str:
        """What refuses twice max_degree: "key/value heads (2)"; "nothing" without constraints."""
        best = self.max_degree
        refusing = [f"{what} ({size})" for what, size in sorted(self.constraints.items(), key=lambda item: item[1])
                    if size % (2 * best)]
        return refusing[0] if refusing else "nothing"


@dataclass(frozen=True, kw_only=True)
class AppliedTP:
    """What apply_tp did to one stage's blocks."""

    modules: tuple[str, ...] = ()
    """Modules parallelized (names in the model)."""
    partial_gradients: tuple[nn.Parameter, ...] = field(default=(), repr=False)
    """Parameters whose gradient each tp rank holds only its part of: sum them over the tp group after the backward
    (reduce_partial_gradients)."""

    def __add__(self, other: AppliedTP) -> AppliedTP:
        return AppliedTP(modules=self.modules + other.modules,
                         partial_gradients=self.partial_gradients + other.partial_gradients)


def tp_plan_hook(module: ModuleType) -> TpPlanHook | None:
    """The model file's tensor-parallel plan: `TP_PLAN = {glob: style}` or `def tp_plan(model) -> {glob: style}`;
    None when it has neither (model_file keeps it in ModelSpec.tp_plan)."""
    constant, function = file_setting(module, "TP_PLAN", "tp_plan", "define tp_plan(model) or TP_PLAN")
    if function is not None:
        return function  # type: ignore[no-any-return]
    if constant is not None:
        _check_styles(constant, "TP_PLAN")
        return constant  # type: ignore[no-any-return]
    return None


def tp_plan_of(source: ModelSpec | nn.Module) -> tuple[TensorParallelPlan | None, str]:
    """(the plan, where it came from), or (None, why this model has none). A model file's plan that does not fit
    its model raises ModelFileError; a Hugging Face plan autotune cannot apply gives None and the reason.

    source: a loaded model file (its hook first, then the model's own plan; the model is built on the meta device)
    or a model (its own plan)."""
    if isinstance(source, nn.Module):
        return _own_plan(source)
    from autotune.model_file import build_skeleton

    model = build_skeleton(source).model
    hook = source.tp_plan
    if hook is None:
        return _own_plan(model)
    what = "TP_PLAN" if isinstance(hook, Mapping) else "tp_plan(model)"
    if not isinstance(hook, Mapping):
        try:
            hook = hook(model)
        except Exception as exc:  # the user's code can raise anything
            raise ModelFileError(f"{source.path}: tp_plan(model) raised {type(exc).__name__}: {exc}") from exc
    try:
        _check_styles(hook, what)
        plan = checked_plan(model, hook, source=f"the model file's {what}")
    except ModelFileError as exc:
        raise ModelFileError(f"{source.path}: {exc}") from exc
    return plan, plan.source


def max_tensor_parallel(source: ModelSpec | nn.Module | TensorParallelPlan) -> int:
    """The largest tp degree the model's plan allows (1 without a plan); every divisor of it is allowed too."""
    plan = source if isinstance(source, TensorParallelPlan) else tp_plan_of(source)[0]
    return plan.max_degree if plan is not None else 1


def allowed_tp_degrees(source: ModelSpec | nn.Module | TensorParallelPlan, gpus_per_node: int) -> tuple[int, ...]:
    """tp degrees a layout may use: divisors of max_tensor_parallel, at most the GPUs of one node (a tp group is
    consecutive ranks of one node: its collectives run twice per block and direction on the intra-node link)."""
    top = min(max_tensor_parallel(source), gpus_per_node)
    return tuple(d for d in range(1, top + 1) if max_tensor_parallel(source) % d == 0)


def plan_for_degree(source: ModelSpec | nn.Module, degree: int) -> TensorParallelPlan:
    """The model's plan, checked to allow tp `degree` (every constraint divisible by it); InvalidCandidateError
    naming why not: the model has no plan (tp_plan_of's reason), or what the degree does not divide."""
    plan, why = tp_plan_of(source)
    if plan is None:
        raise InvalidCandidateError(f"tensor_parallel_degree {degree} needs a tensor-parallel plan: {why}")
    refusing = [f"{what} ({size})" for what, size in sorted(plan.constraints.items(), key=lambda item: item[1])
                if size % degree]
    if refusing:
        allowed = ", ".join(str(d) for d in range(1, plan.max_degree + 1) if plan.max_degree % d == 0)
        raise InvalidCandidateError(
            f"tensor_parallel_degree {degree} does not divide the {refusing[0]} of {plan.source}; use one of "
            f"{allowed}"
        )
    return plan


def checked_plan(model: nn.Module, styles: Mapping[str, Style], *, source: str) -> TensorParallelPlan:
    """A plan checked against the model: every glob matches a module, string styles sit on an nn.Linear or
    nn.Embedding; what tp must divide is recorded, tied weights are left whole. Raises ModelFileError naming the
    entry."""
    names = [name for name, _ in model.named_modules() if name]
    modules = dict(model.named_modules())
    tied = _tied_names(model)
    constraints: dict[str, int] = {}
    left_whole: list[str] = []
    for glob, style in styles.items():
        matched = [name for name in names if matches(name, glob)]
        if not matched:
            raise ModelFileError(
                f"tensor-parallel plan entry {glob!r} matches no module of {type(model).__name__}; its modules "
                f"include {', '.join(repr(n) for n in names[:4])} (globs: `*` for one dotted part)"
            )
        for name in matched:
            module = modules[name]
            ties = [other for p in module.parameters(recurse=False) for other in tied.get(id(p), ()) if
                    not other.startswith(name + ".")]
            if ties:
                left_whole.append(f"{name} (its weight is tied to {ties[0]})")
                continue
            size = _sharded_size(module, style, glob)
            if size is not None:
                constraints[f"{glob} {size[0]}"] = size[1]
            parts = name.split(".")
            for holder in (".".join(parts[:i]) for i in range(len(parts), 0, -1)):  # the module and its parents
                for what, heads in _head_counts(modules[holder]).items():
                    constraints.setdefault(what, heads)
    for what, heads in _config_heads(model).items():
        constraints.setdefault(what, heads)
    return TensorParallelPlan(styles=dict(styles), source=source, constraints=constraints,
                              left_whole=tuple(left_whole))


def apply_tp(blocks: BlockModel, start: int, stop: int, plan: TensorParallelPlan, tp_mesh: DeviceMesh) -> AppliedTP:
    """Parallelize the modules of blocks[start:stop] (one pipeline stage) that the plan names, in place, with
    torch's parallelize_module over the 1-D tp mesh: their parameters become DTensors (new Parameter objects: read
    names and build the optimizer after this), and every stage or view holding those modules runs them sharded.

    Call it after the blocks are materialised (and real weights loaded): every tp rank holds the same values, and
    each keeps its own slice of them (no scatter)."""
    from torch.distributed.tensor.parallel import parallelize_module

    inside = [part for name in blocks.names[start:stop] for part in name.split("+")]
    left_whole = {entry.split(" ")[0] for entry in plan.left_whole}
    done: list[str] = []
    partial: list[nn.Parameter] = []
    for name, module in blocks.model.named_modules():
        if not name or name in left_whole or not any(name == b or name.startswith(b + ".") for b in inside):
            continue
        style = next((s for glob, s in plan.styles.items() if matches(name, glob)), None)
        if style is None:
            continue
        if style == PARTIAL_GRADIENT:
            partial.extend(p for p in module.parameters(recurse=False) if p.requires_grad)
            done.append(name)
            continue
        torch_style = to_torch_style(style)
        if torch_style is not None:
            parallelize_module(module, tp_mesh, torch_style)
            done.append(name)
    return AppliedTP(modules=tuple(done), partial_gradients=tuple(partial))


def tp_layer_terms(spec: ModelSpec) -> tuple[TensorParallelLayer, ...]:
    """Per block of the model (as build_model() cuts it), what its plan shards and the collectives torch's styles
    run per micro-batch (costs.TensorParallelLayer), for the profile: () for a model without a plan.

        colwise (output sharded)        backward: an all-reduce of its input's gradient (the input is replicated)
        colwise, output gathered        forward: an all-gather of its output; backward: as colwise
        rowwise, embedding_rowwise      forward: an all-reduce of its output (the partial sums)
        rowwise_split_input             forward: as rowwise; backward: its input's gradient made whole (counted as an
                                        all-reduce)
        torch ColwiseParallel / RowwiseParallel objects likewise; other styles: nothing counted"""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from autotune.costs import TensorParallelLayer
    from autotune.model_file import build_skeleton

    plan, _ = tp_plan_of(spec)
    if plan is None:
        return ()
    skeleton = build_skeleton(spec)
    left_whole = {entry.split(" ")[0] for entry in plan.left_whole}
    modules = [(name, module) for name, module in skeleton.model.named_modules() if name and name not in left_whole]
    terms = []
    for block_name in skeleton.names:
        inside = block_name.split("+")
        sharded = forward = backward = gathers = 0
        for name, module in modules:
            if not any(name == b or name.startswith(b + ".") for b in inside):
                continue
            style = next((s for glob, s in plan.styles.items() if matches(name, glob)), None)
            if style is None or style in ("replicate", PARTIAL_GRADIENT):
                continue
            colwise = style in COLWISE or isinstance(style, ColwiseParallel)
            rowwise = style in ROWWISE or isinstance(style, RowwiseParallel)
            if not (colwise or rowwise):
                continue
            sharded += sum(p.numel() * p.element_size() for p in module.parameters(recurse=False))
            if colwise:
                backward += 1
                output = getattr(style, "output_layouts", None)
                gathered = style in ("colwise_gather_output", "colwise_rep") or isinstance(output, Replicate) or (
                    isinstance(output, tuple) and any(isinstance(o, Replicate) for o in output))
                gathers += int(gathered)
            else:
                forward += 1
                backward += int(style in ("rowwise_split_input", "rowwise_rep"))
        terms.append(TensorParallelLayer(sharded_parameter_bytes=sharded, forward_all_reduces=forward,
                                         backward_all_reduces=backward, forward_all_gathers=gathers))
    return tuple(terms)


def reduce_partial_gradients(applied: AppliedTP, tp_group: Any) -> None:
    """Sum over the tp group the gradients each rank holds only its part of (replicated_with_grad_allreduce); once
    after the whole backward of a step (a sum of accumulated gradients is the accumulated sum)."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    for p in applied.partial_gradients:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        # sharded over dp as well (FSDP2): every tp rank holds the same replica's shard of it
        dist.all_reduce(p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad, group=tp_group)


def to_torch_style(style: Style) -> ParallelStyle | None:
    """torch's ParallelStyle for a style (a copy of a ParallelStyle given as one); None: nothing to apply. Slices are
    taken locally (src_data_rank None): every tp rank holds the same initialised or loaded values."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    result: Any
    if not isinstance(style, str):
        result = copy.copy(style)
    elif style == "colwise":
        result = ColwiseParallel()
    elif style in COLWISE:
        result = ColwiseParallel(output_layouts=Replicate())
    elif style == "rowwise":
        result = RowwiseParallel()
    elif style in ROWWISE:
        result = RowwiseParallel(input_layouts=Replicate())
    else:
        return None
    if hasattr(result, "src_data_rank"):
        result.src_data_rank = None
    return result  # type: ignore[no-any-return]


def full_value(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a DTensor (a collective over its mesh: every rank of it calls this), else the tensor."""
    from torch.distributed.tensor import DTensor

    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def matches(name: str, glob: str) -> bool:
    """A module name against a plan glob, part by dotted part (`layers.*.mlp` matches layers.3.mlp, not
    layers.3.x.mlp), as torch's parallelize_module and transformers' plans match."""
    parts, pattern = name.split("."), glob.split(".")
    return len(parts) == len(pattern) and all(fnmatch.fnmatchcase(p, g) for p, g in zip(parts, pattern))


def _own_plan(model: nn.Module) -> tuple[TensorParallelPlan | None, str]:
    """A Hugging Face model's own plan, as transformers resolved it on the instance, else its config's."""
    name = type(model).__name__
    if not is_transformers_model(model):
        return None, (f"{name} has no tensor-parallel plan: define TP_PLAN = {{'module.glob': 'colwise' | 'rowwise' "
                      f"| ...}} or tp_plan(model) in the model file")
    import transformers

    version = f"transformers {transformers.__version__}"
    styles: dict[str, Any] = dict(getattr(model, "_tp_plan", None) or {})
    where = f"{name}'s own plan ({version})"
    if not styles:
        config = getattr(model, "config", None)
        base = dict(getattr(config, "base_model_tp_plan", None) or {})
        prefix = getattr(model, "base_model_prefix", "")
        if base and prefix and isinstance(getattr(model, prefix, None), nn.Module):
            base = {f"{prefix}.{k}": v for k, v in base.items()}
        styles = {**dict(getattr(type(model), "_tp_plan", None) or {}), **base}
        where = f"{name}'s config base_model_tp_plan ({version})"
    if not styles:
        return None, f"{name} has no tensor-parallel plan in {version} (no base_model_tp_plan in its config)"
    unknown = [(glob, style) for glob, style in styles.items() if style not in STYLE_NAMES]
    if unknown:
        glob, style = unknown[0]
        return None, (f"{name}'s tensor-parallel plan ({version}) shards {glob} with {style!r}, which autotune does "
                      f"not apply (it applies {', '.join(STYLE_NAMES)}); give TP_PLAN in the model file instead")
    try:
        plan = checked_plan(model, styles, source=where)
    except ModelFileError as exc:
        return None, f"{name}'s tensor-parallel plan does not fit the model: {exc}"
    return plan, where


def _check_styles(styles: Any, what: str) -> None:
    from torch.distributed.tensor.parallel import ParallelStyle

    if not isinstance(styles, Mapping) or not styles:
        raise ModelFileError(f"{what} is {describe(styles)}; give a dict of module-name globs to styles, e.g. "
                             f"{{'layers.*.attn.q': 'colwise', 'layers.*.attn.out': 'rowwise'}}")
    for glob, style in styles.items():
        if not isinstance(glob, str) or not (style in STYLE_NAMES or isinstance(style, ParallelStyle)):
            raise ModelFileError(f"{what}[{glob!r}] is {style!r}; use one of {', '.join(STYLE_NAMES)} or a torch "
                                 f"ParallelStyle (ColwiseParallel(), RowwiseParallel(), ...)")


def _sharded_size(module: nn.Module, style: Style, glob: str) -> tuple[str, int] | None:
    """(which dimension, its size) a style shards on a module; None when it shards nothing autotune can see."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    colwise = style in COLWISE or isinstance(style, ColwiseParallel)
    rowwise = style in ROWWISE or isinstance(style, RowwiseParallel)
    if not (colwise or rowwise):
        return None
    if isinstance(module, nn.Linear):
        return ("out_features", module.out_features) if colwise else ("in_features", module.in_features)
    if isinstance(module, nn.Embedding):
        return ("embedding_dim", module.embedding_dim) if colwise else ("num_embeddings", module.num_embeddings)
    if isinstance(style, str):
        raise ModelFileError(f"tensor-parallel plan entry {glob!r} gives {style!r} to a {type(module).__name__}; "
                             f"torch's column- and row-wise styles shard nn.Linear and nn.Embedding only")
    return None


def _head_counts(module: nn.Module) -> dict[str, int]:
    return {what: value for attribute, what in HEAD_ATTRIBUTES.items()
            if isinstance(value := getattr(module, attribute, None), int) and value > 0}


def _config_heads(model: nn.Module) -> dict[str, int]:
    """Head counts of a Hugging Face model's (text) config."""
    config = getattr(model, "config", None)
    if config is None:
        return {}
    text = config.get_text_config() if callable(getattr(config, "get_text_config", None)) else config
    found: dict[str, int] = {}
    for attribute, what in HEAD_ATTRIBUTES.items():
        value = getattr(text, attribute, None)
        if isinstance(value, int) and value > 0:
            found.setdefault(what, value)
    return found


def _tied_names(model: nn.Module) -> dict[int, tuple[str, ...]]:
    """id(parameter) -> its names, for parameters the model holds under more than one name."""
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    return {key: tuple(found) for key, found in names.items() if len(found) > 1}

