"""The finder that makes ``deepspeed.X.Y`` the module ``dslaunch.X.Y``.

It sits first on ``sys.meta_path`` (else the path finder would load a second copy of a module of
``dslaunch.runtime`` under the ``deepspeed`` name through the parent's ``__path__``) and answers
only for names under ``deepspeed.``. Its loader returns dslaunch's module as it is; the import
system stores it in ``sys.modules`` under the alias and sets it as the parent's attribute.

``python -m deepspeed.X.Y`` (DeepSpeed's documented entry points: ``deepspeed.launcher.runner``,
``deepspeed.utils.zero_to_fp32``) does not import the module: runpy asks the loader for its code
(``get_code``) and runs it as ``__main__``, with ``sys.argv[0]`` set to the spec's ``origin``. The
loader hands over dslaunch's code and the spec carries dslaunch's file as its origin.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
from types import CodeType, ModuleType
from typing import Any

_ALIAS, _TARGET = "deepspeed", "dslaunch"
_OWN = ("deepspeed._alias",)  # this package's own modules load normally


class _AliasLoader(importlib.abc.InspectLoader):
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

    def get_code(self, fullname: str) -> CodeType | None:
        """dslaunch's module code, for ``python -m deepspeed.X.Y`` (runpy runs it as ``__main__``)."""
        return self._target_loader().get_code(self._target)

    def get_source(self, fullname: str) -> str | None:
        return self._target_loader().get_source(self._target)

    def is_package(self, fullname: str) -> bool:
        return self._target_loader().is_package(self._target)

    def _target_loader(self) -> importlib.abc.InspectLoader:
        spec = importlib.util.find_spec(self._target)
        if spec is None or not isinstance(spec.loader, importlib.abc.InspectLoader):
            raise ImportError(f"no code for {self._target}", name=self._target)
        return spec.loader


class _AliasFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Any = None, target: Any = None
                  ) -> importlib.machinery.ModuleSpec | None:
        if not fullname.startswith(_ALIAS + ".") or fullname in _OWN:
            return None
        real = _TARGET + fullname[len(_ALIAS):]
        found = importlib.util.find_spec(real)
        if found is None:
            return None
        # The origin (dslaunch's file) is runpy's sys.argv[0] and __file__; it is no location, so
        # an import leaves the shared module's __file__ alone.
        return importlib.machinery.ModuleSpec(fullname, _AliasLoader(real), origin=found.origin)


def install() -> None:
    """Put the alias finder first on ``sys.meta_path`` (once per process)."""
    if not any(isinstance(f, _AliasFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _AliasFinder())
