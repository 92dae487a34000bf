"""An MLP whose layers differ ~10x in cost: the uniform split is badly unbalanced, a good split is not.

Scale to GPU size: WIDTHS = [4096, 16384, 4096, 16384, ...] and BATCH features 4096; run with --device cuda.
"""

import torch
from torch import nn

IN_FEATURES = 64
N_CLASSES = 10
# Uneven widths, the wide ones first: layers 1-3 cost ~10x layers 5-8, so the uniform split loads stage 0
# with most of the work and a balanced split is much faster.
WIDTHS = [512, 1024, 1024, 512, 128, 64, 64, 64, 64]


def build_model() -> nn.Sequential:
    layers: list[nn.Module] = []
    width = IN_FEATURES
    for out in WIDTHS:
        layers.append(nn.Sequential(nn.Linear(width, out), nn.GELU()))
        width = out
    layers.append(nn.Linear(width, N_CLASSES))
    return nn.Sequential(*layers)


def make_batch(batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(batch_size)
    inputs = torch.randn(batch_size, IN_FEATURES, generator=generator)
    targets = torch.randint(0, N_CLASSES, (batch_size,), generator=generator)
    return inputs, targets


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(output, target)


def build_optimizer(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-3)
