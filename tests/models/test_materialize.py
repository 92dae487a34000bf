"""Blocks made real one by one (autotune.models.materialize): a block alone gets exactly the values it has in the
whole model, a tied parameter the same on every holder, the rest stays on the meta device; the model file's
init_weights(module) runs, and a parameter no initialiser writes is filled deterministically."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from autotune.model_file import build_blocks, build_skeleton, load_model_file
from autotune.models.materialize import parameters_on_meta
from tests.conftest import RECIPES

CUSTOM = """
import torch
from torch import nn

class Scaled(nn.Module):  # a parameter of its own and no reset_parameters: no initialiser writes `scale`
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.scale = nn.Parameter(torch.ones(8))
    def forward(self, x):
        return self.linear(x) * self.scale

def build_model():
    return nn.Sequential(Scaled(), Scaled(), Scaled())

def make_batch(batch_size):
    return torch.randn(batch_size, 8), torch.randn(batch_size, 8)

def loss_fn(output, target):
    return nn.functional.mse_loss(output, target)
"""

HOOK = CUSTOM + """
def init_weights(module):
    if hasattr(module, "scale"):
        nn.init.constant_(module.scale, 2.0)
"""


def named(model: nn.Module) -> dict[str, nn.Parameter]:
    return dict(model.named_parameters(remove_duplicate=False))


@pytest.mark.parametrize("recipe", ["mlp", "hf_gpt2", "hf_llama", "hf_bert"])
def test_a_block_alone_gets_its_values_in_the_whole_model(recipe):
    pytest.importorskip("transformers")
    spec = load_model_file(RECIPES / f"{recipe}.py")
    whole = named(build_blocks(spec).model)
    assert all(p.device.type == "cpu" and bool(p.isfinite().all()) for p in whole.values())
    for index in range(spec.n_layers):
        part = build_blocks(spec, only=[index])
        held = {id(p) for p in part.blocks[index].parameters()}
        for name, p in named(part.model).items():
            if id(p) in held:
                torch.testing.assert_close(p, whole[name], rtol=0, atol=0, msg=f"block {index}: {name}")
            else:
                assert p.device.type == "meta", f"block {index} alone made {name} real"


def test_the_tied_weight_is_the_same_on_a_rank_holding_only_the_head():
    pytest.importorskip("transformers")
    spec = load_model_file(RECIPES / "hf_gpt2.py")
    head = build_blocks(spec, only=[spec.n_layers - 1]).model
    embedding = build_blocks(spec, only=[0]).model
    assert head.lm_head.weight is head.transformer.wte.weight
    torch.testing.assert_close(head.lm_head.weight, embedding.transformer.wte.weight, rtol=0, atol=0)
    assert head.transformer.wpe.weight.device.type == "meta"  # the rest of the embedding's group is released
    # the Hugging Face family's own initialiser ran: GPT-2's scaled residual projections, unit norms
    c_proj = embedding.transformer.h[0].attn.c_proj.weight
    assert c_proj.device.type == "meta"
    whole = build_blocks(spec).model
    c_proj_std = float(whole.transformer.h[0].attn.c_proj.weight.detach().std())
    assert c_proj_std < 0.5 * float(whole.transformer.wte.weight.detach().std())
    assert torch.equal(whole.transformer.h[0].ln_1.weight, torch.ones_like(whole.transformer.h[0].ln_1.weight))


def test_parameters_go_to_meta_as_they_are_registered_buffers_stay_and_ties_hold():
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(10, 4)
            self.head = nn.Linear(4, 10, bias=False)
            self.head.weight = self.embed.weight
            self.register_buffer("table", torch.arange(5.0))

    with parameters_on_meta():
        model = Tied()
    assert model.head.weight is model.embed.weight and model.embed.weight.device.type == "meta"
    assert torch.equal(model.table, torch.arange(5.0))
    assert nn.Linear(2, 2).weight.device.type == "cpu"  # the patch is gone


def test_init_weights_hook_runs_and_unwritten_parameters_are_filled_deterministically(tmp_path):
    (tmp_path / "custom.py").write_text(CUSTOM)
    (tmp_path / "hook.py").write_text(HOOK)
    plain = load_model_file(tmp_path / "custom.py")
    first, again = build_blocks(plain).model, build_blocks(plain).model
    scale = first[1].scale
    assert bool(scale.isfinite().all()) and not torch.equal(scale, torch.ones(8))  # normal(0, 0.02), not garbage
    assert float(scale.abs().max()) < 0.2
    assert torch.equal(scale, again[1].scale)
    assert not torch.equal(first[0].scale, first[1].scale)  # each block its own draw
    hooked = build_blocks(load_model_file(tmp_path / "hook.py")).model
    assert torch.equal(hooked[1].scale, torch.full((8,), 2.0))
    torch.testing.assert_close(hooked[1].linear.weight, first[1].linear.weight, rtol=0, atol=0)


def test_the_skeleton_holds_no_parameter_storage():
    spec = load_model_file(RECIPES / "mlp.py")
    skeleton = build_skeleton(spec)
    assert {p.device.type for p in skeleton.model.parameters()} == {"meta"}
