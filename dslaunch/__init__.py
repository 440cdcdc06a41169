"""dslaunch: a DeepSpeed-compatible launcher and ZeRO training engine.

A training script written for DeepSpeed runs unchanged with ``import dslaunch as deepspeed``.

The public API is resolved lazily so that ``import dslaunch`` (done by the ``dslaunch`` command
itself) never pays for importing torch: the launcher starts in milliseconds, only workers import torch.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"
# DeepSpeed's build facts, which version checks read (``deepspeed.__git_hash__``)
__git_hash__ = "unknown"
__git_branch__ = "unknown"

# name -> module that defines it; imported on first access.
_LAZY = {
    "initialize": "dslaunch.runtime.api",
    "init_distributed": "dslaunch.runtime.api",
    "add_config_arguments": "dslaunch.runtime.api",
    "DeepSpeedEngine": "dslaunch.runtime.engine",
    "heartbeat": "dslaunch.runtime.heartbeat",
    "init_inference": "dslaunch.inference.engine",
    "InferenceEngine": "dslaunch.inference.engine",
    "DslaunchError": "dslaunch.errors",
    "DeepSpeedConfigError": "dslaunch.errors",
}

# subpackages reachable as attributes, like ``deepspeed.comm`` / ``deepspeed.zero`` after ``import deepspeed``
_SUBPACKAGES = ("accelerator", "checkpoint", "checkpointing", "comm", "elasticity", "inference", "launcher", "module_inject",
                "monitor", "moe", "ops", "pipe", "profiling", "runtime", "utils", "zero")

__all__ = ["__version__", "__git_hash__", "__git_branch__", *_LAZY, *_SUBPACKAGES]


def __getattr__(name: str) -> Any:
    if name in _SUBPACKAGES:
        return importlib.import_module(f"{__name__}.{name}")
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'dslaunch' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # cache: later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY) | set(_SUBPACKAGES))
