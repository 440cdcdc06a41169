"""DeepSpeed's ZeRO-3 leaf-module flags (``set_z3_leaf_modules`` and friends).

A leaf module's parameters are fetched together when ZeRO-3 enters it (MoE experts run in a
data-dependent order). The flag is the attribute ``_z3_leaf`` on the module, as DeepSpeed's, so a
model flagged here keeps its flags under either library. Below stage 3 it changes nothing:
accelerate and transformers set it for MoE models at any stage.
"""

from __future__ import annotations

from typing import Any

__all__ = ["set_z3_leaf_modules", "unset_z3_leaf_modules", "get_z3_leaf_modules", "z3_leaf_module",
           "z3_leaf_parameter", "set_z3_leaf_module"]


def z3_leaf_module(module: Any) -> bool:
    return bool(getattr(module, "_z3_leaf", False))


def z3_leaf_parameter(param: Any) -> bool:
    return hasattr(param, "ds_z3_leaf_module")


def get_z3_leaf_modules(model: Any) -> list[Any]:
    return [m for m in model.modules() if z3_leaf_module(m)]


def set_z3_leaf_module(model: Any, flag: bool) -> None:
    model._z3_leaf = flag


def _matches(module: Any, wanted: type | str) -> bool:
    if isinstance(wanted, type):
        return isinstance(module, wanted)
    cls = type(module)
    return wanted in (cls.__name__, f"{cls.__module__}.{cls.__qualname__}")


def _flag(model: Any, leaf_module_classes: list[type | str], flag: bool, raise_if_not_found: bool) -> list[Any]:
    bad = [c for c in leaf_module_classes if not isinstance(c, (type, str))]
    if bad:
        raise TypeError(f"leaf_module_classes must hold classes or class names, got {bad[0]!r}")
    found = [m for m in model.modules() if any(_matches(m, c) for c in leaf_module_classes)]
    for module in found:
        module._z3_leaf = flag
    if not found and raise_if_not_found:
        raise ValueError(f"No modules of type {leaf_module_classes} found in model {type(model).__name__}")
    return found


def set_z3_leaf_modules(model: Any, leaf_module_classes: list[type | str],
                        raise_if_not_found: bool = True) -> list[Any]:
    """Flag every module of ``model`` whose class is (or is named) one of ``leaf_module_classes``.

    Returns the flagged modules. Raises ``ValueError`` when none matches (unless
    ``raise_if_not_found=False``), as DeepSpeed does.
    """
    return _flag(model, leaf_module_classes, True, raise_if_not_found)


def unset_z3_leaf_modules(model: Any, leaf_module_classes: list[type | str],
                          raise_if_not_found: bool = True) -> list[Any]:
    """Clear the flag ``set_z3_leaf_modules`` set; same matching and errors."""
    return _flag(model, leaf_module_classes, False, raise_if_not_found)
