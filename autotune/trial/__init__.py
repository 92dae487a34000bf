"""Real multi-process pipelined trial runs: launch (parent side) and worker (rank side)."""

from autotune.trial.launch import TrialOptions, TrialRunner, run_trial

__all__ = ["TrialOptions", "TrialRunner", "run_trial"]
