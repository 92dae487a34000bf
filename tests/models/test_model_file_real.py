"""The model-file contract with real models: any nn.Module from build_model(), inputs as dicts, split points from the
CLI or the file, tied parameters counted once, BatchNorm and uncuttable models named."""

from __future__ import annotations

import pytest
import torch

from autotune import model_file
from autotune.costs import shared_copy_bytes
from autotune.errors import ModelFileError
from autotune.tune import batchnorm_warning
from tests.fakes import BATCHNORM_MODEL, GATED_MODEL

pytest.importorskip("transformers")

GPT2 = """
import torch
from torch import nn
from transformers import GPT2Config, GPT2LMHeadModel

def build_model():
    return GPT2LMHeadModel(GPT2Config(vocab_size=128, n_positions=16, n_embd=32, n_layer=3, n_head=2))

def make_batch(batch_size):
    g = torch.Generator().manual_seed(batch_size)
    ids = torch.randint(0, 128, (batch_size, 17), generator=g)
    mask = torch.ones(batch_size, 16, dtype=torch.long)
    mask[0, 12:] = 0  # the first sequence is padded
    return {"input_ids": ids[:, :-1], "attention_mask": mask}, ids[:, 1:]

def loss_fn(logits, targets):
    return nn.functional.cross_entropy(logits.reshape(-1, 128), targets.reshape(-1))
"""

VALUE_DEPENDENT = """
import torch
from torch import nn

class Tame(nn.Linear):
    def forward(self, x):
        y = super().forward(x)
        if y.abs().max() > 1e6:  # Python control flow on a value, inside the block
            y = y / 2
        return y

def build_model():
    return nn.Sequential(Tame(8, 8), nn.ReLU(), Tame(8, 8), nn.ReLU(), Tame(8, 2))

def make_batch(batch_size):
    return torch.randn(batch_size, 8), torch.randn(batch_size, 2)

def loss_fn(out, y):
    return nn.functional.mse_loss(out, y)
"""


def write(tmp_path, text, name="model.py"):
    path = tmp_path / name
    path.write_text(text)
    return path


def test_an_unmodified_gpt2_is_cut_at_its_blocks_with_the_tied_weight_counted_once(tmp_path):
    spec = model_file.load_model_file(write(tmp_path, GPT2))
    assert spec.family == "hf-gpt2"
    assert spec.n_layers == 5  # embedding, 3 blocks, head
    assert spec.layer_roles == ("embedding", "block", "block", "block", "head")
    assert [p.blocks for p in spec.shared] == [(0, 4)]
    wte = spec.shared[0]
    assert "transformer.wte.weight" in wte.names and "lm_head.weight" in wte.names
    blocks = model_file.build_blocks(spec)
    unique = sum(p.numel() * p.element_size() for p in blocks.model.parameters())
    assert sum(spec.parameter_bytes) == unique  # the tied weight once
    model_file.check_model(spec, 4)  # blocks run one by one, and chained equal the model's own forward


def test_shared_copy_bytes_counts_a_copy_where_the_first_holder_is_absent():
    shared = [((0, 4), 100)]
    assert shared_copy_bytes(shared, 0, 5) == 0  # one stage holds both uses: one copy, already counted in layer 0
    assert shared_copy_bytes(shared, 0, 2) == 0
    assert shared_copy_bytes(shared, 2, 5) == 100  # the head's stage keeps its own copy
    assert shared_copy_bytes(shared, 1, 3) == 0


def test_split_at_from_the_cli_and_from_the_file(tmp_path):
    path = write(tmp_path, GPT2)
    spec = model_file.load_model_file(path, split_at=("transformer.h.*",))
    assert spec.split_at == ("transformer.h.*",) and spec.n_layers == 5
    write(tmp_path, GPT2 + "\nSPLIT_AT = ['transformer.h.*']\n", "hooked.py")
    assert model_file.load_model_file(tmp_path / "hooked.py").split_at == ("transformer.h.*",)
    with pytest.raises(ModelFileError, match=r"--split-at 'nothing\.\*' matches no module"):
        model_file.load_model_file(path, split_at=("nothing.*",))



def test_a_forward_that_cannot_be_cut_names_the_reason_and_split_at(tmp_path):
    with pytest.raises(ModelFileError) as error:
        model_file.load_model_file(write(tmp_path, GATED_MODEL))
    text = str(error.value)
    assert "model.py" in text and "cannot trace" in text and "--split-at" in text


