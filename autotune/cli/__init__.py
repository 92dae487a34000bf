"""The `autotune` command (Typer): each command parses its flags, calls the library, renders the result and maps
errors to exit codes (cli.app); no logic lives here."""

# isort: off
# Each import registers its commands; --help lists them in this order.
from autotune.cli import trial, export, plan, search, check, report  # noqa: F401
# isort: on
from autotune.cli.app import app, main
from autotune.cli.options import ExportTarget

__all__ = ["ExportTarget", "app", "main"]
