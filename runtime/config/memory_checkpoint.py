"""The ds_config ``memory_checkpoint`` block: in-memory peer checkpoints (dslaunch's own, not
DeepSpeed's). Torch-free.

``{"memory_checkpoint": {"enabled": true, "interval": 5, "replicas": 1}}``: every ``interval``
optimizer steps each rank snapshots its checkpoint parts into host memory (a tmpfs, ``dir``) and
``replicas`` copies go to the next host's memory; a restarted run resumes from the newest complete
snapshot (``runtime/checkpoint/memory.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dslaunch.errors import ConfigError
from dslaunch.runtime.config.param_schema import boolean, describe, integer
from dslaunch.runtime.config.sections import _opt

__all__ = ["MemoryCheckpointConfig"]


def _dir(path: str, value: Any) -> str:
    if not isinstance(value, str) or not value.startswith("/"):
        raise ConfigError(f"must be an absolute directory in host memory (a tmpfs such as /dev/shm), got "
                          f"{describe(value)}", key=path)
    return value


@dataclass(frozen=True)
class MemoryCheckpointConfig:
    """``memory_checkpoint``: snapshots in host memory that a restart resumes from."""

    enabled: bool = _opt(False, boolean, "true or false")
    interval: int = _opt(10, integer(1), "an integer: optimizer steps between snapshots")
    replicas: int = _opt(1, integer(0, 1), "0 (own host only) or 1 (also the next host's memory)")
    dir: str = _opt("/dev/shm", _dir, "an absolute path on a tmpfs (host memory)")

    UNIMPLEMENTED = {}  # noqa: RUF012
