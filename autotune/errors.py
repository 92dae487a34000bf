"""The AutotuneError tree: every error a user can cause, with its exit code and a message that says how to fix it."""

from __future__ import annotations

EXIT_OK = 0
EXIT_INTERNAL = 1
EXIT_USAGE = 2
EXIT_INFEASIBLE = 3
EXIT_LAUNCH = 4
EXIT_INTERRUPTED = 130

STATUS_EXIT_CODES = {
    "ok": EXIT_OK,
    "oom": EXIT_INFEASIBLE,
    "timeout": EXIT_INTERNAL,
    "error": EXIT_INTERNAL,
    "regressed": EXIT_INTERNAL,
    "failed": EXIT_INTERNAL,
}
"""The exit code of `trial` for a trial's status and of `check` for a check's: out of memory 3, any other failure 1."""


class AutotuneError(Exception):
    """Base of every error autotune raises on purpose; the CLI prints its message in one line."""

    exit_code: int = EXIT_INTERNAL


class UsageError(AutotuneError):
    """Bad flags, a bad config or a candidate that cannot run as asked (exit 2)."""

    exit_code = EXIT_USAGE


class ModelFileError(UsageError):
    """The user's model file breaks the contract (exit 2)."""


class ConfigError(UsageError):
    """A tuned config that cannot be read or does not match the model (exit 2)."""


class InvalidCandidateError(UsageError):
    """A candidate refused before launch: indivisible batch, too few micro-batches, bad split (exit 2)."""


class StorageError(UsageError):
    """A --storage that cannot be opened: not a database URL, no driver, unreachable, no such folder (exit 2)."""


class InfeasibleError(AutotuneError):
    """Nothing fits the memory limit (exit 3)."""

    exit_code = EXIT_INFEASIBLE


class HangError(AutotuneError):
    """User code run in the tuner's own process (the model file's import, the check forward) did not return within
    the command's timeout (exit 1)."""

    exit_code = 1


class LaunchError(AutotuneError):
    """Rank processes could not be started or the device is missing (exit 4)."""

    exit_code = EXIT_LAUNCH


class ClusterError(LaunchError):
    """A multi-node run that cannot start or go on: a node did not join, disagrees, or stopped answering (exit 4)."""


class StorageUnavailableError(LaunchError):
    """The study's storage stopped answering under a running search and did not come back within the retry bound
    (exit 4; the study is kept and --resume finishes it)."""
