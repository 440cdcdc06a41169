"""The ZeRO stages dslaunch implements: THE one list (``STRATEGIES``), read by everything else.

The config's validation and help text (``runtime/config/``) and the engine (``strategy_class``)
read it, so adding a stage is one line here plus its module. Torch-free: config parsing imports it.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["STRATEGIES", "STAGES", "strategy_class", "stage_choices"]

# stage -> "module:Class", imported on use (keeps torch out of config parsing).
STRATEGIES = {
    0: "dslaunch.runtime.zero.stage0:Stage0",
    1: "dslaunch.runtime.zero.stage1:Stage1",
    2: "dslaunch.runtime.zero.stage2:Stage2",
    3: "dslaunch.runtime.zero.stage3:Stage3",
}

STAGES: tuple[int, ...] = tuple(STRATEGIES)


def strategy_class(stage: int) -> Any:
    """The strategy class for a ZeRO stage (the config already rejected unsupported stages)."""
    module, name = STRATEGIES[stage].split(":")
    return getattr(importlib.import_module(module), name)


def stage_choices() -> str:
    """The valid stages for a message: ``"0, 1 or 2"``."""
    names = [str(s) for s in STAGES]
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"
