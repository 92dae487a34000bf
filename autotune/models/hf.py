"""Hugging Face decoder-only language models (LlamaForCausalLM, Qwen2, Mistral, GPT-2 and other *ForCausalLM of the
same shape) cut at their decoder layers: the embedding, each layer, and the final norm with the LM head as blocks.

Nothing of the model's forward is rewritten here. Each stage runs the base model's own forward on a view (see
views.py) to get what its layers need:

    embedding block   base.forward(input_ids, **side) on a view whose layer 0 stops it: the hidden state layer 0
                      would get (token + position embeddings, dropout, scaling: whatever this model does)
    context, once     base.forward(inputs_embeds=<the stage's first hidden state>, **side) on a view whose layers
    per stage         record their arguments: the causal / sliding-window / padding mask, position ids, rotary
                      cos/sin, exactly as the model computes them (create_causal_mask, its rotary module, its
                      layer_types); embeddings there stand as zeros, dropout as identity, and the view stops after
                      the stage's last layer
    layer block       layer(hidden, *recorded args, **recorded kwargs)
    head block        final norm, then the top model's own forward on a view whose base model returns that hidden
                      state: logits (with any slicing or soft-capping the model does)

Side inputs (attention_mask, position_ids, token_type_ids) reach every stage as keyword arguments.

BERT-style encoders (BertForSequenceClassification, RobertaForMaskedLM, DistilBERT, ...; recognise_encoder) are cut
the same way, their layers one level down (`bert.encoder.layer`) and no final norm. Their base model makes the
attention mask from its embeddings' output and pools the last hidden state, so the context and the head run it
with `inputs_embeds` = the stage's hidden state and the embeddings standing aside (EmbeddedInput):

    embedding block   base.forward(input_ids, **side), stopped at layer 0
    context           base.forward(inputs_embeds=hidden, **side), layers recorded, stopped after the stage's last
    head block        top.forward(inputs_embeds=hidden, **side) with every layer passing the state through: the
                      pooler, classifier or MLM head as the model runs them, its logits
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from autotune.errors import ModelFileError
from autotune.models.blocks import BlockModel, Role, StageInputs, bind_inputs
from autotune.models.handoff import handoff
from autotune.models.views import Absent, Passthrough, Recorder, Stop, Zero, stand_in_layers, view

LAYER_LISTS = ("layers", "h", "blocks", "layer")
"""Names of the base model's ModuleList of decoder layers, by convention."""
FINAL_NORMS = ("norm", "ln_f", "final_layernorm", "final_layer_norm", "norm_f")
"""Names of the base model's final norm, by convention."""


@dataclass(frozen=True, kw_only=True)
class Anatomy:
    """Where the parts of a Hugging Face *ForCausalLM sit."""

    top: nn.Module
    """The *ForCausalLM model."""
    base_path: tuple[str, ...]
    """Attributes from top to the module holding the layers: ("model",), ("transformer",), OPT's
    ("model", "decoder")."""
    layers_name: str
    """Attribute of the decoder layers' ModuleList in the base model."""
    norm_name: str
    """Attribute of the final norm in the base model."""
    head_name: str
    """Attribute of the LM head in top ("lm_head")."""

    @property
    def base_name(self) -> str:
        return ".".join(self.base_path)

    @property
    def base(self) -> nn.Module:
        return self.top.get_submodule(self.base_name)

    @property
    def layers(self) -> nn.ModuleList:
        return getattr(self.base, self.layers_name)


