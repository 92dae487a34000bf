"""The generic cut: trace the model's forward with torch.fx at module boundaries (the blocks stay opaque calls) and
run each block's share of the graph as a module of its own. A stage boundary carries every value made before it and
used after it, so skip connections cross as extra tensors.

    graph        x -> [embed] -> h0 -> [layers.0] -> h1 -> [layers.1] -> h2 -> (+ h0) -> [head] -> out
    segments     |-- 0: prefix --|--- 1: layers.0 ---|----- 2: layers.1 + glue -----|-- 3: head --|
    boundary 2   carries (h0, h1): h1 feeds layers.1, h0 the skip connection after it

Tracing is symbolic (no data runs): milliseconds, the same graph for every micro-batch size, the user's modules
and parameters kept by reference. It fails on Python control flow over traced values outside the blocks; the code
inside a block may do anything.
"""

from __future__ import annotations

import functools
import inspect
import traceback
from collections.abc import Sequence
from typing import Any

from torch import fx, nn

from autotune.errors import ModelFileError
from autotune.models.blocks import BlockModel, Family, Role, StageInputs, bind_inputs
from autotune.models.handoff import handoff

# Node names are the keys of a stage's environment.
_Plan = tuple[tuple[str, ...], tuple[str, ...]]


_MODE_DEPENDENT = (nn.modules.batchnorm._NormBase, nn.modules.dropout._DropoutNd)
"""torch's modules whose forward branches on self.training (batch or running statistics; dropping or not)."""


class _Tracer(fx.Tracer):
    """Traces through the code between the blocks. Besides the blocks and torch.nn's own modules, a module whose
    forward reads self.training stays an opaque call, so that its graph follows .train() / .eval() as the module
    does: tracing through it would fix the branch of the mode the model was in (timm's BatchNormAct2d, a subclass
    of nn.BatchNorm2d outside torch.nn, traced in training mode, kept using batch statistics in eval mode, and
    MobileNetV3 and EfficientNet failed the check against their own forward). Not a module that holds a block."""

    def __init__(self, leaves: set[int], holding_blocks: set[int]) -> None:
        super().__init__()
        self.leaves = leaves
        self.holding_blocks = holding_blocks

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        if id(m) in self.leaves or super().is_leaf_module(m, module_qualified_name):
            return True
        return id(m) not in self.holding_blocks and _reads_training(type(m))


@functools.cache
def _reads_training(cls: type[nn.Module]) -> bool:
    """Whether a module class's forward branches on the training mode (torch's norms and dropouts and their
    subclasses, or a forward whose source reads self.training); once per class, as the source is read from disk."""
    if issubclass(cls, _MODE_DEPENDENT):
        return True
    forward = getattr(cls, "forward", None)
    if forward is None or forward is nn.Module.forward:
        return False
    try:
        return "self.training" in inspect.getsource(forward)
    except (OSError, TypeError):
        return False


def cut_traced(
    model: nn.Module,
    leaves: Sequence[str],
    *,
    input_names: Sequence[str] | None = None,
    family: Family = "traced",
    fix: str = "",
) -> BlockModel:
    """Cut `model` at the modules named in `leaves` (each becomes a block), plus the code before the first (the
    embedding) and after the last (the head) as blocks of their own. `input_names`: the forward's parameters the
    batch provides (default: the first); the others are traced at their default values. `fix`: what the error
    message suggests when the forward cannot be traced."""
    signature = inspect.signature(model.forward)
    params = [p for p in signature.parameters.values()
              if p.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)]
    if not params:
        raise ModelFileError(f"{type(model).__name__}.forward takes no named input; it cannot be cut into stages")
    provided = list(input_names) if input_names else [params[0].name]
    concrete: dict[str, Any] = {}
    for p in params:
        if p.name in provided:
            continue
        if p.default is inspect.Parameter.empty:
            raise ModelFileError(
                f"{type(model).__name__}.forward needs {p.name!r} but make_batch's inputs do not give it; "
                f"return a dict with {', '.join(repr(q.name) for q in params)}"
            )
        concrete[p.name] = p.default
    leaf_modules = [model.get_submodule(name) for name in leaves]
    holding = {id(model)} | {id(model.get_submodule(".".join(name.split(".")[:i])))
                             for name in leaves for i in range(1, name.count(".") + 1)}
    tracer = _Tracer({id(m) for m in leaf_modules}, holding)
    try:
        graph = tracer.trace(model, concrete_args=concrete or None)
    except Exception as exc:  # whatever tracing raises, the user gets one line with the fix
        raise ModelFileError(_trace_failure(model, exc, fix, _summary(leaves))) from exc
    traced = fx.GraphModule(tracer.root, graph, class_name=type(model).__name__)
    plan = _Partition(traced, leaves, main=provided[0], side=provided[1:], concrete=concrete, model=model, fix=fix)
    cutter = TracedCutter(model, plan, provided)
    return BlockModel(
        family=family, model=model, blocks=plan.blocks, names=plan.names, roles=plan.roles, cutter=cutter
    )


