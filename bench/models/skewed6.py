"""Six layers whose costs spread ~10x, the heavy ones first: small enough for an exhaustive grid on 2 cores."""

import torch
from torch import nn

WIDTHS = [1024, 1024, 256, 64, 64]


def build_model() -> nn.Sequential:
    layers: list[nn.Module] = []
    width = 256
    for out in WIDTHS:
        layers.append(nn.Sequential(nn.Linear(width, out), nn.GELU()))
        width = out
    layers.append(nn.Linear(width, 10))
    return nn.Sequential(*layers)


def make_batch(batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(batch_size)
    return torch.randn(batch_size, 256, generator=generator), torch.randint(0, 10, (batch_size,), generator=generator)


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(output, target)