def recognise(model: nn.Module) -> Anatomy | None:
    """The anatomy of a Hugging Face decoder-only LM, found by class and attribute shape (transformers is not
    imported); None when the model is not one."""
    if not is_transformers_model(model):
        return None
    prefix = getattr(model, "base_model_prefix", "")
    base = getattr(model, prefix, None) if prefix else None
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    if not isinstance(base, nn.Module) or not isinstance(head, nn.Module):
        return None
    head_name = next((name for name, child in model.named_children() if child is head), None)
    # transformers' own pipeline plan names the base model's parts in order (embed_tokens, layers, norm) for
    # 119 model families in 5.x; the conventional names cover the others (GPT-2: h, ln_f).
    plan = list(getattr(getattr(model, "config", None), "base_model_pp_plan", None) or ())
    path: tuple[str, ...] = (prefix,)
    layers_name = _layer_list(base, plan)
    if layers_name is None:  # one level down (OPT: model.decoder.layers)
        inner = [(name, child) for name, child in base.named_children() if _layer_list(child, plan) is not None]
        if len(inner) != 1:
            return None
        path, base = (prefix, inner[0][0]), inner[0][1]
        layers_name = _layer_list(base, plan)
    after = plan[plan.index(layers_name) + 1 :] if layers_name in plan else []
    norm_name = next((name for name in [*after, *FINAL_NORMS] if isinstance(getattr(base, name, None), nn.Module)),
                     None)
    if head_name is None or layers_name is None or norm_name is None:
        return None
    if "inputs_embeds" not in inspect.signature(base.forward).parameters:
        return None
    return Anatomy(top=model, base_path=path, layers_name=layers_name, norm_name=norm_name, head_name=head_name)


def is_transformers_model(model: nn.Module) -> bool:
    return any(cls.__module__.startswith("transformers.") for cls in type(model).__mro__)


def _layer_list(base: nn.Module, plan: list[str]) -> str | None:
    return next(
        (name for name in [*plan, *LAYER_LISTS]
         if isinstance(getattr(base, name, None), nn.ModuleList) and len(getattr(base, name))),
        None,
    )


def cut_hf(anatomy: Anatomy) -> BlockModel:
    blocks = (decoder_embedding(anatomy), *(Layer(layer, i) for i, layer in enumerate(anatomy.layers)), Head(anatomy))
    cutter = HFCutter(anatomy.top, blocks, context=lambda: decoder_context(anatomy))
    base, n = anatomy.base_name, len(anatomy.layers)
    embedding_names = "+".join(
        f"{base}.{name}" for name, child in anatomy.base.named_children()
        if name not in (anatomy.layers_name, anatomy.norm_name) and any(True for _ in child.parameters())
    )
    names = (
        embedding_names or f"{base}.embeddings",
        *(f"{base}.{anatomy.layers_name}.{i}" for i in range(n)),
        f"{base}.{anatomy.norm_name}+{anatomy.head_name}",
    )
    block: Role = "block"
    roles: tuple[Role, ...] = ("embedding", *((block,) * n), "head")
    return BlockModel(
        family="hf-gpt2" if type(anatomy.top).__name__.startswith("GPT2") else "hf-decoder",
        model=anatomy.top,
        blocks=cutter.blocks,
        names=names,
        roles=roles,
        cutter=cutter,
    )


class HFCutter:
    """Blocks and stages of one Hugging Face model: its embedding block, one block per layer, its head block, and
    for each stage with layers a context (what those layers are called with, from the model's own forward)."""

    def __init__(self, top: nn.Module, blocks: tuple[nn.Module, ...], *, context: Callable[[], nn.Module]) -> None:
        self.top = top
        self.blocks = blocks
        self.n_layers = len(blocks) - 2
        self.context = context

    def split_inputs(self, inputs: Any) -> StageInputs:
        bound = bind_inputs(self.top.forward, inputs, what=type(self.top).__name__)
        if "labels" in bound:
            raise ModelFileError(
                "make_batch's inputs hold 'labels': return them as the targets (make_batch returns (inputs, "
                "targets)) and compute the loss in loss_fn(logits, targets)"
            )
        if "input_ids" not in bound:
            raise ModelFileError(
                f"make_batch's inputs for {type(self.top).__name__} need 'input_ids' (got "
                f"{', '.join(bound) or 'nothing'}); return a dict {{'input_ids': ..., 'attention_mask': ...}}"
            )
        ids = bound.pop("input_ids")
        return (ids,), bound

    def stage(self, start: int, stop: int) -> nn.Module:
        first_layer, last_layer = max(start, 1) - 1, min(stop - 1, self.n_layers) - 1
        context = self.context() if first_layer <= last_layer else None
        module = Stage(self.blocks[start:stop], context=context, layers=(first_layer, last_layer))
        return module.train(self.top.training)

    def reference(self, inputs: Any) -> torch.Tensor:
        bound = bind_inputs(self.top.forward, inputs, what=type(self.top).__name__)
        return self.top(**bound).logits


