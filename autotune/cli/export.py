"""`autotune export`: a tuned config as another trainer's settings."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from autotune.cli.app import EXIT_CODES_HELP, app, errors_to_exit_codes
from autotune.cli.options import ExportTarget


@app.command(epilog=EXIT_CODES_HELP)
def export(
    config: Annotated[Path, typer.Argument(help="A tuned config written by `autotune search --output`.")],
    fmt: Annotated[
        ExportTarget,
        typer.Option(
            "--format",
            "-f",
            case_sensitive=False,
            help="torchtitan: a TOML snippet. deepspeed: a JSON config. megatron: command-line flags.",
        ),
    ],
) -> None:
    """Print a tuned config as another trainer's settings: torchtitan TOML, DeepSpeed JSON or Megatron-LM flags.

    Comments in the output name whatever the target cannot express (a schedule it lacks, an arbitrary layer split,
    bf16 activations between stages) and what to check after loading it.

    Example: `autotune export autotune.yaml --format torchtitan > pipeline.toml`
    """
    with errors_to_exit_codes():
        from autotune.config_file import load_config
        from autotune.exports import export_config

        text = export_config(load_config(config), fmt.value)
        sys.stdout.write(text)
        sys.stdout.flush()
