"""timm ViT and torchvision ResNet cut at their blocks: every cut equals the model's own forward and backward."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from autotune.models import check_blocks, check_cut, cut_model
from tests.models.helpers import assert_cuts_match, every_parameter_in_a_block, stage_parameters_are_blocks


def images(rows: int = 2, size: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(rows, 3, size, size, generator=g), torch.randint(0, 10, (rows,), generator=g)


def test_timm_vit() -> None:
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    net = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=64, num_classes=10, depth=3).train()
    model = cut_model(net)
    assert model.family == "timm-vit"
    assert model.names == ("patch_embed+cls_token+pos_embed", "blocks.0", "blocks.1", "blocks.2", "norm+head")
    assert model.roles == ("embedding", "block", "block", "block", "head")
    x, y = images()
    assert_cuts_match(model, x, nn.functional.cross_entropy, y)
    every_parameter_in_a_block(model)  # cls_token and pos_embed live on the top module
    stage_parameters_are_blocks(model)
    check_cut(model, x)
    assert check_blocks(model, x).shape == (2, 10)


def test_timm_vit_default_depth_cuts_into_fourteen_blocks() -> None:
    timm = pytest.importorskip("timm")
    net = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=64, num_classes=10)
    assert cut_model(net).n_blocks == 12 + 2


def test_timm_mobilenetv3_with_batchnorm_between_its_blocks_checks_in_eval_mode() -> None:
    """Its stem's and last conv's BatchNormAct2d (a BatchNorm2d subclass in timm) sit in the code between the
    blocks: they stay calls, so the cut follows eval mode as the model does (traced through, they kept training's
    batch statistics, and the model check, then run in eval mode, failed)."""
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    net = timm.create_model("mobilenetv3_small_100", pretrained=False, num_classes=10).train()
    x, y = images(rows=4)
    model = cut_model(net, inputs=x)
    assert model.family == "traced" and model.n_blocks == 12
    check_blocks(model, x)  # training mode: moves the running statistics
    check_cut(model, x)
    assert_cuts_match(model, x, nn.functional.cross_entropy, y)
    stage = model.stage(0, model.n_blocks)
    net.eval()
    with torch.no_grad():
        torch.testing.assert_close(stage.eval()(x), net(x))  # running statistics, as the model's own forward


def test_torchvision_resnet18() -> None:
    torchvision = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    net = torchvision.models.resnet18(weights=None, num_classes=10).train()
    model = cut_model(net)
    assert model.family == "tv-resnet"
    assert model.names == ("conv1+bn1", "layer1.0", "layer1.1", "layer2.0", "layer2.1", "layer3.0", "layer3.1",
                           "layer4.0", "layer4.1", "fc")
    assert model.block_types[1] == "BasicBlock"
    x, y = images(size=32)
    # BatchNorm in train mode normalises with the batch's statistics: the same batch gives the same output.
    assert_cuts_match(model, x, nn.functional.cross_entropy, y, three_way=False, rtol=1e-5, atol=1e-5)
    every_parameter_in_a_block(model)
    stage_parameters_are_blocks(model)
    check_cut(model, x)
