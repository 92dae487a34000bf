"""A torchvision ResNet-18, as it is: cut at its residual blocks (layer1.0 ... layer4.1); the stem and the
pooling + classifier are blocks of their own.

BatchNorm normalises each micro-batch with its own statistics under pipelining: small micro-batches change
training (autotune warns). Needs `pip install "autotune[models]"` (torchvision built for your torch). Scale to GPU
size: resnet152 with IMAGE = 224 and --device cuda.
"""

import torch
import torchvision
from torch import nn

CLASSES = 10
IMAGE = 64


def build_model() -> nn.Module:
    return torchvision.models.resnet18(weights=None, num_classes=CLASSES)


def make_batch(batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(batch_size)
    images = torch.randn(batch_size, 3, IMAGE, IMAGE, generator=generator)
    return images, torch.randint(0, CLASSES, (batch_size,), generator=generator)


def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits, labels)