def _summary(leaves: Sequence[str]) -> str:
    """'layers.0' .. 'layers.11' -> "layers.*"; otherwise the first few names."""
    parents = {name.rsplit(".", 1)[0] for name in leaves if "." in name}
    if len(parents) == 1 and all("." in name for name in leaves):
        return f"'{parents.pop()}.*'"
    return ", ".join(f"'{name}'" for name in leaves[:4]) + (", ..." if len(leaves) > 4 else "")


def _trace_failure(model: nn.Module, exc: BaseException, fix: str, blocks: str) -> str:
    """One line: where tracing failed (the innermost frame outside torch), why, and the fix that applies there:
    code in a submodule's forward -> make that module a block; code in the model's own forward -> make it
    traceable (the blocks themselves may hold any code)."""
    where, owner = "", None
    for frame, _ in traceback.walk_tb(exc.__traceback__):
        filename = frame.f_code.co_filename
        if "/torch/" in filename or "/autotune/" in filename:
            continue
        where = f" at {filename}:{frame.f_lineno}"
        code = frame.f_code
        self_ = frame.f_locals.get(code.co_varnames[0]) if code.co_argcount else None
        if isinstance(self_, nn.Module):
            owner = next((name for name, m in model.named_modules() if m is self_), None)
    reason = " ".join(str(exc).split())[:160] or type(exc).__name__
    if "co_varnames" in reason:  # torch.fx's own words for a forward(**kwargs) traced with fixed arguments
        reason = "its forward takes **kwargs, which torch.fx cannot trace with some arguments fixed"
    name = type(model).__name__
    if owner:  # inside a submodule: that module can be a block, whose code is never traced
        return (
            f"cannot trace {name}.forward to cut it into stages, in the forward of {owner}{where}: {reason} — make "
            f"{owner} a block (--split-at '{owner}' with the other blocks; a block's own code is not traced), "
            f"or {fix or 'name other blocks with --split-at'}"
        )
    if owner == "":  # the model's own forward: the code between the blocks must trace
        check = "write a size check as torch._assert(condition, message) instead of assert, move branches on values"
        return (
            f"cannot trace {name}.forward to cut it into stages{where}: {reason} — autotune traces the code between "
            f"the blocks with torch.fx, where tensors and their sizes are symbolic: "
            f"{check if 'control flow' in reason else 'change that line, or move it'} into a block's forward (the "
            f"blocks, {blocks}, may hold any code; --split-at names other modules as blocks), or return an "
            f"nn.Sequential from build_model()"
        )
    hint = fix or "name the blocks with --split-at"
    return f"cannot trace {name}.forward to cut it into stages{where}: {reason} — {hint}, or return an nn.Sequential"


