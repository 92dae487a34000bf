"""The fork server that rank processes are forked from, torch preloaded. Importing this module does not import torch,
so a command can start the server first and import torch itself while the server does the same."""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import sys
from collections.abc import Iterator
from typing import Any

PRELOAD = ["torch", "torch.distributed.pipelining", "autotune.trial.worker"]


def context() -> Any:
    """The multiprocessing context ranks start from."""
    ctx = multiprocessing.get_context("forkserver")
    # torchrun's default too: one OpenMP thread per rank. Read by the fork server when it starts; a CUDA rank sets
    # its own share of the cores (devices.rank_threads).
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def start() -> int | None:
    """Start the fork server if it is not running (it preloads torch in the background); return its pid."""
    from multiprocessing import forkserver

    context()
    with main_module_hidden():
        forkserver.ensure_running()
    return getattr(_forkserver(), "_forkserver_pid", None)


def close_alive_pipe() -> None:
    """In a rank: close the write end of the server's "tuner alive" pipe that multiprocessing hands every child.
    While a rank held it, the server would never see the tuner die, and so never exit with it."""
    server = _forkserver()
    alive_fd = getattr(server, "_forkserver_alive_fd", None)
    if alive_fd is not None:
        os.close(alive_fd)
        server._forkserver_alive_fd = None


def _forkserver() -> Any:
    """multiprocessing's private fork-server singleton (the stdlib's; its pid and pipe are not public)."""
    from multiprocessing import forkserver

    return forkserver._forkserver  # type: ignore[attr-defined]


@contextlib.contextmanager
def main_module_hidden() -> Iterator[None]:
    """multiprocessing re-imports the caller's __main__ in every child (spawn semantics): a user's script without
    an `if __name__ == "__main__":` guard would run again in each rank. Ranks need nothing from __main__, so it is
    hidden while a rank starts."""
    main = sys.modules["__main__"]
    saved_file = main.__dict__.pop("__file__", None)
    saved_spec = getattr(main, "__spec__", None)
    main.__spec__ = None
    try:
        yield
    finally:
        main.__spec__ = saved_spec
        if saved_file is not None:
            main.__file__ = saved_file
