"""The generic cut (torch.fx at block boundaries) on hand-written models: skip connections, side inputs, tied
weights, split points, and the errors when a model cannot be cut."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from autotune.errors import ModelFileError
from autotune.models import check_blocks, check_cut, cut_model, discover_blocks
from tests.models.helpers import assert_cuts_match, every_parameter_in_a_block, stage_parameters_are_blocks


def mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(out, target)


class Skip(nn.Module):
    """h0 = embed(x) is used again after the last layer: every boundary carries it beside the hidden state."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(8, 16)
        self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(3))
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h0 = self.embed(x)
        h = h0
        for layer in self.layers:
            h = torch.tanh(layer(h))
        return self.head(h + h0)


def test_skip_connection_crosses_every_boundary_and_every_cut_is_exact() -> None:
    torch.manual_seed(0)
    model = cut_model(Skip())
    assert model.family == "traced"
    assert model.names == ("embed", "layers.0", "layers.1", "layers.2", "head")
    assert model.roles == ("embedding", "block", "block", "block", "head")
    x, y = torch.randn(3, 8), torch.randn(3, 4)
    carried = model.stage(0, 2)(x)
    assert isinstance(carried, tuple) and len(carried) == 2  # (h0, h)
    assert assert_cuts_match(model, x, mse, y) == 4 + 6
    every_parameter_in_a_block(model)
    stage_parameters_are_blocks(model)
    check_cut(model, x)


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, h: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return h + torch.relu(self.linear(h)) * mask[:, :, None]


