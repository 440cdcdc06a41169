"""dslaunch's modules as the installed package names them, read from the source tree.

pyproject's ``package-dir`` maps ``dslaunch.launcher`` to ``launcher/``, ``dslaunch.runtime`` to
``runtime/``, ``dslaunch.kernels`` to ``kernels/``: the tests that read the code (layering,
docstrings) walk the folders it names, never the installed copy.
"""

from __future__ import annotations

import ast
import functools
from collections.abc import Iterator
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]

__all__ = ["ROOT", "modules", "imports"]


@functools.cache
def modules() -> dict[str, Path]:
    """Every module and package of the distribution: dotted name -> its file (``__init__.py`` for a package)."""
    with open(ROOT / "pyproject.toml", "rb") as f:
        dirs: dict[str, str] = tomllib.load(f)["tool"]["setuptools"]["package-dir"]
    found: dict[str, Path] = {}
    for name, folder in dirs.items():
        for path in (ROOT / folder).rglob("*.py"):
            rel = path.relative_to(ROOT / folder)
            parts = [name, *rel.with_suffix("").parts]
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _resolve(module: str, names: list[str]) -> Iterator[str]:
    """``from module import a, b``: the submodules named, else the module itself."""
    known = modules()
    plain = False
    for name in names:
        if f"{module}.{name}" in known:
            yield f"{module}.{name}"
        else:
            plain = True
    if plain:
        yield module


def imports(name: str) -> Iterator[tuple[int, str]]:
    """``(line, module)`` for every import in module ``name``: at any depth (inside functions too),
    relative ones resolved, and the string targets ``"dslaunch.x:attr"`` (kernel dispatch, runner
    and command tables) and ``importlib.import_module("dslaunch.x")`` resolve at run time."""
    path = modules()[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for target in _resolve(base, [a.name for a in node.names]):
                yield node.lineno, target
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            module, colon, attr = node.value.partition(":")
            if colon and module.startswith("dslaunch.") and attr.replace(".", "").isidentifier():
                yield node.lineno, module
        elif (isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None)) == "import_module"
              and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            yield node.lineno, node.args[0].value
