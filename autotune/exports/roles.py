"""Which layers are embedding, transformer blocks and head: what Megatron-LM and torchtitan count their splits in.

Megatron's --num-layers and torchtitan's layer counts are transformer blocks only; the embedding and the head sit
on the first and last stage on top of them. autotune's layers_per_stage counts every layer of the model, so an
export needs to know which is which. The roles come from the config's `layer_roles` (written for real models),
else from a `LAYER_ROLES` list in the model file (read without running it), else they are unknown and the exports
say what they assume.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from autotune.tuned_config import LAYER_ROLES, LayerRole, TunedConfig


@dataclass(frozen=True, kw_only=True)
class StageLayers:
    """One stage's layers as a transformer trainer sees them."""

    embedding: bool
    """The stage holds the input side (embedding and whatever precedes the first block)."""
    blocks: int
    """Transformer blocks on the stage."""
    head: bool
    """The stage holds the output side (final norm, head, whatever follows the last block)."""


@dataclass(frozen=True, kw_only=True)
class LayerPlan:
    """The tuned split in transformer terms."""

    source: str
    """Where the roles came from: "config", "model file" or "unknown"."""
    roles: tuple[LayerRole, ...] | None
    """One role per layer; None when unknown."""
    stages: tuple[StageLayers, ...]
    """Per stage, in model order. Unknown roles: every layer counts as a block, no stage has embedding or head."""
    blocks: int
    """Transformer blocks in the whole model (every layer when roles are unknown)."""
    problems: tuple[str, ...] = ()
    """What in the roles a transformer trainer cannot mirror (a non-block layer between blocks, ...)."""

    @property
    def known(self) -> bool:
        return self.roles is not None

    @property
    def block_split(self) -> list[int]:
        return [s.blocks for s in self.stages]

    def describe(self) -> str:
        if self.roles is None:
            return (
                "unknown (no layer_roles in the config, no LAYER_ROLES in the model file), so every layer counts "
                "as a transformer block"
            )
        head = self.roles.count("head")
        return (
            f"from the {self.source}: {self.roles.count('embedding')} embedding, {self.blocks} transformer blocks, "
            f"{head} head, {self.roles.count('other')} other; transformer blocks per stage {self.block_split}"
        )


def layer_plan(config: TunedConfig, model_roles: tuple[LayerRole, ...] | None = None) -> LayerPlan:
    """The split in transformer terms, from the config's roles, else `model_roles`, else every layer a block."""
    split = list(config.layers_per_stage)
    roles, source = (config.layer_roles, "config") if config.layer_roles is not None else (model_roles, "model file")
    if roles is not None and len(roles) != config.model_layers:
        roles = None  # a model file whose LAYER_ROLES does not fit the tuned model: ignored, not guessed at
    if roles is None or "block" not in roles:
        stages = tuple(StageLayers(embedding=False, blocks=n, head=False) for n in split)
        return LayerPlan(source="unknown", roles=None, stages=stages, blocks=config.model_layers)
    first = roles.index("block")
    last = len(roles) - 1 - roles[::-1].index("block")
    problems = [
        f"layer {i} ({role}) sits between transformer blocks; it is counted as a transformer block"
        for i, role in enumerate(roles)
        if first < i < last and role != "block"
    ]
    per_stage: list[StageLayers] = []
    start = 0
    for n in split:
        layers = range(start, start + n)
        per_stage.append(
            StageLayers(
                embedding=any(i < first for i in layers),
                blocks=sum(1 for i in layers if first <= i <= last),
                head=any(i > last for i in layers),
            )
        )
        start += n
    stages = tuple(per_stage)
    if sum(s.embedding for s in stages) > 1:
        problems.append("the layers before the first block span several stages; they count as the first stage's")
    if sum(s.head for s in stages) > 1:
        problems.append("the layers after the last block span several stages; they count as the last stage's")
    return LayerPlan(
        source=source, roles=tuple(roles), stages=stages, blocks=last - first + 1, problems=tuple(problems)
    )


def model_file_hints(path: Path) -> dict[str, Any]:
    """LAYER_ROLES and SEQ_LEN from a model file, read from its syntax tree without running it; {} when absent.

    LAYER_ROLES may be a list literal or one built with + and * from lists and the file's integer constants:
    `LAYER_ROLES = ["embedding"] + ["block"] * N_BLOCKS + ["head"]`.
    """
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    except (OSError, UnicodeDecodeError, SyntaxError, ValueError):
        return {}
    constants: dict[str, Any] = {}
    hints: dict[str, Any] = {}
    for node in tree.body:
        if not (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)):
            continue
        name = node.targets[0].id
        try:
            value = _evaluate(node.value, constants)
        except ValueError:
            continue
        constants[name] = value
        if name == "LAYER_ROLES" and isinstance(value, list) and all(v in LAYER_ROLES for v in value):
            hints["layer_roles"] = tuple(value)
        if name == "SEQ_LEN" and isinstance(value, int) and not isinstance(value, bool) and value > 0:
            hints["seq_len"] = value
    return hints


def _evaluate(node: ast.expr, constants: dict[str, Any]) -> Any:
    """Literals, names bound earlier in the file, and + / * between them; anything else is ValueError."""
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, str)):
        return node.value
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_evaluate(item, constants) for item in node.elts]
    if isinstance(node, ast.Name) and node.id in constants:
        return constants[node.id]
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
        left, right = _evaluate(node.left, constants), _evaluate(node.right, constants)
        if isinstance(node.op, ast.Mult) and isinstance(left, int) and not isinstance(left, bool):
            left, right = right, left  # 3 * ["block"] -> ["block"] * 3
        if isinstance(node.op, ast.Mult) and isinstance(left, (list, str)):
            if not isinstance(right, int) or isinstance(right, bool) or not 0 <= right * max(len(left), 1) <= 100_000:
                raise ValueError("not a short list")
        try:
            return left + right if isinstance(node.op, ast.Add) else left * right
        except TypeError:
            raise ValueError("not a constant expression") from None
    raise ValueError("not a constant expression")