def test_the_batchnorm_warning_names_the_layer(tmp_path):
    spec = model_file.load_model_file(write(tmp_path, BATCHNORM_MODEL))
    text = batchnorm_warning(spec)
    assert "1 (BatchNorm1d)" in text and "per micro-batch" in text


def test_make_batch_inputs_may_be_a_dict_but_every_tensor_needs_the_batch_rows(tmp_path):
    spec = model_file.load_model_file(write(tmp_path, GPT2))
    inputs, targets = model_file.make_batch(spec, 3)
    assert set(inputs) == {"input_ids", "attention_mask"} and targets.shape[0] == 3
    bad = write(tmp_path, GPT2.replace("mask = torch.ones(batch_size, 16", "mask = torch.ones(2, 16"), "bad.py")
    spec = model_file.load_model_file(bad)
    with pytest.raises(ModelFileError, match=r"inputs\['attention_mask'\] of shape \(2, 16\)"):
        model_file.make_batch(spec, 3)


def test_a_real_profile_of_gpt2_records_the_tied_weight(tmp_path):
    from autotune.profiling import profile_model

    spec = model_file.load_model_file(write(tmp_path, GPT2))
    profile = profile_model(spec, batch_size=4, micro_batch_sizes=[2], repeats=1)
    assert profile.n_layers == 5 and profile.shared_parameters == ((spec.shared[0].blocks, spec.shared[0].nbytes),)
    assert all(layer.forward_ms[0] > 0 for layer in profile.layers)
    torch.testing.assert_close(profile.parameter_bytes, sum(spec.parameter_bytes))


def test_a_large_hf_llama_with_a_padding_mask_is_checked_without_building_it(monkeypatch):
    """Llama's mask code asks whether the padding mask is all ones (.item() on the meta device): the check runs it
    under fake tensors, never the real model (Llama-8B's real check on the CPU outlasted a GPU lease)."""
    from tests.conftest import RECIPES

    monkeypatch.setattr(model_file, "REAL_CHECK_MAX_BYTES", 0)
    spec = model_file.load_model_file(RECIPES / "hf_llama.py")

    def no_real_build(*args, **kwargs):
        raise AssertionError("the check built the model's parameters for real")

    monkeypatch.setattr(model_file, "build_blocks", no_real_build)
    monkeypatch.setattr(model_file, "build_skeleton", no_real_build)
    model_file.check_model(spec, 4)


def test_a_large_bert_is_checked_without_building_it(monkeypatch):
    """An encoder's masks come from its base model's forward on fake tensors too: recipes/hf_bert.py, padded."""
    from tests.conftest import RECIPES

    monkeypatch.setattr(model_file, "REAL_CHECK_MAX_BYTES", 0)
    spec = model_file.load_model_file(RECIPES / "hf_bert.py")
    assert spec.family == "hf-encoder" and spec.layer_roles[0] == "embedding" and spec.layer_roles[-1] == "head"

    def no_real_build(*args, **kwargs):
        raise AssertionError("the check built the model's parameters for real")

    monkeypatch.setattr(model_file, "build_blocks", no_real_build)
    monkeypatch.setattr(model_file, "build_skeleton", no_real_build)
    model_file.check_model(spec, 4)


def test_a_large_model_neither_meta_nor_fake_tensors_run_is_checked_one_real_block_at_a_time(tmp_path, monkeypatch):
    """Python control flow on a value inside a block runs on neither: the check runs the model for real, with only
    the running block's parameters materialised."""
    monkeypatch.setattr(model_file, "REAL_CHECK_MAX_BYTES", 0)
    spec = model_file.load_model_file(write(tmp_path, VALUE_DEPENDENT))
    real_blocks: list[int] = []
    materialize_block = model_file._materialize_block

    def counting(spec_, blocks, index):
        materialize_block(spec_, blocks, index)
        real_blocks.append(sum(any(p.device.type != "meta" and p.numel() for p in b.parameters())
                               for b in blocks.blocks))

    monkeypatch.setattr(model_file, "_materialize_block", counting)
    model_file.check_model(spec, 4)
    assert len(real_blocks) == spec.n_layers and max(real_blocks) == 1
