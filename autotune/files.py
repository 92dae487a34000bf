"""Atomic file writes: a reader (or a SIGTERM mid-write) sees the old file or the new one, never a torn one."""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any


def atomic_write_bytes(path: Path, data: bytes, *, mode: int | None = None, durable: bool = True) -> None:
    """Temp file in the same directory, fsync, then os.replace over the target (atomic on POSIX and Windows).

    The new file keeps the mode of the one it replaces (0o644 for a new file) unless `mode` is given; the folder is
    created when missing. durable=False skips the fsyncs (a cache: after a crash the file is whole or absent, only
    perhaps older; ~10 ms a file saved)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if mode is None:
        try:
            mode = path.stat().st_mode & 0o777
        except FileNotFoundError:
            mode = 0o644
    fd, tmp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as tmp:
            tmp.write(data)
            if durable:
                tmp.flush()
                os.fsync(tmp.fileno())
        os.chmod(tmp_name, mode)
        os.replace(tmp_name, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp_name)
        raise
    if not durable:
        return
    with contextlib.suppress(OSError, AttributeError):  # make the rename itself durable where the OS allows
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)


def ensure_writable(path: Path, *, folder: bool = False) -> None:
    """Raise OSError now when `path` (a file, or with folder=True a folder) could not be written later: a command
    that runs for minutes checks its outputs first. Creates missing parent folders (the write would), leaves no
    file behind."""
    path = Path(path)
    if not folder and path.is_dir():
        raise IsADirectoryError(21, "is a directory", str(path))
    target = path if folder else path.parent
    if target.exists() and not target.is_dir():
        raise NotADirectoryError(20, "not a directory", str(target))
    target.mkdir(parents=True, exist_ok=True)
    fd, probe = tempfile.mkstemp(dir=target, prefix=".autotune-probe-", suffix=".tmp")
    os.close(fd)
    os.unlink(probe)


def atomic_write_text(path: Path, text: str, *, mode: int | None = None) -> None:
    """atomic_write_bytes of UTF-8 text with "\\n" line ends."""
    atomic_write_bytes(path, text.encode("utf-8"), mode=mode)


def atomic_write_json(path: Path, data: Any) -> None:
    """atomic_write_text of one JSON document."""
    atomic_write_text(path, json.dumps(data))
