"""Typed, user-facing errors shared by the launcher and the runtime.

Every error a user can cause (bad hostfile, config, flag or checkpoint) is a ``DslaunchError``
whose message alone says what is wrong and what would be valid: the CLI prints ``str(err)`` and
exits non-zero, with a traceback only under ``--verbose``.

The kinds follow torch.distributed.elastic's split:

- user errors: ``HostfileError``, ``ConfigError``, ``UsageError`` (bad input, fix and rerun);
- worker errors: ``WorkerFailedError`` (a rank exited non-zero or was killed);
- platform/infra errors: ``LaunchError`` (host unreachable, port busy, sshd refused);
- data errors: ``CheckpointError`` (missing, truncated or corrupt checkpoint on disk).
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = [
    "DslaunchError",
    "UsageError",
    "HostfileError",
    "ConfigError",
    "LaunchError",
    "WorkerFailedError",
    "CheckpointError",
    "did_you_mean",
    "shown",
    "install_excepthook",
]


class DslaunchError(Exception):
    """Base class: the message is complete and meant for the user."""

    exit_code: int = 1


class UsageError(DslaunchError):
    """A command-line flag or argument is invalid."""

    exit_code = 2


class HostfileError(DslaunchError):
    """A hostfile (or include/exclude filter) is invalid. Names the file and line."""

    def __init__(self, message: str, path: str | None = None, line: int | None = None):
        self.path, self.line = path, line
        super().__init__(f"{_where(path, line)}{message}")


def _where(path: str | None, line: int | None) -> str:
    """The ``file:line: `` prefix of file-format errors (or ``file: ``, or nothing)."""
    return f"{path}:{line}: " if path and line else (f"{path}: " if path else "")


class ConfigError(DslaunchError):
    """A ds_config value is invalid. Names the key path, e.g. ``zero_optimization.stage``."""

    def __init__(self, message: str, key: str | None = None, source: str | None = None):
        self.key, self.source = key, source
        prefix = f"{source}: " if source else ""
        prefix += f"'{key}': " if key else ""
        super().__init__(f"{prefix}{message}")


class LaunchError(DslaunchError):
    """The job could not be started: host unreachable, port busy, interpreter missing."""

    def __init__(self, message: str, host: str | None = None):
        self.host = host
        super().__init__(f"{host}: {message}" if host else message)


class WorkerFailedError(DslaunchError):
    """A worker exited non-zero or by a signal; the first failure is the root cause."""

    def __init__(self, message: str, rank: int, exit_code: int, host: str | None = None,
                 signal_name: str | None = None):
        self.rank, self.host, self.signal_name = rank, host, signal_name
        self.exit_code = exit_code
        super().__init__(message)


class CheckpointError(DslaunchError):
    """A checkpoint on disk is missing, truncated, corrupt or incompatible. Names the file."""

    def __init__(self, message: str, path: str | None = None):
        self.path = path
        super().__init__(f"{path}: {message}" if path else message)


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    """Return " (did you mean 'x'?)" for the closest choice, or "" when none is close."""
    import difflib

    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f" (did you mean '{close[0]}'?)" if close else ""


def shown(value: str, limit: int = 60) -> str:
    """``repr(value)``, cut to about ``limit`` characters: a 1 MB hostname must not make a 1 MB error."""
    if len(value) <= limit:
        return repr(value)
    return f"{value[:limit]!r}... ({len(value)} characters)"


class EnvFileError(UsageError):
    """A ``.deepspeed_env`` / ``.dslaunch_env`` line is not ``KEY=VALUE``. Names the file and line."""

    def __init__(self, message: str, path: str | None = None, line: int | None = None):
        self.path, self.line = path, line
        super().__init__(f"{_where(path, line)}{message}")


def install_excepthook() -> None:
    """Show an uncaught ``DslaunchError`` in a worker as one line instead of a traceback.

    The error's message already names the file, key and what would be valid, so a traceback
    through the user's script and our internals only hides it. Other exceptions are untouched;
    ``DSLAUNCH_VERBOSE=1`` keeps the traceback. Idempotent: installs once per process.
    """
    import os
    import sys

    previous = sys.excepthook
    if getattr(previous, "_dslaunch", False):
        return

    def hook(exc_type, exc, tb):  # type: ignore[no-untyped-def]
        if issubclass(exc_type, DslaunchError) and not os.environ.get("DSLAUNCH_VERBOSE"):
            print(f"dslaunch: error: {exc}", file=sys.stderr)
        else:
            previous(exc_type, exc, tb)

    hook._dslaunch = True  # type: ignore[attr-defined]
    sys.excepthook = hook
