"""``dslaunch.utils``: the ``deepspeed.utils`` import paths scripts use (``zero_to_fp32``), and
what both the launcher and the runtime need (``ports.free_port``, ``beat``: the heartbeat wire
format, the restart variables in ``restart``, host names and SLURM hostlists in ``hostlist``), so
the runtime never imports the launcher.

Submodules are imported on first access, so ``import dslaunch.utils`` never imports torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_SUBMODULES = ("beat", "hostlist", "ports", "restart", "zero_to_fp32")

__all__ = list(_SUBMODULES)


def __getattr__(name: str) -> Any:
    if name not in _SUBMODULES:
        raise AttributeError(f"module 'dslaunch.utils' has no attribute {name!r}")
    return importlib.import_module(f"{__name__}.{name}")
