"""Layer roles: the tuned split in transformer blocks, from the config or a LAYER_ROLES hint in the model file."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from autotune.exports.roles import StageLayers, layer_plan, model_file_hints
from autotune.schedules import Schedule
from tests.conftest import RECIPES
from tests.unit.test_exports import make_config


def test_roles_from_the_config() -> None:
    config = dataclasses.replace(make_config(), layer_roles=("embedding", *["block"] * 8, "head"))
    plan = layer_plan(config)
    assert (plan.source, plan.blocks, plan.block_split) == ("config", 8, [2, 2, 2, 2])
    assert plan.stages[0] == StageLayers(embedding=True, blocks=2, head=False)
    assert plan.stages[-1] == StageLayers(embedding=False, blocks=2, head=True)
    assert "1 embedding, 8 transformer blocks, 1 head, 0 other" in plan.describe()


def test_config_roles_win_over_the_model_file() -> None:
    config = dataclasses.replace(make_config(), layer_roles=("other", "embedding", *["block"] * 7, "head"))
    plan = layer_plan(config, ("embedding", *["block"] * 8, "head"))
    assert plan.source == "config" and plan.block_split == [1, 2, 2, 2]  # the leading "other" counts as input side


def test_unknown_roles_count_every_layer() -> None:
    plan = layer_plan(make_config())
    assert not plan.known and plan.blocks == 10 and plan.block_split == [3, 2, 2, 3]
    assert "every layer counts as a transformer block" in plan.describe()
    assert not layer_plan(make_config(), ("embedding", "block", "head")).known  # a hint for another model: ignored
    assert not layer_plan(make_config(), ("other",) * 10).known  # no transformer block at all


def test_a_non_block_between_blocks_is_a_problem() -> None:
    roles = ("embedding", "block", "block", "other", *["block"] * 5, "head")
    plan = layer_plan(dataclasses.replace(make_config(), layer_roles=roles))
    assert plan.blocks == 8 and plan.problems == (
        "layer 3 (other) sits between transformer blocks; it is counted as a transformer block",
    )


def test_embedding_and_head_alone_on_a_stage() -> None:
    config = make_config(Schedule.ONE_F_ONE_B, (1, 4, 4, 1))
    plan = layer_plan(dataclasses.replace(config, layer_roles=("embedding", *["block"] * 8, "head")))
    assert plan.block_split == [0, 4, 4, 0]


def test_gpt_recipe_hints() -> None:
    hints = model_file_hints(RECIPES / "gpt.py")
    assert hints == {"layer_roles": ("embedding", *["block"] * 6, "head"), "seq_len": 32}
    assert model_file_hints(RECIPES / "mlp.py") == {}


@pytest.mark.parametrize(
    ("source", "roles"),
    [
        ('LAYER_ROLES = ["embedding", "block", "head"]', ("embedding", "block", "head")),
        ("N = 2\nLAYER_ROLES = ['embedding'] + N * ['block'] + ['head']", ("embedding", "block", "block", "head")),
        ("LAYER_ROLES = ('block',) * 3", ("block", "block", "block")),
        ("LAYER_ROLES = ['embedding', 'layer']", None),  # not a role
        ("LAYER_ROLES = build_roles()", None),  # never run
        ("LAYER_ROLES = ['block'] * 10**9", None),  # not built
        ("LAYER_ROLES = ['block'] * 10000000", None),
        ("def broken(:", None),
    ],
)
def test_model_file_roles_are_read_not_run(tmp_path: Path, source: str, roles: tuple[str, ...] | None) -> None:
    path = tmp_path / "model.py"
    path.write_text(source + "\n")
    assert model_file_hints(path).get("layer_roles") == roles
