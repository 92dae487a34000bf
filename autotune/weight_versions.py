"""PipeDream-2BW's weight versions (Narayanan et al. 2021): two copies of a rank's stage weights, so that 1F1B runs on
across optimizer steps without a flush and every update uses the gradient of the weights one step older.

Batch j (the micro-batches of optimizer step j) runs its forwards and backwards on W(j-1), and once this stage has
run batch j's last backward the update W(j+1) = W(j) - lr * grad f(W(j-1); batch j) is made, with the optimizer's own
rule in place of plain SGD (W(-1) = W(0)). With m micro-batches per step and m >= stages (schedules.validate_schedule),
a stage never holds micro-batches of more than two versions: when batch j ends, batch j+1's forwards (on W(j)) have
begun and none of batch j+2's (on W(j+1)) has.

Two buffers per parameter hold the versions: buffer (v % 2) holds W(v). The stage module's parameter slots are
pointed at batch j's buffer, (j - 1) % 2, before each of its forwards and backwards (a backward of a checkpointed
stage recomputes its forward on them). The update writes W(j+1) into the buffer batch j has just finished with:

    stage 0 of pp 2, m 2 (step j: micro-batches 2j, 2j+1); Uj: the update after step j's last backward
    action   F0 F1 B0 F2 B1 U0 F3 B2 F4 B3 U1 F5 B4 ...
    buffer    1  1  1  0  1     0  0  1  0     1  1
    U0 writes W(1) into buffer 1, U1 W(2) into buffer 0: steps 0, 2, ... run on buffer 1, steps 1, 3, ... on 0

The optimizer keeps the rank's original parameters (the masters): the update points each master's storage at the
buffer it writes (so the optimizer state stays with its parameter) and steps it there; between windows the masters
are back in the modules and hold the newest weights. Two copies of the weights in all, as in the paper.

The update is started at the end of step j (the gradient's all-reduce over the replicas, asynchronous) and finished
(the wait, the optimizer step) only when W(j+1) is first needed: at the first micro-batch of step j+2, at the next
update (W(j+1) is its base) or at the end of the window; so the all-reduce overlaps step j+1's micro-batches.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn


class WeightVersions:
    """A rank's two weight versions and the slots of its stage modules that hold them.

    first_step is the index of the optimizer step whose micro-batch 0 is chunk 0 of the running window: torch's
    schedule numbers a window's micro-batches from 0, the versions go by the step."""

    def __init__(self, modules: list[nn.Module], masters: list[nn.Parameter], n_microbatches: int) -> None:
        self.masters = masters
        self.n_microbatches = n_microbatches
        self.first_step = 0
        index = {id(p): i for i, p in enumerate(masters)}
        self._slots: list[tuple[nn.Module, str, int]] = []
        seen: set[tuple[int, str]] = set()
        for module in modules:
            for owner in module.modules():
                for name, p in owner._parameters.items():
                    if p is not None and id(p) in index and (id(owner), name) not in seen:
                        seen.add((id(owner), name))
                        self._slots.append((owner, name, index[id(p)]))
        # buffer 0 is W(0) (the masters' own storage), buffer 1 W(-1) = W(0), a copy. `.data`, not detach(): a
        # buffer must not share the master's version counter, or an update through the master would look to
        # autograd like a change of the other buffer's weights that in-flight micro-batches saved.
        self._buffers = [[nn.Parameter(p.data, requires_grad=p.requires_grad) for p in masters],
                         [nn.Parameter(p.detach().clone(), requires_grad=p.requires_grad) for p in masters]]
        self._installed: int | None = None
        self._pending: tuple[int, Callable[[], None]] | None = None
        """A started update: the buffer it writes, and what finishes it."""

    def step_of(self, chunk: int) -> int:
        """The optimizer step a micro-batch of the running window belongs to."""
        return self.first_step + chunk // self.n_microbatches

    def use(self, step: int) -> None:
        """Point the modules' parameter slots at the version batch `step` runs on, W(step - 1), finishing its
        update first if it is still under way."""
        buffer = (step + 1) % 2
        if self._pending is not None and self._pending[0] == buffer:
            self.finish()
        if self._installed == buffer:
            return
        for owner, name, i in self._slots:
            owner._parameters[name] = self._buffers[buffer][i]
        self._installed = buffer

    def finish(self) -> None:
        """Complete the started update, if any (its all-reduce, the optimizer step)."""
        if self._pending is not None:
            _, finish = self._pending
            self._pending = None
            finish()

    def restore(self) -> None:
        """Put the masters (the newest weights) back into the modules' slots."""
        for owner, name, i in self._slots:
            owner._parameters[name] = self.masters[i]
        self._installed = None

    def end_of_step(self, step: int, start_update: Callable[[], Callable[[], None]]) -> None:
        """Batch `step`'s last backward on this rank is done: hand its gradient (accumulated on W(step - 1)) to the
        masters, copy W(step) into the buffer batch `step` used and start the update (start_update: the gradients'
        reduction) that turns it into W(step + 1) there; what it returns finishes the update (the optimizer step),
        called when W(step + 1) is first needed."""
        self.finish()  # W(step), the base, complete
        used, newest = self._buffers[(step + 1) % 2], self._buffers[step % 2]
        self.restore()
        with torch.no_grad():
            for master, old, new in zip(self.masters, used, newest):
                master.grad, old.grad = old.grad, None
                old.copy_(new)
                master.data = old.data
        self._pending = ((step + 1) % 2, start_update())

    def wrap(self, stage: Any, start_update: Callable[[], Callable[[], None]]) -> None:
        """Make a torch PipelineStage run each micro-batch on its step's version, and start an update after a
        step's last backward (1F1B runs every stage's backwards in micro-batch order)."""
        forward, backward = stage.forward_one_chunk, stage.backward_one_chunk

        @functools.wraps(forward)
        def forward_one_chunk(fwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
            self.use(self.step_of(fwd_chunk_id))
            return forward(fwd_chunk_id, *args, **kwargs)

        @functools.wraps(backward)
        def backward_one_chunk(bwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
            step = self.step_of(bwd_chunk_id)
            self.use(step)
            result = backward(bwd_chunk_id, *args, **kwargs)
            if (bwd_chunk_id + 1) % self.n_microbatches == 0:
                self.end_of_step(step, start_update)
            return result

        stage.forward_one_chunk = forward_one_chunk
        stage.backward_one_chunk = backward_one_chunk
