"""Stage outputs that torch's split backward can detach in place: views and passed-through inputs become
same-memory aliases."""

from __future__ import annotations

import torch
from torch import nn

from autotune.models.handoff import handoff


def test_a_view_output_becomes_a_same_memory_alias_with_the_gradient_passed_through() -> None:
    x = torch.randn(2, 3, 4, requires_grad=True)
    out = nn.Linear(4, 4)(x)
    assert out._is_view()  # a Linear on a 3-D activation returns a view
    sent = handoff(out)
    assert not sent._is_view() and sent.data_ptr() == out.data_ptr()
    sent.sum().backward()
    assert x.grad is not None
    sent.detach_()  # what stage_backward_input does; a view would raise


def test_an_input_passed_through_leaves_as_a_new_tensor() -> None:
    skip = torch.randn(2, 4, requires_grad=True)
    ids = torch.tensor([[1, 2]])
    h = skip * 2
    out = handoff((skip, h, ids), inputs=(skip, ids))
    assert out[0] is not skip and out[0].data_ptr() == skip.data_ptr()
    assert out[1] is h  # computed, not a view: unchanged
    assert out[2] is not ids and torch.equal(out[2], ids) and not out[2].requires_grad
    out[0].detach_()
    assert skip.requires_grad and skip.grad_fn is None  # the input itself is untouched
    torch.autograd.backward([handoff(skip, inputs=(skip,))], [torch.ones(2, 4)])
    assert torch.equal(skip.grad, torch.ones(2, 4))


def test_one_tensor_stays_one_tensor() -> None:
    t = torch.ones(3)
    assert handoff(t) is t
    assert handoff(None) is None
