"""timm VisionTransformer and torchvision ResNet: which modules are their repeated blocks (cut by the traced path).

Recognised by class name and attribute shape, without importing timm or torchvision."""

from __future__ import annotations

from torch import nn

from autotune.models.blocks import Family


def recognise_vision(model: nn.Module) -> tuple[Family, list[str]] | None:
    """(family, block module names) for a timm ViT or a torchvision ResNet; None otherwise."""
    blocks = getattr(model, "blocks", None)
    if _is(model, "timm.", "VisionTransformer") and isinstance(blocks, nn.Sequential):
        if hasattr(model, "patch_embed") and hasattr(model, "forward_head"):
            return "timm-vit", [f"blocks.{name}" for name, _ in blocks.named_children()]
    if _is(model, "torchvision.", "ResNet"):
        stages = [getattr(model, f"layer{k}", None) for k in range(1, 5)]
        sequentials = [s for s in stages if isinstance(s, nn.Sequential)]
        if len(sequentials) == 4 and isinstance(getattr(model, "fc", None), nn.Module):
            return "tv-resnet", [
                f"layer{k}.{name}" for k, s in enumerate(sequentials, 1) for name, _ in s.named_children()
            ]
    return None


def _is(model: nn.Module, package: str, class_name: str) -> bool:
    return any(cls.__module__.startswith(package) and cls.__name__ == class_name for cls in type(model).__mro__)
