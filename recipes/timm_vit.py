"""A timm Vision Transformer, as it is: cut at its blocks; patch embedding with the class token and position
embedding (parameters of the top module) is the first block, norm + head the last.

Needs `pip install "autotune[models]"` (timm). Scale to GPU size: "vit_large_patch16_224" with IMAGE = 224 and
--device cuda.
"""

import timm
import torch
from torch import nn

CLASSES = 10
IMAGE = 64


def build_model() -> nn.Module:
    return timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=IMAGE, num_classes=CLASSES)


def make_batch(batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(batch_size)
    images = torch.randn(batch_size, 3, IMAGE, IMAGE, generator=generator)
    return images, torch.randint(0, CLASSES, (batch_size,), generator=generator)


def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits, labels)
