"""A 2-block GPT: token embedding, two pre-norm attention blocks, norm + head, a 256-token vocabulary and 64-token
sequences, so attention's (sequence x sequence) temporaries and the cross-entropy over the vocabulary both show."""

import torch
from torch import nn

VOCAB = 256
SEQ_LEN = 64
D_MODEL = 64
N_HEADS = 4


class Embedding(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tokens = nn.Embedding(VOCAB, D_MODEL)
        self.positions = nn.Embedding(SEQ_LEN, D_MODEL)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.tokens(ids) + self.positions(torch.arange(ids.shape[1], device=ids.device))


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
    return nn.Sequential(Embedding(), Block(), Block(), Head())


def make_batch(batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(batch_size)
    ids = torch.randint(0, VOCAB, (batch_size, SEQ_LEN + 1), generator=generator)
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))
