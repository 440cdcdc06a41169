"""Freeing a finished job's in-memory checkpoints (``runtime/checkpoint/memory.py``).

The ranks say where their host's store is (a ``memory_store`` event per host and run); when the
job ends, the controller removes those it can reach (this host's, or all of them where the hosts
share the file system, as the namespace test cluster does). Only a directory named as the job's
own (``dslaunch-<uid>-<job id>``) is ever removed. Torch-free.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterable
from typing import Any

__all__ = ["free_memory_stores"]


def free_memory_stores(events: Iterable[dict[str, Any]], job_id: str) -> list[str]:
    """Remove the job's memory stores the events name; returns the directories removed."""
    own = f"dslaunch-{os.getuid()}-{job_id}"
    removed = []
    for path in dict.fromkeys(e.get("path") for e in events if e.get("kind") == "memory_store"):
        if isinstance(path, str) and os.path.basename(path) == own and os.path.isdir(path):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed
