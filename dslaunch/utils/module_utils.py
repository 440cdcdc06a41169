"""``deepspeed.utils.module_utils`` (DeepSpeed 0.19.8's home for them; ``deepspeed.compression.helper``
re-exports them): a submodule got or set by its dotted name."""

from __future__ import annotations

from typing import Any

__all__ = ["recursive_getattr", "recursive_setattr"]


def recursive_getattr(model: Any, module_name: str) -> Any:
    """``model.a.b.c`` for ``module_name="a.b.c"``."""
    for part in module_name.split("."):
        model = getattr(model, part)
    return model


def recursive_setattr(model: Any, module_name: str, module: Any) -> None:
    """Set ``model.a.b.c = module`` for ``module_name="a.b.c"``."""
    parent, _, last = module_name.rpartition(".")
    setattr(recursive_getattr(model, parent) if parent else model, last, module)
