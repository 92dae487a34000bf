"""Real multi-process pipelined trial runs: launch (parent side), worker (rank side), server (the fork server)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from autotune.trial.launch import TrialOptions, TrialRunner, run_trial

__all__ = ["TrialOptions", "TrialRunner", "run_trial"]


def __getattr__(name: str) -> Any:
    # Lazy, so that `autotune.trial.server` can be imported (and the fork server started) before torch is.
    if name in __all__:
        from autotune.trial import launch

        return getattr(launch, name)
    raise AttributeError(name)
