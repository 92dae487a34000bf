"""A huge embedding under a small MLP: 32768 x 64 token table (8 MiB of parameters, 3x that in gradients and AdamW
state) feeding three narrow layers, so parameters, optimizer state and the optimizer's temporaries dominate memory
and the stage holding the table outweighs the rest."""

import torch
from torch import nn

VOCAB = 32768
TOKENS = 8
DIM = 64


class Embed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Embedding(VOCAB, DIM)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.table(ids).flatten(1)


def build_model() -> nn.Sequential:
    return nn.Sequential(
        Embed(),
        nn.Sequential(nn.Linear(TOKENS * DIM, 256), nn.GELU()),
        nn.Sequential(nn.Linear(256, 256), nn.GELU()),
        nn.Sequential(nn.Linear(256, 128), nn.GELU()),
        nn.Linear(128, 10),
    )


def make_batch(batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(batch_size)
    ids = torch.randint(0, VOCAB, (batch_size, TOKENS), generator=generator)
    return ids, torch.randint(0, 10, (batch_size,), generator=generator)


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(output, target)
