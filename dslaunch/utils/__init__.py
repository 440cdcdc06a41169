"""``dslaunch.utils``: the ``deepspeed.utils`` import paths scripts use (``zero_to_fp32``, the
ZeRO ``safe_get_full_*`` / ``safe_set_full_fp32_param`` and ``set_z3_leaf_modules``), and
what both the launcher and the runtime need (``ports.free_port``, ``beat``: the heartbeat wire
format, the restart variables in ``restart``), so the runtime never imports the launcher.

Submodules are imported on first access, so ``import dslaunch.utils`` never imports torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_SUBMODULES = ("beat", "ports", "restart", "zero_to_fp32")

# deepspeed.utils' functions -> the module defining them (imports torch on first access).
_FUNCTIONS = {name: "dslaunch.runtime.zero.full_state" for name in (
    "safe_get_full_fp32_param", "safe_get_full_grad", "safe_get_full_optimizer_state",
    "safe_set_full_fp32_param")} | {"set_z3_leaf_modules": "dslaunch.runtime.zero.fetcher"}

__all__ = [*_SUBMODULES, *_FUNCTIONS]


def __getattr__(name: str) -> Any:
    if name in _FUNCTIONS:
        return getattr(importlib.import_module(_FUNCTIONS[name]), name)
    if name not in _SUBMODULES:
        raise AttributeError(f"module 'dslaunch.utils' has no attribute {name!r}")
    return importlib.import_module(f"{__name__}.{name}")