class _Partition:
    """The traced graph cut into segments, one per block, with what each segment takes and gives."""

    def __init__(
        self,
        traced: fx.GraphModule,
        leaves: Sequence[str],
        *,
        main: str,
        side: Sequence[str],
        concrete: dict[str, Any],
        model: nn.Module,
        fix: str,
    ) -> None:
        nodes = list(traced.graph.nodes)
        placeholders = [n for n in nodes if n.op == "placeholder"]
        output = next(n for n in nodes if n.op == "output")
        # fx renames the placeholder of a concrete argument ("mask_1"): map by position in the signature instead.
        params = [p.name for p in inspect.signature(model.forward).parameters.values()
                  if p.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)]
        by_param = dict(zip(params, placeholders))
        self.main = by_param[main].name
        self.side = {name: by_param[name].name for name in side}  # input name -> node name
        self.constants = {by_param[name].name: value for name, value in concrete.items() if name in by_param}
        leaf_set = set(leaves)
        calls = [n for n in nodes if n.op == "call_module" and n.target in leaf_set]
        missing = [name for name in leaves if name not in {n.target for n in calls}]
        if missing:
            raise ModelFileError(
                f"{type(model).__name__}.forward never calls {', '.join(missing[:3])} as a module (the blocks to cut "
                f"between must be called by the forward); {fix or 'name other modules with --split-at'}"
            )
        body = [n for n in nodes if n.op not in ("placeholder", "output")]
        segment_of, roles = _assign(body, calls)
        segment_of[output] = len(roles)
        self.roles = tuple(roles)
        self.segments: list[list[fx.Node]] = [[] for _ in roles]
        for n in body:
            self.segments[segment_of[n]].append(n)
        everywhere = {*self.side.values(), *self.constants}
        # A parameter (get_attr) never crosses a boundary: every segment using it reads it itself, so a tied
        # weight is held by each block using it (and reported as shared) instead of travelling as an activation.
        self.io: list[_Plan] = []
        for s, seg in enumerate(self.segments):
            inside = set(seg)
            used = {a for n in seg for a in n.all_input_nodes if a not in inside}
            ins = _ordered({a for a in used if a.op != "get_attr"}, nodes)
            outs = _ordered({n for n in seg if n.op != "get_attr" and any(
                segment_of.get(u, -1) > s for u in n.users)}, nodes)
            self.io.append((tuple(a.name for a in ins), tuple(n.name for n in outs)))
        # What crosses the boundary before segment b: defined before b (the main input included), used at b or later.
        self.live: list[tuple[str, ...]] = [(self.main,)]
        for b in range(1, len(roles) + 1):
            crossing = {
                a for n in nodes if segment_of.get(n, -1) >= b for a in n.all_input_nodes
                if a.op != "get_attr" and a.name not in everywhere and (a.op == "placeholder" or segment_of[a] < b)
            }
            self.live.append(tuple(a.name for a in _ordered(crossing, nodes)))
        self.output_args = output.args[0]
        self.blocks = tuple(_segment_module(traced, seg, self.io[s], s) for s, seg in enumerate(self.segments))
        block_calls = iter(calls)
        self.names = tuple(
            str(next(block_calls).target) if role == "block" else _segment_name(seg, model)
            for role, seg in zip(roles, self.segments)
        )


def _assign(body: list[fx.Node], calls: list[fx.Node]) -> tuple[dict[fx.Node, int], list[Role]]:
    """Segment of each node: code before the first block call is the embedding, each call starts a block that keeps
    the glue after it, code after the last call is the head. The embedding and the head are blocks of their own
    only when they run a module or read a parameter; plain glue (a shape read, an assertion) joins the first or
    last block."""
    first, last = body.index(calls[0]), body.index(calls[-1])
    has_prefix = any(_holds_state(n) for n in body[:first])
    has_suffix = any(_holds_state(n) for n in body[last + 1 :])
    call_set = set(calls)
    roles: list[Role] = ["embedding"] if has_prefix else []
    segment_of: dict[fx.Node, int] = {}
    for i, n in enumerate(body):
        if n in call_set:
            roles.append("block")
        elif i > last and has_suffix and roles[-1] == "block" and not _follows(n, calls[-1]):
            roles.append("head")
        segment_of[n] = max(len(roles) - 1, 0)  # glue before the first call goes with it when there is no prefix
    return segment_of, roles


def _holds_state(node: fx.Node) -> bool:
    return node.op in ("call_module", "get_attr")


def _follows(node: fx.Node, call: fx.Node) -> bool:
    """A getitem of a block's output (`x, attn = layer(x)`) belongs with the block."""
    return node.op == "call_function" and getattr(node.target, "__name__", "") == "getitem" and node.args[0] is call


def _ordered(items: set[fx.Node], nodes: list[fx.Node]) -> list[fx.Node]:
    return [n for n in nodes if n in items]


