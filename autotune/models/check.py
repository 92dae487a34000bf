"""Checks that name the block: what each block hands to the next can cross a stage, and the cut model computes
what the model itself computes."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from autotune.errors import ModelFileError
from autotune.models.blocks import BlockModel, describe


def head_rows(inputs: Any, rows: int) -> Any:
    """The first `rows` samples of make_batch's inputs (a tensor, tuple or dict of tensors)."""
    if isinstance(inputs, torch.Tensor):
        return inputs[:rows]
    if isinstance(inputs, (tuple, list)):
        return type(inputs)(head_rows(x, rows) for x in inputs)
    if isinstance(inputs, Mapping):
        return {k: head_rows(v, rows) for k, v in inputs.items()}
    return inputs


def check_blocks(
    model: BlockModel,
    inputs: Any,
    *,
    rows: int = 2,
    before: Callable[[int], None] | None = None,
    after: Callable[[int], None] | None = None,
) -> Any:
    """Run `rows` samples through each block in turn, each as a stage of its own, and check that what crosses
    every boundary is a tensor or a tuple of tensors (what torch's pipeline stages send). Raises ModelFileError in
    one line naming the block, its type, what it returned and the fix; returns the last block's output.
    before(i) / after(i) run around block i (a model too large to build whole materialises one block at a time)."""
    args, side = model.split_inputs(head_rows(inputs, rows))
    carried: tuple[Any, ...] = args
    types = model.block_types
    with torch.no_grad():
        for i in range(model.n_blocks):
            where = f"block {i} ({model.names[i]}, {types[i]})"
            if before is not None:
                before(i)
            try:
                out = model.stage(i, i + 1)(*carried, **side)
            except ModelFileError:
                raise
            except Exception as exc:  # the user's module can raise anything; name the block
                text = " ".join(str(exc).split())[:300]
                raise ModelFileError(f"{where} raised {type(exc).__name__}: {text}") from exc
            finally:
                if after is not None:
                    after(i)
            if i == model.n_blocks - 1:
                return out
            carried = _crossing(model, i, where, out)
    return None


def _crossing(model: BlockModel, index: int, where: str, out: Any) -> tuple[torch.Tensor, ...]:
    if isinstance(out, torch.Tensor):
        return (out,)
    fix = _fix(model, out)
    if model.family == "sequential":
        if isinstance(out, tuple) and out and all(isinstance(t, torch.Tensor) for t in out):
            raise ModelFileError(
                f"{where} returned {describe(out)}; in an nn.Sequential the next layer gets it as one argument but "
                f"a stage boundary would unpack it, so it cannot cross a stage: {fix}"
            )
    elif isinstance(out, tuple) and all(isinstance(t, torch.Tensor) for t in out):
        return out
    raise ModelFileError(
        f"{where} returned {describe(out)}, which cannot cross a pipeline stage (only a tensor or a tuple of "
        f"tensors can): {fix}"
    )


def _fix(model: BlockModel, out: Any) -> str:
    if model.family == "traced" and isinstance(out, tuple):
        odd = next((v for v in out if not isinstance(v, torch.Tensor)), None)
        return (
            f"{describe(odd)} is made before this cut and used after it; compute it inside the block that uses it, "
            f"or choose other blocks with --split-at"
        )
    if isinstance(out, Mapping) or hasattr(out, "to_tuple"):
        return (
            "return the tensor the next layer takes (e.g. `.last_hidden_state` or `.logits`), or return the model "
            "itself from build_model() so autotune cuts it at its blocks"
        )
    return "make the layer return the tensor the next layer takes (wrap it in a module that picks it)"


CHECK_SEED = 0
"""The random seed both forwards of check_cut start from."""


def check_cut(model: BlockModel, inputs: Any, *, rows: int = 2, rtol: float = 1e-4, atol: float = 1e-5) -> None:
    """The blocks chained in one stage compute what the model's own forward computes (`rows` samples), in the mode
    the model is in, the one its trials train in (a traced cut fixes the branches the model's own code takes on
    self.training, such as timm's dropout before the classifier, to that mode), each run from the same random
    seed so that dropout draws the same masks. Raises ModelFileError when they differ: the model is not of the
    shape its family's adapter expects."""
    small = head_rows(inputs, rows)
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(CHECK_SEED)
        want = model.reference(small)
        args, side = model.split_inputs(small)
        stage = model.stage(0, model.n_blocks)
        torch.manual_seed(CHECK_SEED)
        try:
            got = stage(*args, **side)
        except ModelFileError:
            raise
        except Exception as exc:  # the adapter met a model of another shape than it expects
            text = " ".join(f"{type(exc).__name__}: {exc}".split())[:200]
            raise ModelFileError(
                f"cut into blocks, {type(model.model).__name__} ({model.family}) fails where its own forward runs "
                f"({text}); name the modules to cut between with --split-at, or report this model"
            ) from exc
    try:
        torch.testing.assert_close(got, want, rtol=rtol, atol=atol)
    except (AssertionError, TypeError, ValueError) as exc:
        first = " ".join(str(exc).split())[:200]
        raise ModelFileError(
            f"cut into blocks, {type(model.model).__name__} ({model.family}) computes something else than its own "
            f"forward ({first}); name the modules to cut between with --split-at, or report this model"
        ) from exc
