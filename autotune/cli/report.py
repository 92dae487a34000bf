"""`autotune report`: rebuild a search's report from its study."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from autotune.cli.app import app, console, err_console, errors_to_exit_codes


@app.command(
    "report",
    epilog="Exit codes: 0 written, 1 internal error, 2 no such config or study, a masked password in the config's "
    "storage URL (pass --storage), or the report folder cannot be written.",
)
def report_command(
    config: Annotated[
        Path | None,
        typer.Argument(
            help="A tuned config written by `autotune search`; its search.storage and search.study name the study."
        ),
    ] = None,
    storage: Annotated[
        str | None,
        typer.Option(help="Optuna storage URL of the study; overrides the config's (whose password is masked)."),
    ] = None,
    study_name: Annotated[str | None, typer.Option(help="The study's name; overrides the config's.")] = None,
    worker: Annotated[
        str | None,
        typer.Option(help="A study several searches shared: report the choice this worker's search made (from its "
                     "side-by-side re-runs). Default: the worker whose choice CONFIG holds, else every run."),
    ] = None,
    report_dir: Annotated[Path, typer.Option(help="Where to write report.md, figures/ and report.html.")] = Path(
        "autotune-report"
    ),
) -> None:
    """Rebuild the report of a search from its study: report.md with figures/*.png beside it, and one self-contained
    report.html (figures inlined, opens offline). It says which config was chosen, by how much it beats the
    rule-of-thumb default and why, with every trial, the warnings that apply and the exports. A study several
    searches shared gets a section per worker (what each measured on its own hardware) and says which runs chose.

    Example: `autotune report autotune.yaml --report-dir autotune-report` or
    `autotune report --storage sqlite:///.autotune/mlp-cpu-g2-b256.db --study-name mlp-cpu-g2-b256`
    """
    with errors_to_exit_codes():
        from autotune.errors import AutotuneError
        from autotune.model_file import load_model_file
        from autotune.report import write_search_report
        from autotune.report.source import load_study, locate_study

        source = locate_study(config, storage, study_name)
        result, profile = load_study(source, worker)
        spec = None
        model = Path(str(result.setup.get("model") or profile.model or ""))
        if model.name and model.is_file():
            try:
                split_at = result.setup.get("split_at")
                spec = load_model_file(model, split_at=tuple(split_at) if split_at else None)
            except AutotuneError as exc:
                err_console.print(f"[yellow]warning:[/yellow] no BatchNorm check: {exc}", highlight=False)
        with err_console.status(f"writing the report of study {source.study_name}..."):
            written = write_search_report(
                result,
                spec=spec,
                profile=profile,
                config_path=source.config_path,
                report_dir=report_dir,
                memory_limit_bytes=result.setup.get("memory_limit_bytes"),
            )
        console.print(
            f"wrote {written / 'report.md'} (figures in {written / 'figures'}) and {written / 'report.html'}",
            highlight=False,
            soft_wrap=True,
        )
