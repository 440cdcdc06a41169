"""ZeRO stages 0-2 as strategies behind one small interface (``strategy.ZeroStrategy``).

The engine picks a stage once from ``STRATEGIES`` and never asks the stage again.
"""

from __future__ import annotations

import importlib
from typing import Any

# stage -> "module:Class", imported on use (keeps torch out of config parsing).
STRATEGIES = {
    0: "dslaunch.runtime.zero.stage0:Stage0",
    1: "dslaunch.runtime.zero.stage1:Stage1",
    2: "dslaunch.runtime.zero.stage2:Stage2",
}


def strategy_class(stage: int) -> Any:
    """The strategy class for a ZeRO stage (the config already rejected unsupported stages)."""
    module, name = STRATEGIES[stage].split(":")
    return getattr(importlib.import_module(module), name)
