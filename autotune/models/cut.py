"""cut_model: any nn.Module -> BlockModel. Known families first, then the user's split points, then the repeated
blocks found in the model; the model file's SPLIT_AT / split_points(model) hooks."""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

import torch
import torch.fx
from torch import nn

from autotune.errors import ModelFileError
from autotune.models.blocks import BlockModel, StageInputs, bind_inputs, describe
from autotune.models.hf import cut_hf, cut_hf_encoder, is_transformers_model, recognise_encoder
from autotune.models.hf import recognise as recognise_hf
from autotune.models.traced import cut_traced
from autotune.models.vision import recognise_vision

SPLIT_FIX = "name the modules to cut between: --split-at 'NAME.*' (module names, globs; comma-separated)"


def cut_model(model: Any, *, split_at: Sequence[str] | None = None, inputs: Any = None) -> BlockModel:
    """Cut a model into blocks.

    - An nn.Sequential (or a list of modules) keeps today's behaviour: its children are the blocks.
    - Hugging Face decoder LMs (Llama, Qwen2, Mistral, GPT-2, ...), Hugging Face BERT-style encoders (BERT,
      RoBERTa, DistilBERT, ...), timm VisionTransformer and torchvision ResNet are cut at their repeated blocks,
      embedding and head as blocks of their own; no flag needed.
    - `split_at`: glob patterns over module names ("model.layers.*"); each outermost matching module is a block.
    - Otherwise the repeated blocks found in the model (modules of one class in nn.ModuleList / nn.Sequential).

    `inputs`: make_batch's inputs (a tensor, tuple or dict), or None for "the forward's first argument"; only which
    arguments they give matters (the generic path traces the others at their defaults).

    A block whose first operation changes its input in place (an `nn.ReLU(inplace=True)` child of an nn.Sequential,
    torchvision DenseNet's `features.relu0`) gets it out of place (out_of_place_inputs)."""
    cut = _cut(model, split_at=split_at, inputs=inputs)
    out_of_place_inputs(cut)
    return cut


def out_of_place_inputs(model: BlockModel) -> None:
    """Turn off `inplace` where a block's first operation would change the block's input in place.

    A pipeline stage's input is a leaf tensor that needs its gradient (torch's stage receives it so), and the
    profile times each block on such an input: autograd refuses an in-place operation on it ("a leaf Variable that
    requires grad is being used in an in-place operation"), where the model's own forward, which hands the block a
    tensor computed just before, does not. The result is the same out of place; the block keeps one more tensor
    of its input's size while it runs, which the profile measures. Covered: a block that is such a module, or
    whose traced graph calls one (or a function with inplace=True) on its input."""
    for block in model.blocks:
        _first_op_out_of_place(block)


def _first_op_out_of_place(block: nn.Module) -> bool:
    if getattr(block, "inplace", None) is True:
        block.inplace = False
        return True
    if isinstance(block, nn.Sequential) and len(block) > 0:
        return _first_op_out_of_place(block[0])
    if not isinstance(block, torch.fx.GraphModule):
        return False
    changed = False
    for node in block.graph.nodes:
        if not any(isinstance(arg, torch.fx.Node) and arg.op == "placeholder" for arg in node.args):
            continue
        if node.op == "call_module":
            module = block.get_submodule(node.target)
            if getattr(module, "inplace", None) is True:
                module.inplace = False
                changed = True
        elif node.op == "call_function" and node.kwargs.get("inplace") is True:
            node.kwargs = {**node.kwargs, "inplace": False}
            changed = True
    if changed:
        block.recompile()
    return changed