class Masked(nn.Module):
    """Two inputs: the mask is a side input every block reads; the head's weight is tied to the embedding."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(20, 16)
        self.blocks = nn.ModuleList(Block(16) for _ in range(3))
        self.norm = nn.LayerNorm(16)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        h = self.embed(ids)
        if mask is None:
            mask = torch.ones_like(ids, dtype=h.dtype)
        for block in self.blocks:
            h = block(h, mask)
        return nn.functional.linear(self.norm(h), self.embed.weight)


def lm_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def masked_batch() -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    mask = torch.ones(3, 7)
    mask[1, 5:] = 0
    return {"ids": torch.randint(0, 20, (3, 7), generator=g), "mask": mask}, torch.randint(0, 20, (3, 7), generator=g)


def test_side_input_reaches_every_stage_and_tied_weight_is_shared() -> None:
    torch.manual_seed(0)
    inputs, targets = masked_batch()
    model = cut_model(Masked(), inputs=inputs)
    args, side = model.split_inputs(inputs)
    assert len(args) == 1 and list(side) == ["mask"]
    assert model.cutter.plan.live[2] == ("blocks_0",)  # the mask travels as a side input, not between stages
    (shared,) = model.shared_parameters()
    assert shared.names == ("embed.weight",) and shared.blocks == (0, 4)  # read by the embedding and the head
    assert_cuts_match(model, inputs, lm_loss, targets)
    check_blocks(model, inputs)


def test_an_input_left_out_is_traced_at_its_default() -> None:
    torch.manual_seed(0)
    inputs, targets = masked_batch()
    model = cut_model(Masked())  # only ids: mask=None is traced, ones are made inside the embedding block
    assert model.split_inputs(inputs["ids"])[1] == {}
    assert_cuts_match(model, inputs["ids"], lm_loss, targets, three_way=False)
    with pytest.raises(ModelFileError, match="cut it with the inputs make_batch returns"):
        model.split_inputs(inputs)


class Down(nn.Module):
    def __init__(self, c_in: int, c_out: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(c_in, c_out, 3, stride=2, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.conv(x))


class Up(nn.Module):
    def __init__(self, c_in: int, c_skip: int, c_out: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(c_in + c_skip, c_out, 3, padding=1)

    def forward(self, x: torch.Tensor, skip: torch.Tensor) -> torch.Tensor:
        x = nn.functional.interpolate(x, size=skip.shape[-2:], mode="nearest")
        return torch.relu(self.conv(torch.cat([x, skip], dim=1)))


class UNet(nn.Module):
    """No ModuleList: the blocks are named with split_at; the encoder's outputs skip to the decoder."""

    def __init__(self) -> None:
        super().__init__()
        self.down1, self.down2, self.mid = Down(3, 4), Down(4, 8), Down(8, 8)
        self.up2, self.up1 = Up(8, 8, 8), Up(8, 4, 4)
        self.out = nn.Conv2d(4 + 3, 2, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        d1 = self.down1(x)
        d2 = self.down2(d1)
        u2 = self.up2(self.mid(d2), d2)
        u1 = self.up1(u2, d1)
        u0 = nn.functional.interpolate(u1, size=x.shape[-2:], mode="nearest")
        return self.out(torch.cat([u0, x], dim=1))


def test_split_at_names_the_blocks_and_skips_cross_several_boundaries() -> None:
    torch.manual_seed(0)
    with pytest.raises(ModelFileError, match="cannot find repeated blocks in UNet.*--split-at"):
        cut_model(UNet())
    model = cut_model(UNet(), split_at=["down*", "mid", "up*"])
    assert model.names == ("down1", "down2", "mid", "up2", "up1", "out")
    assert model.roles == ("block", "block", "block", "block", "block", "head")
    assert model.cutter.plan.live[3] == ("x", "down1", "down2", "mid")  # the input, both skips and mid's output
    x, y = torch.randn(2, 3, 16, 16), torch.randn(2, 2, 16, 16)
    assert_cuts_match(model, x, mse, y)
    every_parameter_in_a_block(model)


def test_split_at_that_matches_nothing_lists_the_modules() -> None:
    with pytest.raises(ModelFileError, match=r"--split-at 'decoder\.\*' matches no module of Skip.*'layers\.\*'"):
        cut_model(Skip(), split_at=["decoder.*"])


def test_nested_matches_keep_the_outermost() -> None:
    model = cut_model(UNet(), split_at=["*"])  # every module matches: the top-level children are the blocks
    assert model.names == ("down1", "down2", "mid", "up2", "up1", "out")


class DataDependent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            if x.sum() > 0:  # control flow on a value: no graph can hold both branches
                x = layer(x)
        return x


def test_a_forward_that_cannot_be_traced_names_the_reason_and_the_fix() -> None:
    with pytest.raises(ModelFileError) as info:
        cut_model(DataDependent())
    message = str(info.value)
    assert "\n" not in message
    assert "cannot trace DataDependent.forward" in message
    assert "test_traced.py:" in message  # where the control flow is
    assert "control flow" in message  # torch's reason
    # The branch is in the model's own forward, between the blocks: no --split-at helps, the code must change.
    assert "move branches on values into a block's forward (the blocks, 'layers.*', may hold any code;" in message
    assert "--split-at" in message


class NanoGPT(nn.Module):
    """nanoGPT's forward: a size check with assert between the blocks."""

    def __init__(self) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(50, 16), nn.Embedding(32, 16)
        self.h = nn.ModuleList(Block(16) for _ in range(2))
        self.block_size = 32

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        _, t = idx.size()
        assert t <= self.block_size, f"Cannot forward sequence of length {t}"
        x = self.wte(idx) + self.wpe(torch.arange(0, t, dtype=torch.long, device=idx.device))
        for block in self.h:
            x = block(x, torch.ones_like(idx, dtype=x.dtype))
        return x


class TracedNanoGPT(NanoGPT):
    """The fix the message names: torch._assert instead of assert."""

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        _, t = idx.size()
        torch._assert(t <= self.block_size, "sequence too long")
        x = self.wte(idx) + self.wpe(torch.arange(0, t, dtype=torch.long, device=idx.device))
        for block in self.h:
            x = block(x, torch.ones_like(idx, dtype=x.dtype))
        return x


def test_an_assert_between_the_blocks_says_torch_assert_and_that_fix_works() -> None:
    with pytest.raises(ModelFileError, match=r"cannot trace NanoGPT.forward .*test_traced.py:\d+: .*control flow.* "
                                             r"write a size check as torch._assert\(condition, message\)"):
        cut_model(NanoGPT())
    torch.manual_seed(0)
    model = cut_model(TracedNanoGPT())
    assert model.names == ("wte+wpe", "h.0", "h.1")
    ids = torch.randint(0, 50, (3, 7))
    assert_cuts_match(model, ids, mse, torch.randn(3, 7, 16))


class Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
            if x.abs().max() > 100:  # a guard on values, inside a module that holds the blocks
                x = x / 100
        return x


class Wrapped(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = Encoder()
        self.extra = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.encoder(x)
        for layer in self.extra:
            x = layer(x)
        return self.head(x)


def test_untraceable_module_can_be_made_a_block() -> None:
    with pytest.raises(ModelFileError, match=r"in the forward of encoder .*--split-at 'encoder'"):
        cut_model(Wrapped())
    torch.manual_seed(0)
    model = cut_model(Wrapped(), split_at=["encoder", "extra.*"])
    assert model.names == ("encoder", "extra.0", "extra.1", "head")
    assert_cuts_match(model, torch.randn(3, 4), mse, torch.randn(3, 2))


class SizeAcross(nn.Module):
    """A size read before the first block and used after the last: an int would have to cross the stages."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(6, 6) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.size(0)
        for layer in self.layers:
            x = layer(x)
        return x.reshape(rows, 2, 3).sum(-1)


def test_a_value_that_cannot_cross_a_stage_names_the_block() -> None:
    model = cut_model(SizeAcross())
    with pytest.raises(ModelFileError, match=r"block 0 \(layers.0, Linear\) returned a tuple of 2 \(.*int.*\), "
                                             r"which cannot cross a pipeline stage.*an int is made before this cut"):
        check_blocks(model, torch.randn(3, 6))


class Pair(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(5, 5)

    def forward(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = self.linear(h)
        return y, y.pow(2).mean(-1)


class Aux(nn.Module):
    """Blocks return (hidden, aux); the auxiliary outputs are summed at the end."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Pair() for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        total = torch.zeros_like(x[:, 0])
        for layer in self.layers:
            x, aux = layer(x)
            total = total + aux
        return x.sum(-1) + total


def test_tuple_outputs_unpacked_inside_the_block() -> None:
    torch.manual_seed(0)
    model = cut_model(Aux())
    assert model.names == ("layers.0", "layers.1", "layers.2")  # the glue before and after joins the blocks
    assert_cuts_match(model, torch.randn(4, 5), mse, torch.randn(4))
    check_blocks(model, torch.randn(4, 5))


def test_discovery_joins_sibling_containers_of_one_class() -> None:
    class ResNetLike(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.stem = nn.Linear(3, 3)
            self.layer1 = nn.Sequential(Pair(), Pair())
            self.layer2 = nn.Sequential(Pair(), Pair(), Pair())
            self.fc = nn.Sequential(nn.Linear(3, 3), nn.ReLU())

    assert discover_blocks(ResNetLike()) == ["layer1.0", "layer1.1", "layer2.0", "layer2.1", "layer2.2"]


class NormAct(nn.BatchNorm1d):
    """A BatchNorm subclass outside torch.nn with an activation, as timm's BatchNormAct2d: its forward branches on
    self.training inside code a plain fx trace would go through."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
        x = nn.functional.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias,
                                     self.training, factor, self.eps)
        return torch.relu(x)


class Scale(nn.Module):
    """Not a torch.nn module: halves its input in training only (a drop-path of sorts)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 0.5 if self.training else x


class NormedGlue(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(8, 16)
        self.norm = NormAct(16)
        self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(3))
        self.scale = Scale()
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.stem(x))
        for layer in self.layers:
            h = torch.tanh(layer(h))
        return self.head(self.scale(h))


def test_modules_that_read_the_training_mode_follow_train_and_eval_between_the_blocks() -> None:
    torch.manual_seed(0)
    x = torch.randn(6, 8) * 3 + 1
    model = cut_model(NormedGlue(), inputs=x)  # traced in training mode, as build_model returns it
    assert model.names == ("stem+norm", "layers.0", "layers.1", "layers.2", "head")
    check_blocks(model, x)  # in training mode: moves the running statistics away from the batch's
    check_cut(model, x)
    stage = model.stage(0, model.n_blocks)
    for mode in (True, False):
        model.model.train(mode)
        stage.train(mode)
        with torch.no_grad():
            torch.testing.assert_close(stage(x), model.reference(x))


class DropoutBeforeHead(nn.Module):
    """The model's own forward drops out between its blocks and its head, as timm's EfficientNet.forward_head does
    with drop_rate: the trace fixes the branch of the mode it was traced in, the one trials train in."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(3))
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return self.head(nn.functional.dropout(x, p=0.5, training=self.training))


def test_the_check_compares_in_the_mode_the_model_trains_in_with_the_same_dropout() -> None:
    torch.manual_seed(0)
    x = torch.randn(4, 16)
    model = cut_model(DropoutBeforeHead(), inputs=x)
    check_cut(model, x)  # in eval mode the traced graph would still drop out: the check failed
    with torch.no_grad(), torch.random.fork_rng():
        torch.manual_seed(1)
        one = model.stage(0, model.n_blocks)(x)
        torch.manual_seed(2)
        other = model.stage(0, model.n_blocks)(x)
    assert not torch.allclose(one, other)  # dropout is on: the check is not comparing constants


class _InPlaceGlue(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem, self.act = nn.Linear(8, 8), nn.ReLU(inplace=True)
        self.body, self.head = nn.Linear(8, 8), nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.act(self.stem(x))
        x = nn.functional.relu(self.body(x), inplace=True)  # on the body's own output: stays in place
        return self.head(x)


def test_a_traced_block_starting_in_place_runs_out_of_place() -> None:
    """A block whose first operation changes its input in place cannot take a stage's input (a leaf that needs its
    gradient): the module called on the block's input is turned out of place, and so is a function called with
    inplace=True on it; an in-place operation on the block's own intermediate stays."""
    from autotune.models.cut import _first_op_out_of_place

    model = cut_model(_InPlaceGlue(), split_at=["stem", "act", "body", "head"])
    assert model.model.act.inplace is False
    assert "inplace = True" in model.blocks[2].code  # body's relu acts on body's output
    x = torch.randn(4, 8)
    assert_cuts_match(model, x, lambda out, y: nn.functional.mse_loss(out, y), torch.randn(4, 2), three_way=False)
    leaf = torch.randn(4, 8, requires_grad=True)
    glue = torch.fx.symbolic_trace(lambda t: nn.functional.relu(t, inplace=True) * 2)
    with pytest.raises(RuntimeError, match="in-place"):
        glue(leaf)
    assert _first_op_out_of_place(glue) and glue(leaf).grad_fn is not None
