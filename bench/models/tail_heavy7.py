"""Seven layers, the heavy ones last (a tail-heavy MLP with millisecond steps): the last stage holds most of the
parameters, activations and loss."""

import torch
from torch import nn

IN_FEATURES = 64
WIDTHS = [64, 64, 128, 256, 1024, 1024]


def build_model() -> nn.Sequential:
    layers: list[nn.Module] = []
    width = IN_FEATURES
    for out in WIDTHS:
        layers.append(nn.Sequential(nn.Linear(width, out), nn.GELU()))
        width = out
    layers.append(nn.Linear(width, 10))
    return nn.Sequential(*layers)


def make_batch(batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(batch_size)
    inputs = torch.randn(batch_size, IN_FEATURES, generator=generator)
    return inputs, torch.randint(0, 10, (batch_size,), generator=generator)


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(output, target)
