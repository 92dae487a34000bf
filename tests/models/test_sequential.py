"""The sequential path keeps today's behaviour; checks name the layer; model-file split-point hooks."""

from __future__ import annotations

import types

import pytest
import torch
from torch import nn

from autotune.errors import ModelFileError
from autotune.models import check_blocks, cut_model, split_points_from
from autotune.models.cut import parse_split_at
from tests.models.helpers import assert_cuts_match


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Linear(16, 4))


def test_children_are_the_blocks_and_a_stage_is_a_sequential_of_them() -> None:
    net = mlp()
    model = cut_model(net)
    assert model.family == "sequential"
    assert model.blocks == tuple(net)
    assert model.names == ("0", "1", "2", "3")
    assert model.block_types == ("Linear", "Tanh", "Linear", "Linear")
    stage = model.stage(1, 3)
    assert type(stage) is nn.Sequential and list(stage) == [net[1], net[2]]
    assert model.split_inputs(torch.ones(2, 8))[1] == {}
    assert model.parameter_bytes() == (4 * (8 * 16 + 16), 0, 4 * (16 * 16 + 16), 4 * (16 * 4 + 4))
    assert_cuts_match(model, torch.randn(3, 8), nn.functional.mse_loss, torch.randn(3, 4))


def test_a_list_of_modules_is_a_sequential() -> None:
    assert cut_model([nn.Linear(2, 2), nn.ReLU()]).family == "sequential"


def test_a_sequential_takes_one_tensor() -> None:
    model = cut_model(mlp())
    with pytest.raises(ModelFileError, match="an nn.Sequential takes one tensor"):
        model.split_inputs({"x": torch.ones(2, 8), "mask": torch.ones(2, 8)})


def test_not_a_module() -> None:
    with pytest.raises(ModelFileError, match="build_model\\(\\) returned a dict.*return an nn.Module"):
        cut_model({"a": 1})


def test_stage_bounds_are_checked() -> None:
    with pytest.raises(ValueError, match="0 <= start < stop <= 4"):
        cut_model(mlp()).stage(2, 2)


def test_inputs_must_share_the_batch_dimension() -> None:
    model = cut_model(nn.Sequential(nn.Linear(8, 4)))
    with pytest.raises(ModelFileError, match="batch as dim 0"):
        model.split_inputs(torch.tensor(3.0))


class ReturnsTuple(nn.Module):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x, x.sum(-1)


class ReturnsDict(nn.Module):
    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"last_hidden_state": x}


class ReturnsNone(nn.Module):
    def forward(self, x: torch.Tensor) -> None:
        return None


@pytest.mark.parametrize(
    ("layer", "said"),
    [
        (ReturnsTuple(), r"block 1 \(1, ReturnsTuple\) returned a tuple of 2 \(a torch.float32 tensor of shape "
                         r"\(2, 8\), .*\); in an nn.Sequential the next layer gets it as one argument"),
        (ReturnsDict(), r"block 1 \(1, ReturnsDict\) returned a dict with keys \(last_hidden_state\), which cannot "
                        r"cross a pipeline stage .*`.last_hidden_state`"),
        (ReturnsNone(), r"block 1 \(1, ReturnsNone\) returned None, which cannot cross a pipeline stage .*return "
                        r"the tensor the next layer takes"),
    ],
)
def test_a_layer_whose_output_cannot_cross_a_stage_is_named(layer: nn.Module, said: str) -> None:
    model = cut_model(nn.Sequential(nn.Linear(8, 8), layer, nn.Linear(8, 2)))
    with pytest.raises(ModelFileError, match=said) as info:
        check_blocks(model, torch.randn(5, 8))
    assert "\n" not in str(info.value)


def test_a_layer_that_raises_is_named() -> None:
    model = cut_model(nn.Sequential(nn.Linear(8, 8), nn.Linear(3, 2)))
    with pytest.raises(ModelFileError, match=r"block 1 \(1, Linear\) raised RuntimeError: mat1 and mat2"):
        check_blocks(model, torch.randn(5, 8))


def test_check_blocks_runs_two_rows() -> None:
    assert check_blocks(cut_model(mlp()), torch.randn(7, 8)).shape == (2, 4)


def test_split_points_from_the_model_file() -> None:
    net = mlp()
    assert split_points_from(types.ModuleType("m"), net) is None
    assert split_points_from(types.SimpleNamespace(SPLIT_AT=["0", "2"]), net) == ["0", "2"]  # type: ignore[arg-type]
    assert split_points_from(types.SimpleNamespace(SPLIT_AT="a.*, b"), net) == ["a.*", "b"]  # type: ignore[arg-type]
    hook = types.SimpleNamespace(split_points=lambda model: [f"{len(model) - 1}"])
    assert split_points_from(hook, net) == ["3"]  # type: ignore[arg-type]
    with pytest.raises(ModelFileError, match="both SPLIT_AT and split_points"):
        split_points_from(types.SimpleNamespace(SPLIT_AT=["a"], split_points=lambda m: []), net)  # type: ignore[arg-type]
    with pytest.raises(ModelFileError, match="SPLIT_AT is an int; give a list of module names"):
        split_points_from(types.SimpleNamespace(SPLIT_AT=3), net)  # type: ignore[arg-type]
    with pytest.raises(ModelFileError, match="split_points\\(model\\) raised ZeroDivisionError"):
        split_points_from(types.SimpleNamespace(split_points=lambda m: 1 / 0), net)  # type: ignore[arg-type]
    assert parse_split_at("model.layers.*, lm_head") == ["model.layers.*", "lm_head"]


def test_split_at_on_a_sequential_traces_it() -> None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8)), nn.Linear(8, 2))
    model = cut_model(net, split_at=["1.*"])
    assert model.family == "traced"
    assert model.names == ("0", "1.0", "1.1", "1.2", "2")
    assert_cuts_match(model, torch.randn(3, 4), nn.functional.mse_loss, torch.randn(3, 2))