class StageContext:
    """One forward of one stage: its side inputs and, computed once on first use, what its layers are called with."""

    def __init__(self, provider: nn.Module | None, side: dict[str, Any], layers: tuple[int, int]) -> None:
        self.provider, self.side, self.layers = provider, side, layers
        self.calls: dict[int, Any] | None = None

    def layer_call(self, index: int, hidden: torch.Tensor) -> Any:
        if self.calls is None:
            if self.provider is None:
                raise RuntimeError("a stage without decoder layers was asked for a layer's inputs")
            self.calls = self.provider(hidden, self.side, first=self.layers[0], last=self.layers[1])
        return self.calls[index]


class Stage(nn.Module):
    """blocks[start:stop] of a Hugging Face decoder LM, run in turn on one hidden state."""

    def __init__(self, blocks: tuple[nn.Module, ...], *, context: nn.Module | None, layers: tuple[int, int]) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(blocks)
        self.context = context
        self.layers = layers

    def forward(self, *carried: torch.Tensor, **side: torch.Tensor) -> torch.Tensor:
        ctx = StageContext(self.context, side, self.layers)
        (x,) = carried
        for block in self.blocks:
            x = block(x, context=ctx)
        return handoff(x, carried)


def _fixed_kwargs(base: nn.Module) -> dict[str, Any]:
    """No KV cache in training (the model's own forward builds one by default)."""
    return {"use_cache": False} if "use_cache" in inspect.signature(base.forward).parameters else {}


class Embedding(nn.Module):
    """The base model's forward up to its first layer: what layer 0 gets (`base`: a view of it whose layers stop
    the forward at layer 0)."""

    def __init__(self, base: nn.Module, recorder: Recorder, fixed: dict[str, Any]) -> None:
        super().__init__()
        self.base, self.recorder, self.fixed = base, recorder, fixed

    def forward(self, input_ids: torch.Tensor, *, context: StageContext) -> torch.Tensor:
        self.recorder.reset(stop_at=0)
        try:
            self.base(input_ids=input_ids, **context.side, **self.fixed)
        except Stop as stop:
            return stop.value
        raise ModelFileError(f"{type(self.base).__name__}.forward never called its first layer")


def decoder_embedding(anatomy: Anatomy) -> Embedding:
    """A decoder's embedding block: its base model without the final norm (and any direct parameters kept)."""
    recorder = Recorder()
    base = view(
        anatomy.base,
        replace={
            anatomy.layers_name: stand_in_layers(anatomy.layers, recorder),
            anatomy.norm_name: Absent(anatomy.norm_name, "the embedding stops at the first layer"),
        },
        keep_parameters=True,
    )
    return Embedding(base, recorder, _fixed_kwargs(anatomy.base))


class Context(nn.Module):
    """What each layer of a stage is called with, recorded from the base model's own forward on the stage's first
    hidden state (`base`: a view of it whose layers record their calls and stop after the stage's last); run once
    per stage forward, without gradients. No parameters of its own."""

    def __init__(self, base: nn.Module, recorder: Recorder, fixed: dict[str, Any]) -> None:
        super().__init__()
        self.base, self.recorder, self.fixed = base, recorder, fixed

    def forward(self, hidden: torch.Tensor, side: dict[str, Any], *, first: int, last: int) -> dict[int, Any]:
        self.recorder.reset(first=first, last=last)
        with torch.no_grad():
            try:
                self.base(inputs_embeds=hidden.detach(), **side, **self.fixed)
            except Stop:
                return self.recorder.calls
        raise ModelFileError(f"{type(self.base).__name__}.forward never called layer {last}")


