"""The rank process's entry point, apart from RankJob (job.py) so that neither the launcher nor the worker imports
the other's side: launch -> entry -> worker -> job."""

from __future__ import annotations

from autotune.trial.job import RankJob


def start_rank(job: RankJob) -> None:
    """Process target: the fork server preloads the worker, so this import is free in the child."""
    from autotune.trial.worker import run_rank

    run_rank(job)