def _segment_module(traced: fx.GraphModule, seg: list[fx.Node], io: _Plan, index: int) -> fx.GraphModule:
    """A GraphModule computing one segment: inputs as placeholders, the segment's nodes, its outputs returned (one
    value, or a tuple). Submodules and parameters are the traced model's own objects (fx copies references)."""
    ins, outs = io
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    by_name = {n.name: n for n in traced.graph.nodes}
    for name in ins:
        env[by_name[name]] = graph.placeholder(name)
    for n in seg:
        for a in n.all_input_nodes:
            if a.op == "get_attr" and a not in env:  # a parameter read in an earlier segment: read it here too
                env[a] = graph.node_copy(a)
        env[n] = graph.node_copy(n, lambda a: env[a])
    values = [env[by_name[name]] for name in outs]
    graph.output(values[0] if len(values) == 1 else tuple(values))
    return fx.GraphModule(traced, graph, class_name=f"Block{index}")


def _segment_name(seg: list[fx.Node], model: nn.Module) -> str:
    """The modules and parameters a prefix or suffix segment uses, holders of parameters first: "conv1+bn1"."""
    targets = [str(n.target) for n in seg if n.op in ("call_module", "get_attr")]
    holding = [t for t in targets if _holds_parameters(model, t)]
    picked = holding or targets
    if not picked:
        return "(glue)"
    parts = [t.split(".") for t in picked]
    common = 0
    while all(len(p) > common + 1 and p[common] == parts[0][common] for p in parts):
        common += 1
    names = list(dict.fromkeys(".".join(p[: common + 1]) for p in parts))
    return "+".join(names)


def _holds_parameters(model: nn.Module, target: str) -> bool:
    try:
        obj = model.get_submodule(target)
    except AttributeError:
        try:
            return isinstance(model.get_parameter(target), nn.Parameter)
        except AttributeError:
            return False
    return any(True for _ in obj.parameters())


class TracedCutter:
    """Stages of a traced model: its segments run in turn over an environment of named values."""

    def __init__(self, model: nn.Module, plan: _Partition, provided: Sequence[str]) -> None:
        self.model, self.plan, self.provided = model, plan, list(provided)

    def split_inputs(self, inputs: Any) -> StageInputs:
        bound = bind_inputs(self.model.forward, inputs, what=type(self.model).__name__)
        if list(bound) != self.provided:
            raise ModelFileError(
                f"make_batch's inputs give {', '.join(bound)} but the model was cut for {', '.join(self.provided)}; "
                f"cut it with the inputs make_batch returns"
            )
        main = bound.pop(self.provided[0])
        return (main,), bound

    def stage(self, start: int, stop: int) -> nn.Module:
        plan = self.plan
        module = TracedStage(
            plan.blocks[start:stop],
            io=plan.io[start:stop],
            carried=plan.live[start],
            returns=plan.live[stop] if stop < len(plan.blocks) else None,
            output=plan.output_args,
            side=plan.side,
            constants=plan.constants,
        )
        return module.train(self.model.training)

    def reference(self, inputs: Any) -> Any:
        return self.model(**bind_inputs(self.model.forward, inputs, what=type(self.model).__name__))


class TracedStage(nn.Module):
    """Segments [start, stop) of a traced model. forward(*carried, **side): carried are the values crossing the
    boundary before `start`, in graph order; returns those crossing the boundary after `stop - 1` (one tensor or a
    tuple), or the model's own output for the last stage."""

    def __init__(
        self,
        blocks: Sequence[nn.Module],
        *,
        io: Sequence[_Plan],
        carried: tuple[str, ...],
        returns: tuple[str, ...] | None,
        output: Any,
        side: dict[str, str],
        constants: dict[str, Any],
    ) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(blocks)
        self.io = list(io)
        self.carried, self.returns, self.output = carried, returns, output
        self.side, self.constants = side, constants

    def forward(self, *carried: Any, **side: Any) -> Any:
        if len(carried) != len(self.carried):
            raise TypeError(f"this stage takes {len(self.carried)} values ({', '.join(self.carried)}), "
                            f"got {len(carried)}")
        env: dict[str, Any] = dict(self.constants)
        env.update({node: side.get(name) for name, node in self.side.items()})
        env.update(zip(self.carried, carried))
        for block, (ins, outs) in zip(self.blocks, self.io):
            result = block(*(env[name] for name in ins))
            if len(outs) == 1:
                env[outs[0]] = result
            else:
                env.update(zip(outs, result))
        if self.returns is None:
            return fx.node.map_arg(self.output, lambda n: env[n.name])
        return handoff(tuple(env[name] for name in self.returns), carried)
