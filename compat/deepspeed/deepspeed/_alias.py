"""The finder that makes ``deepspeed.X.Y`` the module ``dslaunch.X.Y``.

It sits first on ``sys.meta_path`` (else the path finder would load a second copy of a module of
``dslaunch.runtime`` under the ``deepspeed`` name through the parent's ``__path__``) and answers
only for names under ``deepspeed.``. Its loader returns dslaunch's module as it is; the import
system stores it in ``sys.modules`` under the alias and sets it as the parent's attribute.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
from types import ModuleType
from typing import Any

_ALIAS, _TARGET = "deepspeed", "dslaunch"
_OWN = ("deepspeed._alias",)  # this package's own modules load normally


class _AliasLoader(importlib.abc.Loader):
    def __init__(self, target: str):
        self._target = target
        self._spec: importlib.machinery.ModuleSpec | None = None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        module = importlib.import_module(self._target)
        self._spec = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        # The import system stamped the alias spec on the shared module: give it back its own,
        # so reloads and pickling by module name keep seeing dslaunch's names.
        module.__spec__ = self._spec


class _AliasFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Any = None, target: Any = None
                  ) -> importlib.machinery.ModuleSpec | None:
        if not fullname.startswith(_ALIAS + ".") or fullname in _OWN:
            return None
        real = _TARGET + fullname[len(_ALIAS):]
        if importlib.util.find_spec(real) is None:
            return None
        return importlib.machinery.ModuleSpec(fullname, _AliasLoader(real))


def install() -> None:
    """Put the alias finder first on ``sys.meta_path`` (once per process)."""
    if not any(isinstance(f, _AliasFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _AliasFinder())