def decoder_context(anatomy: Anatomy) -> Context:
    """A decoder's context: its base model with embeddings and norms standing as zeros, dropout as identity (the
    masks, position ids and rotary embeddings come out as the model computes them)."""
    recorder = Recorder()
    base = anatomy.base
    replace: dict[str, nn.Module] = {anatomy.layers_name: stand_in_layers(anatomy.layers, recorder)}
    for name, child in base.named_children():
        if name in replace:
            continue
        if name == anatomy.norm_name:
            replace[name] = Absent(name, "the context stops after the stage's last layer")
        elif any(True for _ in child.parameters()):
            replace[name] = Zero(embedding=isinstance(child, nn.Embedding))
        elif isinstance(child, nn.modules.dropout._DropoutNd):
            replace[name] = Passthrough()
    return Context(view(base, replace=replace, keep_parameters=False), recorder, _fixed_kwargs(base))


class Layer(nn.Module):
    """One decoder layer, called as the model's forward calls it."""

    def __init__(self, layer: nn.Module, index: int) -> None:
        super().__init__()
        self.layer = layer
        self.index = index

    def forward(self, hidden: torch.Tensor, *, context: StageContext) -> torch.Tensor:
        call = context.layer_call(self.index, hidden)
        out = self.layer(hidden, *call.args, **call.kwargs)
        return out[0] if isinstance(out, tuple) else out  # transformers 4.x layers return (hidden, ...)


class _HiddenState(nn.Module):
    """Stands for the base model in the top model's forward: returns the hidden state it is given."""

    def __init__(self) -> None:
        super().__init__()
        self.hidden: torch.Tensor | None = None

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return _BaseOutput(self.hidden)


class _BaseOutput:
    """A base model's output as the top model reads it: `.last_hidden_state` or `[0]`; other fields are None."""

    def __init__(self, hidden: torch.Tensor | None) -> None:
        self.last_hidden_state = hidden

    def __getitem__(self, key: int | str) -> Any:
        if key in (0, "last_hidden_state"):
            return self.last_hidden_state
        raise KeyError(key)

    def __getattr__(self, name: str) -> Any:  # past_key_values, hidden_states, attentions, cross_attentions
        return None


class Head(nn.Module):
    """The final norm, then the top model's own forward from the base model's output on: the logits."""

    def __init__(self, anatomy: Anatomy) -> None:
        super().__init__()
        self.norm = getattr(anatomy.base, anatomy.norm_name)
        self.source = _HiddenState()
        self.top = _with_stand_in(anatomy.top, anatomy.base_path, self.source)

    def forward(self, hidden: torch.Tensor, *, context: StageContext) -> torch.Tensor:
        self.source.hidden = self.norm(hidden)
        try:
            return self.top().logits
        finally:
            self.source.hidden = None


def _with_stand_in(top: nn.Module, path: tuple[str, ...], stand_in: nn.Module) -> nn.Module:
    """A view of top whose module at `path` is `stand_in`; modules between keep no parameters and no other
    children (OPTModel between OPTForCausalLM and its decoder)."""
    if len(path) == 1:
        return view(top, replace={path[0]: stand_in}, keep_parameters=True)
    middle = getattr(top, path[0])
    replace: dict[str, nn.Module] = {
        name: Absent(f"{path[0]}.{name}", "only the base model's output is read") for name in middle._modules
    }
    replace[path[1]] = stand_in
    inner = view(middle, replace=replace, keep_parameters=False) if len(path) == 2 else _with_stand_in(
        middle, path[1:], stand_in)
    return view(top, replace={path[0]: inner}, keep_parameters=True)


