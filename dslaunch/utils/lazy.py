"""Submodules as attributes, imported on first access (``deepspeed.runtime.lr_schedules``).

DeepSpeed imports most of its modules when ``deepspeed`` is imported, and libraries rely on it:
accelerate reads ``deepspeed.runtime.lr_schedules.VALID_LR_SCHEDULES`` after a bare ``import
deepspeed``. dslaunch keeps imports lazy (the launcher must not import torch), so a package
answers an unknown attribute by importing its submodule of that name.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable
from types import ModuleType

__all__ = ["submodule_getattr"]


def submodule_getattr(package: str) -> Callable[[str], ModuleType]:
    """A module ``__getattr__`` for ``package`` that imports ``package.<name>`` on access.

    Raises AttributeError (as a plain attribute miss) when there is no such submodule.
    """

    def getattr_(name: str) -> ModuleType:
        full = f"{package}.{name}"
        if not name.startswith("__") and importlib.util.find_spec(full) is not None:
            return importlib.import_module(full)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return getattr_
