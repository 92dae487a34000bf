"""The Typer app, its consoles, and the one place errors become exit codes (and, with --json, one JSON object)."""

from __future__ import annotations

import contextlib
import contextvars
import json
import logging
import os
import sys
from collections.abc import Iterator, Sequence
from typing import Annotated, Any

import typer
from rich.console import Console
from typer.core import TyperGroup

from autotune.errors import EXIT_INTERNAL, EXIT_INTERRUPTED, AutotuneError

EXIT_CODES_HELP = (
    "Exit codes: 0 ok, 1 internal error, 2 bad usage/config/model file, 3 nothing fits, 4 cannot launch, "
    "130 interrupted."
)

console = Console()
err_console = Console(stderr=True)
_debug = contextvars.ContextVar("autotune_debug", default=False)
_json_asked = contextvars.ContextVar("autotune_json", default=False)
_args: contextvars.ContextVar[tuple[str, ...]] = contextvars.ContextVar("autotune_args", default=())

# The ClickException that Typer's own parse errors (bad values, unknown or missing options) derive from; Typer
# vendors click from 0.20 on, so it is found through a public exception rather than imported.
_PARSE_ERRORS: tuple[type[Exception], ...] = tuple(
    c for c in typer.BadParameter.__mro__ if c.__name__ == "ClickException"
)


class _Group(TyperGroup):
    """Typer's group, which also prints one JSON object on stdout for Typer's own parse errors under --json (the
    error itself goes to stderr as before)."""

    def main(self, args: Sequence[str] | None = None, *pargs: Any, **kwargs: Any) -> Any:
        given = tuple(sys.argv[1:] if args is None else args)
        _json_asked.set("--json" in given)
        _args.set(given)
        return super().main(args, *pargs, **kwargs)

    def invoke(self, ctx: Any) -> Any:
        try:
            return super().invoke(ctx)
        except _PARSE_ERRORS as exc:
            if _json_asked.get():
                message, code = getattr(exc, "format_message", exc.__str__)(), getattr(exc, "exit_code", 2)
                message = _redacted(message)
                print_json({"status": "error", "error": message, "exit_code": code})
            raise


app = typer.Typer(
    name="autotune",
    cls=_Group,
    help="Tune pipeline-parallel PyTorch training: micro-batches (B/M), layer split, schedule, DP x PP, "
    "under a GPU memory limit. Start with `autotune search recipes/mlp.py --gpus 2 --device cpu --batch-size 64`.\n\n"
    + EXIT_CODES_HELP,
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="markdown",
)


def _print_version(value: bool) -> None:
    """--version: autotune's version and torch's, as a tuned config's `environment` records them; torch's is read
    from its installed metadata (importing torch would take seconds)."""
    if not value:
        return
    from importlib.metadata import PackageNotFoundError, version

    import autotune

    try:
        torch_version = version("torch")
    except PackageNotFoundError:
        torch_version = "not installed"
    console.print(f"autotune {autotune.__version__} (torch {torch_version})", highlight=False)
    raise typer.Exit()


@app.callback()
def _main(
    debug: Annotated[bool, typer.Option("--debug", help="Show tracebacks and debug logs.")] = False,
    version: Annotated[
        bool,
        typer.Option("--version", is_eager=True, callback=_print_version, help="Print autotune's and torch's version."),
    ] = False,
) -> None:
    _debug.set(debug)
    logging.basicConfig(
        level=logging.DEBUG if debug else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )


def debugging() -> bool:
    """--debug was given."""
    return _debug.get()


@contextlib.contextmanager
def errors_to_exit_codes(json_output: bool = False) -> Iterator[None]:
    """Every exception a command raises becomes one line on stderr and an exit code: an AutotuneError its own code,
    Ctrl-C 130, anything else 1 as an internal error. With --json, stdout also gets one JSON object
    {"status": "error", "error": ..., "exit_code": ...}, so scripts always have one to parse. --debug re-raises,
    for the traceback."""
    try:
        yield
    except typer.Exit:
        raise
    except AutotuneError as exc:
        _fail(exc, str(exc), exc.exit_code, json_output)
    except KeyboardInterrupt:
        err_console.print("interrupted", highlight=False)
        if json_output:
            print_json({"status": "interrupted", "error": "interrupted", "exit_code": EXIT_INTERRUPTED})
        raise typer.Exit(EXIT_INTERRUPTED) from None
    except Exception as exc:  # noqa: BLE001 - a bug, or a library's own error: one line, not a traceback
        first = " ".join(str(exc).split())[:300] or "(no message)"
        _fail(exc, f"internal error: {type(exc).__name__}: {first} (rerun with --debug for the traceback)",
              EXIT_INTERNAL, json_output)


def _fail(exc: BaseException, message: str, code: int, json_output: bool) -> None:
    if _debug.get():
        raise exc
    message = _redacted(message)
    err_console.print(f"[red]error:[/red] {message}", highlight=False, soft_wrap=True, markup=True)
    if json_output:
        print_json({"status": "error", "error": message, "exit_code": code})
    raise typer.Exit(code) from None


def command_line() -> str:
    """This command as typed, for a config's header, with the --storage password masked."""
    from autotune.masking import mask_argv

    return " ".join(["autotune", *mask_argv(_args.get() or sys.argv[1:])])


def _redacted(message: str) -> str:
    """The last guard: no --storage password in an error message, whatever raised it."""
    from autotune.masking import redact

    given = _args.get()
    urls = [value for flag, value in zip(given, given[1:]) if flag == "--storage"]
    urls += [arg.split("=", 1)[1] for arg in given if arg.startswith("--storage=")]
    return redact(message, urls)


def print_json(data: Any) -> None:
    """One JSON document on stdout."""
    sys.stdout.write(json.dumps(data, indent=2, default=str) + "\n")
    sys.stdout.flush()


def start_fork_server() -> None:
    """Rank processes fork from a server that imports torch; start it now so that its import overlaps this
    process's own (torch, the model file, profiling) instead of following it."""
    from autotune.trial import server

    server.start()


def main() -> None:
    """Console entry point. Once a command is done, the interpreter's teardown is skipped (with torch loaded it costs
    ~0.7 s): output is flushed first, files are already written atomically and the study committed, and the fork
    server and any rank exit on their own when this process does."""
    try:
        app()
        code = 0
    except SystemExit as exc:
        if isinstance(exc.code, str):
            sys.stderr.write(exc.code + "\n")
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
