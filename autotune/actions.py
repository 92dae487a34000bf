"""What a rank runs: one compute action of a pipeline schedule (shared by schedules, vshape, the action graph, the
simulator and the runtime; a module of its own so that vshape needs nothing of schedules)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

ActionKind = Literal["F", "B", "I", "W"]
"""F forward; B full backward; I backward for inputs only; W backward for weights only (zero-bubble split)."""


@dataclass(frozen=True)
class Action:
    """One compute action of a rank: run `kind` for micro-batch `microbatch` of stage `stage`."""

    stage: int
    kind: ActionKind
    microbatch: int
    fused_with_next: bool = field(default=False, compare=False)
    """torch runs this action and the rank's next one as one (DualPipeV's OVERLAP_F_B: a forward, then a backward
    of the other stage) and posts both one's sends after the second. Not part of the action's identity."""

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.microbatch}"
