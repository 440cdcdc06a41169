"""``deepspeed``: dslaunch under DeepSpeed's import name (the ``compat/deepspeed`` distribution).

Every ``deepspeed.X.Y`` is ``dslaunch.X.Y``, the same module object (``deepspeed.comm is
dslaunch.comm``): ``_alias`` puts a finder first on ``sys.meta_path`` that imports dslaunch's
module and registers it under the ``deepspeed`` name. No code is copied; what dslaunch lacks
fails as an ``ImportError`` naming dslaunch's module. Top-level names (``initialize``,
``init_distributed``, ``DeepSpeedEngine``, ...) are dslaunch's.
"""

from __future__ import annotations

import importlib
import importlib.metadata
from typing import Any

import dslaunch
from deepspeed._alias import install

install()

try:
    __version__ = importlib.metadata.version("deepspeed")
except importlib.metadata.PackageNotFoundError:  # imported from a source tree, not installed
    __version__ = "0.19.8+dslaunch." + dslaunch.__version__

# DeepSpeed exposes the version parts; some callers compare them.
__version_major__, __version_minor__, __version_patch__ = (int(x) for x in __version__.split("+")[0].split("."))


def __getattr__(name: str) -> Any:
    try:
        return getattr(dslaunch, name)
    except AttributeError:
        pass
    try:  # a subpackage, as ``deepspeed.comm`` after a bare ``import deepspeed``
        return importlib.import_module(f"{__name__}.{name}")
    except ModuleNotFoundError as err:
        if err.name != f"{__name__}.{name}":
            raise
    raise AttributeError(f"module 'deepspeed' (dslaunch {dslaunch.__version__}) has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(dir(dslaunch)))
