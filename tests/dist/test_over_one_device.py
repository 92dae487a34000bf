"""A model whose training state does not fit one device is still profiled and tuned (issue 29): a Hugging Face Llama
(config built in code, no download) under a --memory-limit that its whole training state exceeds, on 2 CPU ranks;
the limit binds the profiler and the trials through the same live-tensor tracker."""

from __future__ import annotations

import pytest
import torch

from autotune.model_file import build_blocks, load_model_file
from autotune.trial.memory import LiveTensorBytes, MemoryLimitExceeded
from autotune.tune import TuneRequest, tune

pytest.importorskip("transformers")

pytestmark = pytest.mark.dist

LLAMA = """
import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

VOCAB = 8192

def build_model():
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=VOCAB, hidden_size=256, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=16))

def make_batch(batch_size):
    g = torch.Generator().manual_seed(batch_size)
    ids = torch.randint(0, VOCAB, (batch_size, 17), generator=g)
    return {"input_ids": ids[:, :-1]}, ids[:, 1:]

def loss_fn(logits, targets):
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))
"""

LIMIT = 100 * 2**20
"""Per rank (and for the profiler): the whole training state (parameters, gradients, AdamW's two moments: 4 x 32.5
MB) is over it; one block's (at most 4 x 8.4 MB, the embedding or the head) and half the model's are under it."""


def test_a_llama_over_the_memory_limit_is_profiled_and_searched_under_it(tmp_path):
    path = tmp_path / "llama.py"
    path.write_text(LLAMA)
    spec = load_model_file(path)
    assert spec.family == "hf-decoder" and spec.n_layers == 6
    assert 4 * sum(spec.parameter_bytes) > 1.2 * LIMIT

    # The premise, checked with the tracker that binds trials and the profiler: the whole model cannot train here.
    model = build_blocks(spec).model
    optimizer = torch.optim.AdamW(model.parameters())
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    with pytest.raises(MemoryLimitExceeded), LiveTensorBytes(limit_bytes=LIMIT):
        optimizer.step()
    del model, optimizer, p

    request = TuneRequest(model=path, gpus=2, batch_size=8, device="cpu", trials=2, memory_limit_bytes=LIMIT,
                          storage=f"sqlite:///{tmp_path}/study.db", study_name="llama", output=tmp_path / "tuned.yaml",
                          report_dir=None, steps=2, warmup=1, trial_timeout_s=240.0)
    outcome = tune(request)
    best = outcome.result.best
    assert best is not None and best.status == "ok"
    assert best.candidate.pipeline_degree == 2  # pp 1 x dp 2 would hold the whole model on each rank
    assert 0 < max(best.peak_memory_bytes) <= LIMIT
    assert (tmp_path / "tuned.yaml").is_file()