def _cut(model: Any, *, split_at: Sequence[str] | None, inputs: Any) -> BlockModel:
    if isinstance(model, (list, tuple)) and model and all(isinstance(m, nn.Module) for m in model):
        model = nn.Sequential(*model)
    if not isinstance(model, nn.Module):
        raise ModelFileError(
            f"build_model() returned {describe(model)}; return an nn.Module (a Hugging Face, timm or torchvision "
            f"model as it is, your own module, or an nn.Sequential) — see recipes/hf_llama.py, recipes/hf_gpt2.py, "
            f"recipes/hf_bert.py, recipes/timm_vit.py, recipes/tv_resnet.py"
        )
    patterns = [p for p in (split_at or []) if p.strip()]
    if isinstance(model, nn.Sequential) and not patterns:
        return cut_sequential(model)
    hf = recognise_hf(model)
    encoder = recognise_encoder(model) if hf is None else None
    if patterns:
        leaves = match_split_at(model, patterns)
        if hf is not None and [f"{hf.base_name}.{hf.layers_name}.{i}" for i in range(len(hf.layers))] == leaves:
            return cut_hf(hf)
        if encoder is not None and leaves == [
            f"{encoder.prefix}.{encoder.container_name}.{encoder.layers_name}.{i}" for i in range(len(encoder.layers))
        ]:
            return cut_hf_encoder(encoder)
        return _traced_or_why(model, leaves, inputs, hf_family=hf is not None or encoder is not None)
    if hf is not None:
        return cut_hf(hf)
    if encoder is not None:
        return cut_hf_encoder(encoder)
    vision = recognise_vision(model)
    if vision is not None:
        family, leaves = vision
        return cut_traced(model, leaves, input_names=_input_names(model, inputs), family=family, fix=_fix(model))
    leaves = discover_blocks(model)
    if not leaves:
        raise ModelFileError(
            f"cannot find repeated blocks in {type(model).__name__} (no nn.ModuleList or nn.Sequential of modules "
            f"of one class); {_fix(model)}"
        )
    return _traced_or_why(model, leaves, inputs, hf_family=False)


def _traced_or_why(model: nn.Module, leaves: list[str], inputs: Any, *, hf_family: bool) -> BlockModel:
    fix = _fix(model)
    if is_transformers_model(model):  # its forward takes **kwargs: no --split-at makes it traceable
        name = type(model).__name__
        known = (
            f"leave out --split-at: autotune cuts {name} at its layers by itself"
            if hf_family
            else "autotune cuts Hugging Face decoder-only *ForCausalLM models (embeddings, a list of layers and a "
            "final norm in the base model, then an LM head) and BERT-style encoders (embeddings, then an encoder's "
            "list of layers, then a pooler or head; the base model takes inputs_embeds); for another kind, wrap its "
            "parts in modules of your own"
        )
        fix = f"{name} is a Hugging Face model, whose forward torch.fx cannot trace: {known}"
    try:
        return cut_traced(model, leaves, input_names=_input_names(model, inputs), fix=fix)
    except ModelFileError as exc:
        if fix in str(exc) or not is_transformers_model(model):
            raise
        raise ModelFileError(f"{exc}. {fix}") from exc


def cut_sequential(model: nn.Sequential) -> BlockModel:
    """Today's behaviour: the children are the blocks, a stage is an nn.Sequential of a slice."""
    if len(model) == 0:
        raise ModelFileError("build_model() returned an empty model; return at least one layer")
    names = tuple(model._modules)  # named_children() would drop a module listed twice
    return BlockModel(
        family="sequential",
        model=model,
        blocks=tuple(model),
        names=names,
        roles=tuple("block" for _ in model),
        cutter=_SequentialCutter(model),
    )


class _SequentialCutter:
    def __init__(self, model: nn.Sequential) -> None:
        self.model = model

    def split_inputs(self, inputs: Any) -> StageInputs:
        if isinstance(inputs, torch.Tensor):
            return (inputs,), {}
        if isinstance(inputs, (tuple, list)) and len(inputs) == 1 and isinstance(inputs[0], torch.Tensor):
            return (inputs[0],), {}
        raise ModelFileError(
            f"make_batch returned inputs as {describe(inputs)}, but an nn.Sequential takes one tensor; return one "
            f"tensor, or return a module whose forward takes those inputs"
        )

    def stage(self, start: int, stop: int) -> nn.Module:
        return nn.Sequential(*list(self.model)[start:stop])

    def reference(self, inputs: Any) -> Any:
        (x,), _ = self.split_inputs(inputs)
        return self.model(x)


def match_split_at(model: nn.Module, patterns: Sequence[str]) -> list[str]:
    """Module names matching any glob, outermost only (a match inside another match is dropped), in the order the
    model registers them."""
    names = [name for name, _ in model.named_modules() if name]
    matched = [name for name in names if any(fnmatch.fnmatchcase(name, p.strip()) for p in patterns)]
    unmatched = [p for p in patterns if not any(fnmatch.fnmatchcase(name, p.strip()) for name in names)]
    if unmatched:
        raise ModelFileError(
            f"--split-at {unmatched[0]!r} matches no module of {type(model).__name__}; its modules include "
            f"{_examples(model)}"
        )
    return [name for name in matched if not any(name.startswith(other + ".") for other in matched)]