# --- encoders: BERT-style models ----------------------------------------------------------------------------------

@dataclass(frozen=True, kw_only=True)
class EncoderAnatomy:
    """Where the parts of a Hugging Face encoder model sit (BertForSequenceClassification, RobertaForMaskedLM,
    DistilBertForTokenClassification, ...): the base model's embeddings, then a container of layers (BERT's
    `encoder.layer`, DistilBERT's `transformer.layer`), then what the base model and the top model do with the last
    hidden state (a pooler, a classifier, an LM head)."""

    top: nn.Module
    """The model build_model() returned."""
    prefix: str
    """Attribute of the base model in top ("bert")."""
    embeddings_name: str
    """Attribute of the embeddings in the base model: its one child with parameters before the layers."""
    container_name: str
    """Attribute of the module holding the layers in the base model ("encoder")."""
    layers_name: str
    """Attribute of the layers' ModuleList in the container ("layer")."""
    after: tuple[str, ...]
    """Module names (in top) of the parts with parameters after the layers: the head block ("bert.pooler",
    "classifier")."""

    @property
    def base(self) -> nn.Module:
        return getattr(self.top, self.prefix)

    @property
    def container(self) -> nn.Module:
        return getattr(self.base, self.container_name)

    @property
    def layers(self) -> nn.ModuleList:
        return getattr(self.container, self.layers_name)


def recognise_encoder(model: nn.Module) -> EncoderAnatomy | None:
    """The anatomy of a Hugging Face encoder model whose base model takes `inputs_embeds`, found by attribute shape;
    None when the model is not one (or has parameters where the stages could not hold them: outside the embeddings,
    the layers and the parts after them)."""
    if not is_transformers_model(model):
        return None
    prefix = getattr(model, "base_model_prefix", "")
    base = getattr(model, prefix, None) if prefix else None
    if not isinstance(base, nn.Module) or base is model:
        return None
    for forward in (model.forward, base.forward):
        accepted = inspect.signature(forward).parameters
        if "inputs_embeds" not in accepted or "input_ids" not in accepted:
            return None
    children = list(base.named_children())
    holding = [i for i, (_, child) in enumerate(children) if _layer_list(child, []) is not None]
    if len(holding) != 1:
        return None
    at = holding[0]
    container_name, container = children[at]
    layers_name = _layer_list(container, [])
    assert layers_name is not None
    if _holds_parameters(container, besides=layers_name):
        return None  # parameters the layers share (DeBERTa's relative embeddings): not cut here
    before = [name for name, child in children[:at] if _has_parameters(child)]
    if len(before) != 1:
        return None
    embeddings_name = before[0]
    if "inputs_embeds" not in inspect.signature(getattr(base, embeddings_name).forward).parameters:
        return None
    if any(True for _ in base.parameters(recurse=False)) or any(True for _ in model.parameters(recurse=False)):
        return None
    after = (
        *(f"{prefix}.{name}" for name, child in children[at + 1 :] if _has_parameters(child)),
        *(name for name, child in model.named_children() if name != prefix and _has_parameters(child)),
    )
    if not after:
        return None
    return EncoderAnatomy(top=model, prefix=prefix, embeddings_name=embeddings_name, container_name=container_name,
                          layers_name=layers_name, after=after)


def _has_parameters(module: nn.Module) -> bool:
    return any(True for _ in module.parameters())


def _holds_parameters(module: nn.Module, *, besides: str) -> bool:
    return any(True for _ in module.parameters(recurse=False)) or any(
        _has_parameters(child) for name, child in module.named_children() if name != besides)


