"""ZeRO-3 leaf modules: which modules gather their whole subtree on entry (``fetcher.py`` reads it).

A leaf module's parameters are fetched together when ZeRO-3 enters it, its children's included:
MoE blocks run their experts in a data-dependent order, and some modules read their children's
weights without calling them. The flag is the attribute ``_z3_leaf`` on the module, as
DeepSpeed's, so a model flagged here keeps its flags under either library. Below stage 3 it
changes nothing (accelerate and transformers set it for MoE models at any stage).

Modules are flagged by class (``set_z3_leaf_modules``), by their ``named_modules()`` name
(``set_z3_leaf_modules_by_name``) or by a name suffix (``set_z3_leaf_modules_by_suffix``), and by
the config's ``zero_optimization.leaf_module`` section when the engine is built
(``apply_leaf_config``), with DeepSpeed's names, arguments, returns and errors.
"""

from __future__ import annotations

from typing import Any

from dslaunch.runtime.config.zero import LeafModuleConfig
from dslaunch.utils.logging import logger

__all__ = ["set_z3_leaf_modules", "unset_z3_leaf_modules", "get_z3_leaf_modules", "z3_leaf_module",
           "z3_leaf_parameter", "set_z3_leaf_module", "set_z3_leaf_modules_by_name",
           "set_z3_leaf_modules_by_suffix", "apply_leaf_config"]


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
    """Flag every module of ``model`` whose class is (a subclass of, or is named) one of
    ``leaf_module_classes``; a name is the class's own or with its module.

    Returns the flagged modules. Raises ``ValueError`` when none matches (unless
    ``raise_if_not_found=False``), as DeepSpeed does.
    """
    return _flag(model, leaf_module_classes, True, raise_if_not_found)


def unset_z3_leaf_modules(model: Any, leaf_module_classes: list[type | str],
                          raise_if_not_found: bool = True) -> list[Any]:
    """Clear the flag ``set_z3_leaf_modules`` set; same matching and errors."""
    return _flag(model, leaf_module_classes, False, raise_if_not_found)


def _flag_named(model: Any, wanted: list[str], hit: Any, flag: bool, raise_if_not_found: bool,
                what: str) -> tuple[list[Any], list[str]]:
    """Flag the modules whose name ``hit(name, w)`` matches some ``w`` of ``wanted``; returns them
    (each once, in ``named_modules()`` order per ``w``) and the ``wanted`` that matched none."""
    named = list(model.named_modules())
    found: list[Any] = []
    missing: list[str] = []
    for w in wanted:
        matched = [m for name, m in named if hit(name, w)]
        if not matched:
            missing.append(w)
        for module in matched:
            module._z3_leaf = flag
            if all(module is not f for f in found):
                found.append(module)
    if missing and raise_if_not_found:
        raise ValueError(f"No modules {what} {missing} found in model {type(model).__name__}")
    return found, missing


def set_z3_leaf_modules_by_name(model: Any, module_names: list[str], flag: bool = True,
                                raise_if_not_found: bool = True) -> tuple[list[Any], list[str]]:
    """Flag the modules named (as ``model.named_modules()`` names them) in ``module_names``.

    Returns ``(flagged modules, names that matched none)``. Raises ``ValueError`` naming the
    missing names unless ``raise_if_not_found=False``.
    """
    return _flag_named(model, module_names, lambda name, w: name == w, flag, raise_if_not_found, "named")


def set_z3_leaf_modules_by_suffix(model: Any, module_name_suffixes: list[str], flag: bool = True,
                                  raise_if_not_found: bool = True) -> tuple[list[Any], list[str]]:
    """Flag every module whose ``named_modules()`` name ends with one of ``module_name_suffixes``.

    Returns ``(flagged modules, suffixes that matched none)``. Raises ``ValueError`` naming the
    missing suffixes unless ``raise_if_not_found=False``.
    """
    return _flag_named(model, module_name_suffixes, str.endswith, flag, raise_if_not_found, "matching suffixes")


def apply_leaf_config(model: Any, config: LeafModuleConfig) -> list[Any]:
    """Flag what ``zero_optimization.leaf_module`` names (its defaults: Hugging Face's MoE blocks).

    A name or suffix that matches nothing is a warning when the config changed the defaults (a
    model without MoE blocks is no mistake), as DeepSpeed's. Returns the flagged modules.
    """
    found = set_z3_leaf_modules(model, config.classes, raise_if_not_found=False) if config.classes else []
    by_name, missing_names = set_z3_leaf_modules_by_name(model, config.names, raise_if_not_found=False)
    by_suffix, missing_suffixes = set_z3_leaf_modules_by_suffix(model, config.name_suffixes,
                                                                raise_if_not_found=False)
    for module in by_name + by_suffix:
        if all(module is not f for f in found):
            found.append(module)
    if config.customized:
        if missing_names:
            logger.warning(f"zero_optimization.leaf_module.names: no module is named {missing_names}")
        if missing_suffixes:
            logger.warning(f"zero_optimization.leaf_module.name_suffixes: no module name ends with {missing_suffixes}")
        if not found:
            logger.warning("zero_optimization.leaf_module: matches no module of the model; ZeRO-3 gathers "
                           "each module's own parameters as usual")
    return found
