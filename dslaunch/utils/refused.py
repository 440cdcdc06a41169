"""DeepSpeed names dslaunch does not implement: importable, failing on use with one line.

A script often imports a feature at its top and uses it only behind a flag (DeepSpeed's CIFAR
example imports ``deepspeed.moe.utils`` and builds ``MoE`` only with ``--moe``). So a name of a
feature dslaunch lacks imports fine and raises ``NotInDslaunchError`` ("<name>: <feature> is not
in dslaunch; <what to use instead>") when called or instantiated. A refused class stays a class:
``isinstance(x, SomeRefusedClass)`` is False, subclassing works until the first instance.

The catalogue ``compat/import_catalogue.tsv`` lists every such name (answer ``refused: ...``) and
its test checks each one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NoReturn

from dslaunch.errors import NotInDslaunchError

__all__ = ["Refusal", "refused_class", "refused_function", "refuse"]


class Refusal:
    """What a refused name says: ``feature`` (what it is) and ``instead`` (what to use)."""

    def __init__(self, feature: str, instead: str):
        self.feature, self.instead = feature, instead

    def error(self, name: str) -> NotInDslaunchError:
        return NotInDslaunchError(f"{name}: {self.feature} is not in dslaunch; {self.instead}")


def refused_class(module: str, name: str, why: Refusal) -> type:
    """A class named ``name`` (as defined in ``module``) whose instances cannot be made."""

    def __init__(self: Any, *args: Any, **kwargs: Any) -> NoReturn:
        raise why.error(f"{module}.{name}")

    body = {"__init__": __init__, "__module__": module, "__doc__": f"Not in dslaunch: {why.feature}; {why.instead}."}
    return type(name, (), body)


def refused_function(module: str, name: str, why: Refusal) -> Callable[..., NoReturn]:
    """A function named ``name`` (as defined in ``module``) that raises when called."""

    def refused(*args: Any, **kwargs: Any) -> NoReturn:
        raise why.error(f"{module}.{name}")

    refused.__name__ = refused.__qualname__ = name
    refused.__module__ = module
    refused.__doc__ = f"Not in dslaunch: {why.feature}; {why.instead}."
    return refused


def refuse(module: str, names: tuple[str, ...], why: Refusal) -> dict[str, Any]:
    """``names`` of ``module`` refused for one reason: CamelCase names become classes, the others
    functions. Meant for ``globals().update(refuse(__name__, (...), WHY))`` in the module itself."""
    return {name: (refused_class if name[:1].isupper() else refused_function)(module, name, why)
            for name in names}
