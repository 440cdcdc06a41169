"""``deepspeed.compression.helper``: getting and setting a submodule by dotted name (plain module
surgery scripts use on their own); the compression-specific conversion is refused on use."""

from __future__ import annotations

from typing import Any

from dslaunch.compression.compress import COMPRESSION
from dslaunch.utils.refused import refused_function

__all__ = ["recursive_getattr", "recursive_setattr", "convert_conv1d_to_linear"]


def recursive_getattr(model: Any, module_name: str) -> Any:
    """``model.a.b.c`` for ``module_name="a.b.c"``."""
    for part in module_name.split("."):
        model = getattr(model, part)
    return model


def recursive_setattr(model: Any, module_name: str, module: Any) -> None:
    """Set ``model.a.b.c = module`` for ``module_name="a.b.c"``."""
    parent, _, last = module_name.rpartition(".")
    setattr(recursive_getattr(model, parent) if parent else model, last, module)


convert_conv1d_to_linear = refused_function(__name__, "convert_conv1d_to_linear", COMPRESSION)
