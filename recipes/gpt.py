"""A GPT-style decoder: token ids in, embedding, N pre-norm transformer blocks, norm + head out.

Scale to GPU size: D_MODEL = 4096, N_HEADS = 32, N_BLOCKS = 32, SEQ_LEN = 2048, VOCAB = 50304, and --device cuda
(about 7B parameters: pipeline it over 4-8 GPUs).
"""

import torch
from torch import nn

VOCAB = 512
SEQ_LEN = 32
D_MODEL = 64
N_HEADS = 4
N_BLOCKS = 6
LAYER_ROLES = ["embedding"] + ["block"] * N_BLOCKS + ["head"]
"""What each layer of build_model() is: `autotune export` counts transformer layers for Megatron-LM and torchtitan
from it when the tuned config has no layer_roles (read from this file's text, not run)."""


class Embedding(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tokens = nn.Embedding(VOCAB, D_MODEL)
        self.positions = nn.Embedding(SEQ_LEN, D_MODEL)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.shape[1], device=ids.device)
        return self.tokens(ids) + self.positions(positions)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(D_MODEL)
        self.attention = nn.MultiheadAttention(D_MODEL, N_HEADS, batch_first=True)
        self.norm2 = nn.LayerNorm(D_MODEL)
        self.mlp = nn.Sequential(nn.Linear(D_MODEL, 4 * D_MODEL), nn.GELU(), nn.Linear(4 * D_MODEL, D_MODEL))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        causal = torch.triu(torch.ones(x.shape[1], x.shape[1], dtype=torch.bool, device=x.device), diagonal=1)
        x = x + self.attention(h, h, h, attn_mask=causal, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(D_MODEL)
        self.out = nn.Linear(D_MODEL, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(x))


def build_model() -> nn.Sequential:
    return nn.Sequential(Embedding(), *[Block() for _ in range(N_BLOCKS)], Head())


def make_batch(batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(batch_size)
    ids = torch.randint(0, VOCAB, (batch_size, SEQ_LEN + 1), generator=generator)
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))