def cut_hf_encoder(anatomy: EncoderAnatomy) -> BlockModel:
    blocks = (encoder_embedding(anatomy), *(Layer(layer, i) for i, layer in enumerate(anatomy.layers)),
              EncoderHead(anatomy))
    cutter = HFCutter(anatomy.top, blocks, context=lambda: encoder_context(anatomy))
    n = len(anatomy.layers)
    layers = f"{anatomy.prefix}.{anatomy.container_name}.{anatomy.layers_name}"
    block: Role = "block"
    return BlockModel(
        family="hf-encoder",
        model=anatomy.top,
        blocks=cutter.blocks,
        names=(f"{anatomy.prefix}.{anatomy.embeddings_name}", *(f"{layers}.{i}" for i in range(n)),
               "+".join(anatomy.after)),
        roles=("embedding", *((block,) * n), "head"),
        cutter=cutter,
    )


class EmbeddedInput(nn.Module):
    """Stands for the embeddings where the base model is given `inputs_embeds`: returns them as they are (the hidden
    state a stage starts from), so the masks the base model makes from them have the right shape."""

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        given = kwargs.get("inputs_embeds")
        if given is None:
            given = next((a for a in reversed(args) if isinstance(a, torch.Tensor) and a.is_floating_point()), None)
        if given is None:
            raise ModelFileError("the base model's forward did not pass inputs_embeds to its embeddings")
        return given


def _encoder_view(anatomy: EncoderAnatomy, *, embeddings: nn.Module, layers: nn.ModuleList,
                  after: nn.Module | None) -> nn.Module:
    """The base model with its embeddings and layers swapped (and its parts after the layers, unless None); it has
    no parameters of its own (recognise_encoder)."""
    container = view(anatomy.container, replace={anatomy.layers_name: layers}, keep_parameters=False)
    replace: dict[str, nn.Module] = {anatomy.embeddings_name: embeddings, anatomy.container_name: container}
    if after is not None:
        for name in anatomy.after:
            if name.startswith(f"{anatomy.prefix}."):
                replace[name.removeprefix(f"{anatomy.prefix}.")] = after
    return view(anatomy.base, replace=replace, keep_parameters=False)


def encoder_embedding(anatomy: EncoderAnatomy) -> Embedding:
    """An encoder's embedding block: its base model with the embeddings alone of its parameters."""
    recorder = Recorder()
    base = _encoder_view(anatomy, embeddings=getattr(anatomy.base, anatomy.embeddings_name),
                         layers=stand_in_layers(anatomy.layers, recorder),
                         after=Absent("the base model's head", "the embedding stops at the first layer"))
    return Embedding(base, recorder, _fixed_kwargs(anatomy.base))


def encoder_context(anatomy: EncoderAnatomy) -> Context:
    """An encoder's context: its base model given the stage's hidden state as inputs_embeds, the embeddings
    standing aside (the attention mask comes out as the model makes it from them)."""
    recorder = Recorder()
    base = _encoder_view(anatomy, embeddings=EmbeddedInput(), layers=stand_in_layers(anatomy.layers, recorder),
                         after=Absent("the base model's head", "the context stops after the stage's last layer"))
    return Context(base, recorder, _fixed_kwargs(anatomy.base))


class EncoderHead(nn.Module):
    """The top model's own forward from the last hidden state on (the base model's pooler, the classifier or LM
    head): the model run on that state as inputs_embeds, its embeddings and layers passing it through."""

    def __init__(self, anatomy: EncoderAnatomy) -> None:
        super().__init__()
        base = _encoder_view(anatomy, embeddings=EmbeddedInput(), layers=stand_in_layers(anatomy.layers, Recorder()),
                             after=None)
        self.top = view(anatomy.top, replace={anatomy.prefix: base}, keep_parameters=False)
        self.fixed = _fixed_kwargs(anatomy.top)

    def forward(self, hidden: torch.Tensor, *, context: StageContext) -> torch.Tensor:
        return self.top(inputs_embeds=hidden, **context.side, **self.fixed).logits
