"""`autotune export`: a tuned config as another trainer's settings."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from autotune.cli.app import EXIT_CODES_HELP, app, err_console, errors_to_exit_codes
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
            help="torchtitan: --section.key flags in a bash array (0.3, main) or a TOML snippet (0.2). deepspeed: a "
            "JSON config with the PipelineModule code that holds the split. megatron: flags in a bash array.",
        ),
    ],
    target: Annotated[
        str | None,
        typer.Option(
            "--target",
            "-t",
            metavar="VERSION",
            help="Trainer version: torchtitan 0.2 | 0.3 | main, deepspeed 0.19, megatron 0.19 | main. "
            "Default: the installed trainer's version, else the newest release.",
        ),
    ] = None,
    validate: Annotated[
        bool,
        typer.Option(
            "--validate",
            help="Run the installed trainer's own parser and config checks on the export and read back what it "
            "understood; exit 1 if it refuses the export or reads back other values.",
        ),
    ] = False,
) -> None:
    """Print a tuned config as another trainer's settings, for one trainer version (stamped in the output).

    torchtitan 0.3 / main: a bash array AUTOTUNE_TORCHTITAN_ARGS, one `--section.key value` per line and the
    `activation-checkpoint:full|none` subcommand last; pass it after your own flags:
    `torchrun ... -m torchtitan.train --module llama3 --config llama3_8b "${AUTOTUNE_TORCHTITAN_ARGS[@]}"`.
    DeepSpeed: the JSON config, whose `_autotune_pipeline_module` lines are the PipelineModule subclass that cuts
    the model at the tuned boundaries. Megatron-LM: a bash array AUTOTUNE_MEGATRON_ARGS.

    Comments name whatever the target cannot express (a schedule it lacks, FSDP2 sharding its pipeline cannot do,
    bf16 activations between fp32 stages) and what to check. Megatron and torchtitan count transformer blocks: the
    config's layer_roles (or LAYER_ROLES in the model file) says which layers are embedding, blocks and head.

    Example: `autotune export autotune.yaml --format torchtitan --validate > torchtitan_args.sh`
    """
    with errors_to_exit_codes():
        from autotune.config_file import load_config
        from autotune.exports import export_config, validate_export

        tuned = load_config(config)
        text = export_config(tuned, fmt.value, target)
        sys.stdout.write(text)
        sys.stdout.flush()
        if validate:
            result = validate_export(tuned, fmt.value, text, target)
            err_console.print(result.line(), highlight=False, soft_wrap=True, markup=False)
            if result.status == "rejected":
                raise typer.Exit(1)
