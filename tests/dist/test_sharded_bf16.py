"""FSDP2 in bf16 on models whose parameters do not all become bfloat16, each of which failed every trial before:
BatchNorm (timm's and torchvision's ResNets) keeps float32 statistics and torch's kernels take no bfloat16 weight
beside them ("expected scalar type BFloat16 but found Float"; sharding.shard_stage gives each BatchNorm a float32
unit of its own); a tied embedding and LM head (GPT-2, Qwen2 with tie_word_embeddings) is left out of FSDP, float32,
and met bfloat16 activations ("expected m1 and m2 to have the same dtype"; its modules now run under autocast)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from autotune.candidate import Candidate
from autotune.model_file import load_model_file
from autotune.schedules import Schedule
from autotune.trial import TrialOptions, run_trial

BATCHNORM = """
import torch
from torch import nn

def block(c_in, c_out):
    return nn.Sequential(nn.Conv2d(c_in, c_out, 3, padding=1, bias=False), nn.BatchNorm2d(c_out), nn.ReLU())

def build_model():
    return nn.Sequential(block(3, 8), block(8, 8), nn.BatchNorm2d(8),
                         nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4)))

def make_batch(batch_size):
    g = torch.Generator().manual_seed(batch_size)
    return torch.randn(batch_size, 3, 8, 8, generator=g), torch.randint(0, 4, (batch_size,), generator=g)

def loss_fn(output, target):
    return nn.functional.cross_entropy(output, target)
"""


TIED = """
import torch
from torch import nn

VOCAB, WIDTH = 64, 16

class Embed(nn.Module):
    def __init__(self):
        super().__init__()
        self.table = nn.Embedding(VOCAB, WIDTH)

    def forward(self, ids):
        return self.table(ids)

class Head(nn.Module):
    def __init__(self):
        super().__init__()
        self.out = nn.Linear(WIDTH, VOCAB, bias=False)

    def forward(self, x):
        return self.out(x)

def build_model():
    model = nn.Sequential(Embed(), nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.GELU()),
                          nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.GELU()), Head())
    model[3].out.weight = model[0].table.weight
    return model

def make_batch(batch_size):
    g = torch.Generator().manual_seed(batch_size)
    ids = torch.randint(0, VOCAB, (batch_size, 9), generator=g)
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()

def loss_fn(logits, targets):
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))
"""


@pytest.mark.dist
@pytest.mark.parametrize("model", ["batchnorm", "tied"])
@pytest.mark.parametrize("pp", [1, 2])
def test_sharded_bf16_trains(tmp_path, model, pp):
    """BatchNorm inside a block and as a block of its own; a tie on one rank (pp 1 x dp 2) and across the pipeline
    (pp 2 x dp 2: 4 ranks)."""
    (tmp_path / "model.py").write_text({"batchnorm": BATCHNORM, "tied": TIED}[model])
    spec = load_model_file(tmp_path / "model.py")
    candidate = Candidate(schedule=Schedule.ONE_F_ONE_B, pipeline_degree=pp, data_parallel_degree=2,
                          data_parallel_mode="shard", global_batch_size=16, n_microbatches=2,
                          layers_per_stage=(4,) if pp == 1 else (2, 2), precision="bf16")
    result = run_trial(spec, candidate, TrialOptions(steps=2, warmup=1, device="cpu"))
    assert result.status == "ok", result.error


BUFFER = """
import torch
from torch import nn

class Masked(nn.Linear):
    \"\"\"As timm's Swin blocks make their attention mask: a buffer on the device of the block's own weight (the meta
    device while autotune builds the model), made again by reset_parameters once the weight is real.\"\"\"

    def reset_parameters(self):
        super().reset_parameters()
        self.register_buffer("scale", torch.full((self.out_features,), 0.5, device=self.weight.device),
                             persistent=False)

    def forward(self, x):
        return super().forward(x) * self.scale

def build_model():
    return nn.Sequential(Masked(8, 8), nn.ReLU(), Masked(8, 8), nn.ReLU(), nn.Linear(8, 2))

def make_batch(batch_size):
    g = torch.Generator().manual_seed(batch_size)
    return torch.randn(batch_size, 8, generator=g), torch.randn(batch_size, 2, generator=g)

def loss_fn(output, target):
    return nn.functional.mse_loss(output, target)
"""


@pytest.mark.dist
@pytest.mark.parametrize("pp", [1, 2])
def test_a_buffer_made_on_its_blocks_device_is_real_in_a_sharded_trial(tmp_path, pp):
    """A sharded rank's blocks are materialised on a second skeleton and their values copied into the shards: a
    buffer the block's own initialiser makes there must come along (timm's Swin: "Tensor on device meta is not on
    the expected device cpu" in every sharded trial)."""
    (tmp_path / "model.py").write_text(BUFFER)
    spec = load_model_file(tmp_path / "model.py")
    candidate = Candidate(schedule=Schedule.ONE_F_ONE_B, pipeline_degree=pp, data_parallel_degree=2,
                          data_parallel_mode="shard", global_batch_size=16, n_microbatches=2,
                          layers_per_stage=(5,) if pp == 1 else (2, 3))
    sharded = run_trial(spec, candidate, TrialOptions(steps=2, warmup=1, device="cpu"))
    assert sharded.status == "ok", sharded.error
    replicated = run_trial(spec, replace(candidate, data_parallel_mode="replicate"),
                           TrialOptions(steps=2, warmup=1, device="cpu"))
    assert replicated.status == "ok", replicated.error
    assert sharded.losses and sharded.losses == pytest.approx(replicated.losses, rel=1e-5)  # the values too

