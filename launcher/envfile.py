"""Environment propagation to remote hosts: exported prefixes plus ``.deepspeed_env`` files.

A job started over SSH does not inherit the controller's environment (sshd starts a fresh one),
so the runner sends an explicit set of variables with every node's spec. That set is, lowest
precedence first:

1. variables of the controller's environment whose name starts with one of ``EXPORT_PREFIXES``:
   the prefixes DeepSpeed exports (NCCL, PYTHON, UCX, MV2, MLFLOW) plus CUDA, TORCH and GLOO;
2. the ``KEY=VALUE`` lines of ``~/.deepspeed_env``, ``~/.dslaunch_env``, then ``./.deepspeed_env``,
   ``./.dslaunch_env`` (the current directory is more specific than home, so it wins), then the file
   named by ``$DS_ENV_FILE`` if set (as in DeepSpeed).

File grammar: one ``KEY=VALUE`` per line; blank lines and lines starting with ``#`` are ignored;
an optional leading ``export`` is accepted; the value is everything after the first ``=`` (it may
contain ``=`` and ``#``), surrounding whitespace is trimmed and one pair of matching quotes removed;
CRLF line ends are accepted. The file is UTF-8 (or UTF-16 with a byte-order mark) of at most
``MAX_ENV_FILE_BYTES``. Anything else raises ``EnvFileError`` naming ``file:line``.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path

from dslaunch.errors import EnvFileError, quote
from dslaunch.textfile import read_text

__all__ = ["EXPORT_PREFIXES", "ENV_FILE_NAMES", "MAX_ENV_FILE_BYTES", "parse_env_file", "env_file_paths",
           "collect_env"]

# Linux caps the whole environment of a new process at about 2 MiB (ARG_MAX with the arguments).
MAX_ENV_FILE_BYTES = 2**20

EXPORT_PREFIXES = ("NCCL", "PYTHON", "UCX", "MV2", "MLFLOW", "CUDA", "TORCH", "GLOO")
ENV_FILE_NAMES = (".deepspeed_env", ".dslaunch_env")

_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def _unquote(value: str) -> str:
    if len(value) >= 2 and value[0] == value[-1] and value[0] in "\"'":
        return value[1:-1]
    return value


def _parse_line(text: str, path: str, lineno: int) -> tuple[str, str] | None:
    line = text.rstrip("\r\n").strip()
    if not line or line.startswith("#"):
        return None
    if line.startswith("export ") or line.startswith("export\t"):
        line = line[len("export"):].lstrip()
    key, sep, value = line.partition("=")
    key = key.strip()
    if not sep:
        raise EnvFileError(f"expected KEY=VALUE, got {quote(line)}", path, lineno)
    if not _KEY.fullmatch(key):
        raise EnvFileError(f"{quote(key)} is not a valid variable name (ASCII letters, digits, '_'; "
                           "not starting with a digit)", path, lineno)
    return key, _unquote(value.strip())


def parse_env_file(path: str | os.PathLike) -> dict[str, str]:
    """Read one env file.

    Args:
        path: the file (``.deepspeed_env`` grammar, see the module docstring).

    Returns:
        The variables in file order; a key given twice keeps its last value.

    Raises:
        EnvFileError: a line is not ``KEY=VALUE``, or the file cannot be read, is not a regular
            file, is too large or is not text; names file:line.
    """
    raw = read_text(path, MAX_ENV_FILE_BYTES, lambda message, line: EnvFileError(message, str(path), line))
    result: dict[str, str] = {}
    # Only "\n" ends a line: splitlines() also splits on \x0b, \x0c, \x1c-\x1e, \x85, U+2028 and
    # U+2029, which would turn the rest of a comment into a live assignment; values may hold them.
    for lineno, text in enumerate(raw.split("\n"), start=1):
        parsed = _parse_line(text, str(path), lineno)
        if parsed:
            result[parsed[0]] = parsed[1]
    return result


def env_file_paths(cwd: str | os.PathLike, home: str | os.PathLike,
                   environ: Mapping[str, str]) -> list[Path]:
    """The env files that exist, lowest precedence first (home, cwd, ``$DS_ENV_FILE``)."""
    candidates = [Path(home) / n for n in ENV_FILE_NAMES] + [Path(cwd) / n for n in ENV_FILE_NAMES]
    if environ.get("DS_ENV_FILE"):
        candidates.append(Path(environ["DS_ENV_FILE"]))
    seen: list[Path] = []
    for path in candidates:
        if path.is_file() and path.resolve() not in [p.resolve() for p in seen]:
            seen.append(path)
    return seen


def collect_env(environ: Mapping[str, str] | None = None, cwd: str | os.PathLike | None = None,
                home: str | os.PathLike | None = None) -> dict[str, str]:
    """The variables every remote node gets, before the launcher's own (RANK, MASTER_ADDR, ...).

    Args:
        environ: the controller's environment (default ``os.environ``).
        cwd: where to look for the local env files (default: the current directory).
        home: the home directory (default ``~``).

    Returns:
        Exported variables overlaid by the env files, in precedence order.

    Raises:
        EnvFileError: an env file is malformed (names file:line).
    """
    environ = os.environ if environ is None else environ
    cwd = os.getcwd() if cwd is None else cwd
    home = os.path.expanduser("~") if home is None else home
    env = {k: v for k, v in environ.items() if k.startswith(EXPORT_PREFIXES)}
    for path in env_file_paths(cwd, home, environ):
        env.update(parse_env_file(path))
    return env
