"""Progress on stderr while commands work: a bar while profiling, a spinner while planning, the search's trials one
line each under a bar of the budget. TerminalReporter is autotune.tune's TuneReporter for the terminal."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from autotune.cli.app import err_console
from autotune.records import TrialRecord


@contextlib.contextmanager
def progress_bar(description: str) -> Iterator[Any]:
    """A transient progress bar on stderr, and the callback that advances it."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total}"),
        TimeElapsedColumn(),
        console=err_console,
        transient=True,
    ) as bar:
        task = bar.add_task(description, total=None)

        def advance(completed: int, total: int, what: str) -> None:
            bar.update(task, completed=completed, total=total, description=f"{description}: {what}")

        yield advance


class SearchProgress:
    """Live progress on stderr: trials run of the budget, each trial's result, the best so far, time left."""

    def __init__(self, budget: int) -> None:
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        self.progress = Progress(
            TextColumn("[bold]trials"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("left"),
            TimeRemainingColumn(),
            TextColumn("{task.description}"),
            console=err_console,
            transient=False,
        )
        self.task = self.progress.add_task("", total=budget)

    def __enter__(self) -> SearchProgress:
        self.progress.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.progress.__exit__(*exc)

    def phase(self, text: str) -> None:
        self.progress.console.print(f"[dim]{text}[/dim]", highlight=False)

    def trial(self, record: TrialRecord, best: TrialRecord | None, launched: int, budget: int) -> None:
        colour = {"ok": "green", "pruned": "dim", "oom": "yellow"}.get(record.outcome, "red")
        key = record.candidate.key if record.candidate else "(invalid)"
        if record.outcome == "ok":
            what = f"{record.throughput_samples_per_s:.0f} samples/s"
        else:
            what = record.reason[:120]
        self.progress.console.print(
            f"#{record.number:<3} [{colour}]{record.outcome:<8}[/{colour}] {key}  {what}", highlight=False
        )
        if best is not None and best.candidate is not None:
            best_text = f"best {best.throughput_samples_per_s:.0f} samples/s ({best.candidate.key})"
        else:
            best_text = ""
        self.progress.update(self.task, completed=launched, description=best_text)


class TerminalReporter:
    """autotune.tune's progress on stderr, as the search command shows it."""

    def profiling(self, description: str) -> contextlib.AbstractContextManager[Any]:
        return progress_bar(description)

    def planning(self, description: str) -> contextlib.AbstractContextManager[Any]:
        return err_console.status(description)

    def searching(self, budget: int) -> contextlib.AbstractContextManager[Any]:
        return SearchProgress(budget)

    def warning(self, text: str) -> None:
        err_console.print(f"[yellow]warning:[/yellow] {text}", highlight=False)
