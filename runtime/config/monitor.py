"""The ds_config ``monitor`` block (dslaunch's own): the launcher's monitor and restart settings,
kept with the rest of a job's configuration.

``{"monitor": {"hang_timeout": 300, "max_restarts": 2, "log_dir": "runs/logs"}}``

The keys are the launcher flags' names (``--hang_timeout``, ``--max_restarts``, ``--log_dir``)
with their meaning and ranges (``log_dir`` relative to the working directory, as the flag); a
flag given on the command line wins over the block. The
controller reads the block from the file named by ``--deepspeed_config`` before anything starts
(``monitor_block``, torch-free); the runtime accepts it and leaves it to the launcher.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dslaunch.errors import ConfigError
from dslaunch.runtime.config.file import read_config_file
from dslaunch.runtime.config.param_schema import describe, integer, number
from dslaunch.runtime.config.sections import _opt, optional, parse_section
from dslaunch.utils.beat import MAX_HANG_TIMEOUT, MIN_HANG_TIMEOUT
from dslaunch.utils.restart import MAX_RESTARTS

__all__ = ["MonitorConfig", "monitor_block"]


def _path(path: str, value: Any) -> str:
    if not isinstance(value, str) or not value or "\0" in value:
        raise ConfigError(f"must be a directory path (a non-empty string without NUL), got {describe(value)}",
                          key=path)
    return value


@dataclass(frozen=True)
class MonitorConfig:
    """``monitor``: what ``--hang_timeout``, ``--max_restarts`` and ``--log_dir`` say, from the file."""

    hang_timeout: float | None = _opt(None, optional(number(MIN_HANG_TIMEOUT, MAX_HANG_TIMEOUT)),
                                      "seconds without progress before a rank is hung, or null (off)")
    max_restarts: int | None = _opt(None, optional(integer(0, MAX_RESTARTS)),
                                    "how many times to restart the job after a failure")
    log_dir: str | None = _opt(None, optional(_path), "where each job writes events.jsonl, error "
                               "files and stacks")

    UNIMPLEMENTED = {}  # noqa: RUF012


def monitor_block(path: str) -> MonitorConfig:
    """The ``monitor`` block of the ds_config at ``path`` (an empty block when it has none).

    Raises:
        ConfigError: an unreadable or malformed file, or a bad ``monitor`` block (naming the key).
    """
    raw = read_config_file(Path(path))
    block = raw.get("monitor") if isinstance(raw, dict) else None
    try:
        return parse_section(MonitorConfig, block, "monitor")
    except ConfigError as err:
        raise ConfigError(str(err), source=path) from None
