"""A 13-layer MLP of even width (12 hidden blocks of 256 + a head): each pipeline hand-off is one 256-wide
activation, so a slow inter-node link shows in the step time (bench/internode.py)."""

import torch
from torch import nn

WIDTH = 256
N_BLOCKS = 12
N_CLASSES = 10


def build_model() -> nn.Sequential:
    blocks: list[nn.Module] = [nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.GELU()) for _ in range(N_BLOCKS)]
    return nn.Sequential(*blocks, nn.Linear(WIDTH, N_CLASSES))


def make_batch(batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(batch_size)
    inputs = torch.randn(batch_size, WIDTH, generator=generator)
    targets = torch.randint(0, N_CLASSES, (batch_size,), generator=generator)
    return inputs, targets


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(output, target)


def build_optimizer(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-3)
