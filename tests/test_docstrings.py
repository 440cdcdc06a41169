"""Docstrings that cannot drift: a package's docstring names its modules, and what a docstring
names under ``dslaunch.`` exists.

- Every package's ``__init__`` docstring names each of its modules and subpackages as ``name.py``
  / ``name/`` (double backquotes), and names nothing else that way (a file elsewhere is written
  with its folder, ``runtime/zero/stage3.py``): a module added, moved or removed fails here until
  the docstring follows.
- Every dotted name ``dslaunch.a.b`` (or ``runtime.a.b``, ``launcher.a.b``, ``kernels.a.b``; double
  backquotes) in any module's docstring is a module, or a module and a name defined at its top
  level: a docstring naming a moved module or function fails.
"""

from __future__ import annotations

import ast
import functools
import re

from tests.source_tree import ROOT, modules

_FILE = re.compile(r"``(\w+)(\.py|/)``")  # ``x.py``, ``x/``; not ``a/x.py``
# ``dslaunch.a.b``, and the short forms ``runtime.a``, ``launcher.a``, ``kernels.a`` used for our own packages
_DOTTED = re.compile(r"``((?:dslaunch|runtime|launcher|kernels)(?:\.\w+)+)``")


def _docstring(name: str) -> str:
    return ast.get_docstring(ast.parse(modules()[name].read_text())) or ""


def submodules(package: str) -> set[str]:
    """The modules (``x.py``) and subpackages (``x/``) directly in ``package``."""
    found = set()
    for name, path in modules().items():
        head, _, last = name.rpartition(".")
        if head == package:
            found.add(f"{last}/" if path.name == "__init__.py" else f"{last}.py")
    return found


def named_modules(paragraph: str) -> set[str]:
    return {stem + kind for stem, kind in _FILE.findall(paragraph)}


@functools.cache
def _top_level_names(name: str) -> frozenset[str]:
    tree = ast.parse(modules()[name].read_text())
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
    return frozenset(names)


def dotted_names(doc: str) -> list[str]:
    """The ``dslaunch.*`` names in ``doc``, short forms completed (``runtime.x`` -> ``dslaunch.runtime.x``)."""
    return [d if d.startswith("dslaunch.") else f"dslaunch.{d}" for d in _DOTTED.findall(doc)]


def resolves(dotted: str) -> bool:
    """``dotted`` is a module, or a module plus a name defined (or imported) at its top level, or
    any name of a module that answers names lazily (a module ``__getattr__``)."""
    known = modules()
    module, rest = dotted, ""
    while module not in known and "." in module:
        module, _, tail = module.rpartition(".")
        rest = f"{tail}.{rest}" if rest else tail
    names = _top_level_names(module) if module in known else frozenset()
    return module in known and (not rest or rest.split(".")[0] in names or "__getattr__" in names)


def test_every_package_docstring_names_exactly_its_modules() -> None:
    problems = []
    for name, path in sorted(modules().items()):
        if path.name != "__init__.py":
            continue
        named, have = named_modules(_docstring(name)), submodules(name)
        if named != have:
            problems.append(f"{path.relative_to(ROOT)}: name {sorted(have - named)}; no such module "
                            f"{sorted(named - have)}")
    assert not problems, "package docstrings out of date:\n" + "\n".join(problems)


def test_every_dotted_dslaunch_name_in_a_docstring_exists() -> None:
    wrong = [f"{name}: ``{dotted}``" for name in sorted(modules())
             for dotted in dotted_names(_docstring(name)) if not resolves(dotted)]
    assert not wrong, "docstrings name what does not exist:\n" + "\n".join(wrong)


def test_the_checks_catch_a_missing_module_and_a_wrong_name() -> None:
    doc = "Modules: ``config.py`` (the config), ``zero/``, ``gone.py``; ``runtime/engine.py`` is elsewhere."
    assert named_modules(doc) == {"config.py", "zero/", "gone.py"}
    assert "engine.py" in submodules("dslaunch.runtime") and "zero/" in submodules("dslaunch.runtime")
    assert resolves("dslaunch.runtime.engine.DeepSpeedEngine") and resolves("dslaunch.runtime.zero")
    assert not resolves("dslaunch.runtime.optim.adam.adam_update")  # moved to kernels.reference
    assert dotted_names("``runtime.zero`` and ``dslaunch.kernels``, not ``torch.nn``") == [
        "dslaunch.runtime.zero", "dslaunch.kernels"]
    assert not resolves("dslaunch.runtime.engine.NoSuchThing")
