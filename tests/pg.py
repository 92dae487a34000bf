"""A throwaway PostgreSQL server for the shared-study tests: initdb + pg_ctl in a temp folder on a free port, trust
auth on 127.0.0.1 only, as the `postgres` user (through runuser) when the tests run as root (initdb refuses root).
`why_not()` says why one cannot be started here (the tests skip with that reason)."""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

PASSWORD = "pg-Secret-4711"
"""In every URL handed out (trust auth ignores it), so masking can be checked."""


def _bin(name: str) -> str | None:
    for folder in sorted(glob.glob("/usr/lib/postgresql/*/bin"), reverse=True):
        if os.access(f"{folder}/{name}", os.X_OK):
            return f"{folder}/{name}"
    return shutil.which(name)


def why_not() -> str | None:
    """Why no server can be started (None: it can)."""
    try:
        import psycopg  # noqa: F401
    except ImportError:
        return "psycopg is not installed (pip install -e '.[postgres]')"
    if _bin("initdb") is None or _bin("pg_ctl") is None or _bin("psql") is None:
        return "no PostgreSQL server binaries (apt-get install postgresql)"
    if os.geteuid() == 0:
        try:
            pwd.getpwnam("postgres")
        except KeyError:
            return "running as root, and there is no postgres user to run the server as"
        if shutil.which("runuser") is None:
            return "running as root without runuser"
    return None


def _options(port: int, root: Path) -> str:
    return f"-p {port} -k {root} -c listen_addresses=127.0.0.1 -c fsync=off -c max_connections=200"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    """A running server: url(db) for a database, create_database() for a fresh one, stop() and start() to take it
    away under its clients and bring it back (same port, same data)."""

    def __init__(self, root: Path, port: int, as_user: list[str]) -> None:
        self.root, self.port, self.as_user = root, port, as_user
        self._n = 0

    def _pg_ctl(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*self.as_user, _bin("pg_ctl") or "pg_ctl", "-D", str(self.root / "data"), *args],
                              capture_output=True, text=True, env={**os.environ, "LC_ALL": "C"})

    def stop(self) -> None:
        """Stop as `pg_ctl stop -m fast` does in a restart: clients' sessions are ended, their connections drop."""
        done = self._pg_ctl("-m", "fast", "-w", "stop")
        if done.returncode != 0:
            raise RuntimeError(f"pg_ctl stop failed: {done.stderr[-500:]}")

    def start(self) -> None:
        """Start it again, on the same port, and wait until it accepts connections."""
        done = self._pg_ctl("-l", str(self.root / "log"), "-w", "-t", "30", "-o", _options(self.port, self.root),
                            "start")
        if done.returncode != 0:
            raise RuntimeError(f"postgres did not start again: {(self.root / 'log').read_text()[-500:]}")

    def url(self, database: str = "autotune") -> str:
        return f"postgresql://autotune:{PASSWORD}@127.0.0.1:{self.port}/{database}"

    def psql(self, sql: str) -> None:
        subprocess.run([*self.as_user, _bin("psql") or "psql", "-h", "127.0.0.1", "-p", str(self.port), "-U",
                        "autotune", "-d", "postgres", "-qc", sql], check=True, capture_output=True)

    def create_database(self) -> str:
        """A fresh, empty database; its URL."""
        self._n += 1
        name = f"db{self._n}"
        self.psql(f"CREATE DATABASE {name}")
        return self.url(name)


@contextlib.contextmanager
def throwaway_server() -> Iterator[Server]:
    """Start a server (about a second), yield it, stop it (no process left)."""
    why = why_not()
    if why:
        raise RuntimeError(why)
    root = Path(tempfile.mkdtemp(prefix="autotune-pg-"))
    as_user: list[str] = []
    if os.geteuid() == 0:
        pw = pwd.getpwnam("postgres")
        os.chown(root, pw.pw_uid, pw.pw_gid)
        as_user = ["runuser", "-u", "postgres", "--"]
    data = root / "data"
    env = {**os.environ, "LC_ALL": "C"}
    subprocess.run([*as_user, _bin("initdb"), "-D", str(data), "-U", "autotune", "-A", "trust", "--no-sync", "-E",
                    "UTF8"], check=True, capture_output=True, env=env)
    started = False
    try:
        for _ in range(5):  # the free port may be taken between choosing and binding it
            port = _free_port()
            options = _options(port, root)
            done = subprocess.run([*as_user, _bin("pg_ctl"), "-D", str(data), "-l", str(root / "log"), "-w", "-t",
                                   "30", "-o", options, "start"], capture_output=True, env=env, text=True)
            if done.returncode == 0:
                started = True
                break
        if not started:
            raise RuntimeError(f"postgres did not start: {(root / 'log').read_text()[-500:]}")
        server = Server(root, port, as_user)
        server.psql("CREATE DATABASE autotune")
        yield server
    finally:
        if started:
            subprocess.run([*as_user, _bin("pg_ctl"), "-D", str(data), "-m", "immediate", "-w", "stop"],
                           capture_output=True, env=env)
        shutil.rmtree(root, ignore_errors=True)