def discover_blocks(model: nn.Module) -> list[str]:
    """The model's repeated blocks: the children of every nn.ModuleList / nn.Sequential whose children share one
    class, for the class with most such children (ResNet's layer1..layer4 together); failing that, the children of
    the largest nn.Sequential. Empty when fewer than two are found."""
    containers = [
        (name, m) for name, m in model.named_modules()
        if name and isinstance(m, (nn.ModuleList, nn.Sequential)) and len(m) >= 2
    ]
    by_class: dict[type, list[str]] = {}
    for name, container in containers:
        classes = {type(child) for child in container}
        if len(classes) == 1:
            by_class.setdefault(classes.pop(), []).extend(f"{name}.{child}" for child, _ in container.named_children())
    best: list[str] = []
    for blocks in by_class.values():
        outer = [b for b in blocks if not any(b.startswith(o + ".") for o in blocks if o != b)]
        if len(outer) > len(best):
            best = outer
    if len(best) < 2:
        sequentials = [(name, m) for name, m in containers if isinstance(m, nn.Sequential)]
        if sequentials:
            name, seq = max(sequentials, key=lambda item: len(item[1]))
            best = [f"{name}.{child}" for child, _ in seq.named_children()]
    return best if len(best) >= 2 else []


def split_points_from(module: ModuleType, model: nn.Module) -> list[str] | None:
    """The model file's split points: `SPLIT_AT = ["model.layers.*"]` (or a comma-separated string), or
    `def split_points(model) -> list[str]`; None when it has neither. The CLI's --split-at goes before both."""
    constant, function = file_setting(module, "SPLIT_AT", "split_points", "define split_points(model)")
    if function is not None:
        return _as_patterns(_call(function, model), "split_points(model)")
    if constant is not None:
        return _as_patterns(constant, "SPLIT_AT")
    return None


def file_setting(module: ModuleType, constant: str, function: str, fix: str) -> tuple[Any, Callable[..., Any] | None]:
    """A model-file setting given as a constant (SPLIT_AT) or a function of the model (split_points): (the
    constant, the function), at most one of them set; both given, or a function name bound to something not
    callable, is a ModelFileError (fix: how to define the function)."""
    value = getattr(module, constant, None)
    fn = getattr(module, function, None)
    if value is not None and fn is not None:
        raise ModelFileError(f"the model file defines both {constant} and {function}(model); keep one")
    if fn is not None and not callable(fn):
        raise ModelFileError(f"{function} in the model file is not a function; {fix}")
    return value, fn


def parse_split_at(text: str) -> list[str]:
    """The CLI value: comma-separated globs ("model.layers.*,lm_head")."""
    return [p.strip() for p in text.split(",") if p.strip()]


def _as_patterns(value: Any, what: str) -> list[str]:
    if isinstance(value, str):
        return parse_split_at(value)
    if isinstance(value, (list, tuple)) and value and all(isinstance(v, str) for v in value):
        return [v.strip() for v in value if v.strip()]
    raise ModelFileError(f"{what} is {describe(value)}; give a list of module names or globs, e.g. ['model.layers.*']")


def _call(function: Callable[[nn.Module], Any], model: nn.Module) -> Any:
    try:
        return function(model)
    except Exception as exc:  # the user's code can raise anything
        raise ModelFileError(f"split_points(model) raised {type(exc).__name__}: {exc}") from exc


def _input_names(model: nn.Module, inputs: Any) -> list[str] | None:
    if inputs is None:
        return None
    return list(bind_inputs(model.forward, inputs, what=type(model).__name__))


def _fix(model: nn.Module) -> str:
    return f"{SPLIT_FIX}, e.g. {_examples(model)}, or SPLIT_AT = [...] / def split_points(model) in the model file"


def _examples(model: nn.Module, limit: int = 4) -> str:
    """Names a user could pass: containers as 'name.*', else the modules holding most parameters."""
    containers = [f"'{name}.*'" for name, m in model.named_modules()
                  if name and isinstance(m, (nn.ModuleList, nn.Sequential)) and len(m) >= 2]
    if containers:
        return ", ".join(containers[:limit])
    sized = sorted(
        ((sum(p.numel() for p in m.parameters()), name)
         for name, m in model.named_modules() if name and name.count(".") < 2),
        reverse=True,
    )
    return ", ".join(f"'{name}'" for _, name in sized[:limit]) or "(the model has no submodules)"
