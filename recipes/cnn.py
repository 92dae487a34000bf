"""A small CNN classifier (GroupNorm, not BatchNorm: statistics per micro-batch would shift with B/M).

Scale to GPU size: CHANNELS = [128, 256, 512, 1024], IMAGE = 224 and --device cuda.
"""

import torch
from torch import nn

IMAGE = 32
CHANNELS = [16, 32, 64, 64]
N_CLASSES = 10


def conv_block(c_in: int, c_out: int, stride: int) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1), nn.GroupNorm(8, c_out), nn.ReLU()
    )


def build_model() -> nn.Sequential:
    layers: list[nn.Module] = [conv_block(3, CHANNELS[0], 1)]
    for c_in, c_out in zip(CHANNELS, CHANNELS[1:]):
        layers.append(conv_block(c_in, c_out, 2))
        layers.append(conv_block(c_out, c_out, 1))
    layers.append(nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(CHANNELS[-1], N_CLASSES)))
    return nn.Sequential(*layers)


def make_batch(batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(batch_size)
    images = torch.randn(batch_size, 3, IMAGE, IMAGE, generator=generator)
    labels = torch.randint(0, N_CLASSES, (batch_size,), generator=generator)
    return images, labels


def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits, labels)
