"""Where a tensor-parallel plan comes from and which tp degrees it allows (autotune.models.tensor_parallel); applying
it is tested on real ranks in tests/dist/test_tensor_parallel.py."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from torch import nn

from autotune.errors import InvalidCandidateError, ModelFileError
from autotune.model_file import load_model_file
from autotune.models.tensor_parallel import (
    allowed_tp_degrees,
    checked_plan,
    matches,
    max_tensor_parallel,
    plan_for_degree,
    to_torch_style,
    tp_plan_of,
)
from tests.conftest import RECIPES

needs_transformers = pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                                        reason="transformers is not installed")

MODEL = '''
import torch
from torch import nn
{imports}

class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.num_heads = {heads}
        self.up = nn.Linear(16, {wide})
        self.down = nn.Linear({wide}, 16)
        self.conv = nn.Conv1d(16, 16, 1)

    def forward(self, x):
        return x + self.down(torch.tanh(self.up(x)))

{plan}

def build_model():
    return nn.Sequential(nn.Linear(8, 16), Block(), Block(), nn.Linear(16, 4))

def make_batch(batch_size):
    return torch.randn(batch_size, 8), torch.randn(batch_size, 4)

def loss_fn(output, target):
    return nn.functional.mse_loss(output, target)
'''


def model_file(tmp_path: Path, plan: str, *, heads: int = 4, wide: int = 32, imports: str = "") -> Path:
    path = tmp_path / "model.py"
    path.write_text(MODEL.format(plan=plan, heads=heads, wide=wide, imports=imports))
    return path


def llama(**config: int | bool) -> nn.Module:
    import transformers

    sizes = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=8,
                 num_key_value_heads=8)
    with torch.device("meta"):
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**sizes, **config}))


@needs_transformers
def test_the_llama_recipe_uses_its_own_plan_as_transformers_resolves_it():
    import transformers

    plan, source = tp_plan_of(load_model_file(RECIPES / "hf_llama.py"))
    assert plan is not None
    assert source == f"LlamaForCausalLM's own plan (transformers {transformers.__version__})"
    assert plan.styles["model.layers.*.self_attn.q_proj"] == "colwise"
    assert plan.styles["model.layers.*.mlp.down_proj"] == "rowwise"
    assert plan.styles["lm_head"] == "colwise_gather_output"
    # HIDDEN 64, HEADS 4, KV_HEADS 2, INTERMEDIATE 128, VOCAB 512: the key/value heads hold tp to 2
    assert plan.constraints["attention heads"] == 4 and plan.constraints["key/value heads"] == 2
    assert plan.constraints["model.layers.*.mlp.up_proj out_features"] == 128
    assert plan.max_degree == 2 and plan.limit() == "key/value heads (2)"
    assert allowed_tp_degrees(plan, 8) == (1, 2)
    assert allowed_tp_degrees(plan, 1) == (1,)


@needs_transformers
@pytest.mark.parametrize(("config", "most", "limit", "allowed"), [
    ({}, 8, "attention heads (8)", (1, 2, 4)),  # every size divisible by 8; 4 GPUs per node
    ({"num_key_value_heads": 2}, 2, "key/value heads (2)", (1, 2)),
    ({"intermediate_size": 100}, 4, "model.layers.*.mlp.gate_proj out_features (100)", (1, 2, 4)),
    ({"num_attention_heads": 6, "num_key_value_heads": 6, "hidden_size": 48, "vocab_size": 120}, 6,
     "attention heads (6)", (1, 2, 3)),
    ({"num_attention_heads": 6, "num_key_value_heads": 6, "hidden_size": 48}, 2, "attention heads (6)", (1, 2)),
])
def test_tp_must_divide_heads_and_every_sharded_size(config, most, limit, allowed):
    plan, _ = tp_plan_of(llama(**config))
    assert plan is not None
    assert max_tensor_parallel(plan) == plan.max_degree == most
    assert plan.limit() == limit
    assert allowed_tp_degrees(plan, 4) == allowed


@needs_transformers
def test_a_model_without_a_plan_says_why():
    plan, why = tp_plan_of(load_model_file(RECIPES / "hf_gpt2.py"))
    assert plan is None
    assert why.startswith("GPT2LMHeadModel has no tensor-parallel plan in transformers")
    assert max_tensor_parallel(load_model_file(RECIPES / "hf_gpt2.py")) == 1
    plan, why = tp_plan_of(load_model_file(RECIPES / "mlp.py"))
    assert plan is None and "define TP_PLAN" in why


def test_a_degree_the_plan_cannot_take_is_refused_in_one_line(tmp_path):
    """What the runtime and `trial --tensor-parallel` ask before any rank starts: no plan, or a degree a sharded size
    does not divide."""
    with pytest.raises(InvalidCandidateError, match=r"degree 2 needs a tensor-parallel plan: .*TP_PLAN"):
        plan_for_degree(load_model_file(RECIPES / "mlp.py"), 2)
    spec = load_model_file(model_file(tmp_path, 'TP_PLAN = {"*.up": "colwise", "*.down": "rowwise"}', heads=6,
                                      wide=24))
    assert plan_for_degree(spec, 3).max_degree == 6
    with pytest.raises(InvalidCandidateError, match=r"does not divide the attention heads \(6\) of the model file's "
                                                    r"TP_PLAN; use one of 1, 2, 3, 6"):
        plan_for_degree(spec, 4)


@needs_transformers
def test_a_style_autotune_does_not_apply_means_no_tp_and_names_it():
    model = llama()
    model._tp_plan = {**model._tp_plan, "model.layers.*.mlp.gate_proj": "packed_colwise"}
    plan, why = tp_plan_of(model)
    assert plan is None
    assert "model.layers.*.mlp.gate_proj with 'packed_colwise'" in why and "TP_PLAN" in why


@needs_transformers
def test_without_a_resolved_plan_the_configs_is_read_under_the_base_prefix():
    model = llama()
    model._tp_plan = {}
    plan, source = tp_plan_of(model)
    assert plan is not None and source.startswith("LlamaForCausalLM's config base_model_tp_plan")
    assert plan.styles["model.layers.*.self_attn.o_proj"] == "rowwise"
    assert plan.styles["lm_head"] == "colwise_gather_output"  # the class's own plan for the head


@needs_transformers
def test_tied_embedding_and_head_are_left_whole():
    plan, _ = tp_plan_of(llama(tie_word_embeddings=True))
    assert plan is not None
    assert plan.left_whole == ("lm_head (its weight is tied to model.embed_tokens.weight)",
                               "model.embed_tokens (its weight is tied to lm_head.weight)")
    assert "lm_head out_features" not in plan.constraints


def test_a_model_files_tp_plan_comes_first(tmp_path):
    path = model_file(tmp_path, 'TP_PLAN = {"*.up": "colwise", "*.down": RowwiseParallel()}',
                      imports="from torch.distributed.tensor.parallel import RowwiseParallel")
    spec = load_model_file(path)
    plan, source = tp_plan_of(spec)
    assert plan is not None and source == "the model file's TP_PLAN"
    assert plan.constraints == {"*.up out_features": 32, "*.down in_features": 32, "attention heads": 4}
    assert max_tensor_parallel(spec) == 4


def test_tp_plan_function_gets_the_model(tmp_path):
    path = model_file(tmp_path, 'def tp_plan(model):\n    return {f"{len(model) - 3}.up": "colwise"}', wide=24)
    plan, source = tp_plan_of(load_model_file(path))
    assert plan is not None and source == "the model file's tp_plan(model)"
    assert plan.styles == {"1.up": "colwise"} and plan.max_degree == 4  # gcd(24, 4 heads)


@pytest.mark.parametrize(("plan", "message"), [
    ('TP_PLAN = {"*.up": "colwise"}\ndef tp_plan(model):\n    return {}', "defines both TP_PLAN and tp_plan"),
    ('TP_PLAN = {"*.up": "columnwise"}', r"TP_PLAN\['\*.up'\] is 'columnwise'; use one of colwise"),
    ('TP_PLAN = ["*.up"]', "TP_PLAN is a list of 1"),
    ('tp_plan = 3', "tp_plan in the model file is not a function"),
])
def test_a_bad_hook_is_refused_when_the_file_loads(tmp_path, plan, message):
    with pytest.raises(ModelFileError, match=message):
        load_model_file(model_file(tmp_path, plan))


@pytest.mark.parametrize(("plan", "message"), [
    ('TP_PLAN = {"*.upp": "colwise"}', r"plan entry '\*.upp' matches no module of Sequential; its modules include"),
    ('TP_PLAN = {"*.conv": "colwise"}', "gives 'colwise' to a Conv1d; .* nn.Linear and nn.Embedding only"),
    ('def tp_plan(model):\n    return model.missing', "tp_plan\\(model\\) raised AttributeError"),
    ('def tp_plan(model):\n    return {"*.up": 1}', r"tp_plan\(model\)\['\*.up'\] is 1"),
])
def test_a_plan_that_does_not_fit_the_model_names_the_entry(tmp_path, plan, message):
    spec = load_model_file(model_file(tmp_path, plan))
    with pytest.raises(ModelFileError, match=message):
        tp_plan_of(spec)


def test_globs_match_one_dotted_part_per_star():
    assert matches("model.layers.3.mlp.up_proj", "model.layers.*.mlp.up_proj")
    assert not matches("model.layers.3.x.mlp.up_proj", "model.layers.*.mlp.up_proj")
    assert not matches("model.layers.3.mlp.up_proj.lora", "model.layers.*.mlp.up_proj")
    assert matches("lm_head", "lm_head")


def test_sizes_of_a_user_model_without_heads():
    net = nn.Sequential(nn.Embedding(10, 6), nn.Linear(6, 9))
    plan = checked_plan(net, {"0": "embedding_rowwise", "1": "colwise"}, source="test")
    assert plan.constraints == {"0 num_embeddings": 10, "1 out_features": 9}
    assert plan.max_degree == 1 and plan.limit() == "1 out_features (9)"


def test_style_names_become_torchs_styles():
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    colwise, gather = to_torch_style("colwise"), to_torch_style("colwise_gather_output")
    assert isinstance(colwise, ColwiseParallel) and colwise.output_layouts == (Shard(-1),)
    assert isinstance(gather, ColwiseParallel) and gather.output_layouts == (Replicate(),)
    embedding = to_torch_style("embedding_rowwise")
    assert isinstance(embedding, RowwiseParallel) and embedding.input_layouts == (Replicate(),)
    assert to_torch_style("replicate") is None and to_torch_style("replicated_with_grad_allreduce") is None
    mine = RowwiseParallel()
    copied = to_torch_style(mine)
    assert copied is not mine and copied.src_data_rank is None and mine.src_data_rank == 0


@needs_transformers
def test_the_profile_records_what_the_llama_plan_shards_and_its_collectives():
    """Per block of the recipe (embedding, 4 decoder layers, norm + head): the sharded parameter bytes (not the
    norms) and the collectives torch's styles run per micro-batch, as counted on real ranks (a wrapped
    functional collective): the vocabulary-parallel embedding's forward all-reduce; o_proj's and down_proj's
    forward all-reduces and q, k, v, gate, up's backward ones; the head's gathered logits and its input gradient."""
    from autotune.models.tensor_parallel import tp_layer_terms

    spec = load_model_file(RECIPES / "hf_llama.py")
    terms = [(t.sharded_parameter_bytes, t.forward_all_reduces, t.backward_all_reduces, t.forward_all_gathers)
             for t in tp_layer_terms(spec)]
    layer = 4 * (64 * 64 + 2 * 64 * 32 + 64 * 64 + 3 * 64 * 128)  # q, k, v, o, gate, up, down (no bias)
    assert terms == [(4 * 512 * 64, 1, 0, 0), *[(layer, 2, 5, 0)] * 4, (4 * 512 * 64, 0, 1, 1)]
    assert [spec.parameter_bytes[i] - terms[i][0] for i in range(6)] == [0, 512, 512, 512, 512, 256]  # the norms


def test_a_model_without_a_plan_records_no_terms():
    from autotune.models.tensor_parallel import tp_layer_terms

    assert tp_layer_terms(load_model_file(RECIPES / "mlp.py")) == ()
