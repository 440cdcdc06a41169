"""The import catalogue ``compat/import_catalogue.tsv``: reading it, resolving its names, answering.

Each row is ``name<TAB>kind<TAB>seen_in<TAB>answer``: a dotted ``deepspeed`` name, its kind
(module, function, class, attribute, constant), where public code uses it, and dslaunch's answer:

- ``works``: it resolves under the ``deepspeed`` alias to dslaunch's implementation;
- ``refused: <line>``: it resolves, and using it (calling it, or making an instance) raises
  ``NotInDslaunchError`` whose message ends with ``<line>`` (what the feature is, what to use);
- ``missing: <why>``: not importable yet, and who or what would add it (rows a sibling change owns).

Usage (fills in the ``?`` rows ``scan.py --merge`` added, by resolving each name)::

    python scripts/catalogue/catalogue.py fill compat/import_catalogue.tsv

Run it with the venv that has dslaunch; it imports ``compat/deepspeed``'s alias from the source tree.
"""

from __future__ import annotations

import importlib
import inspect
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
TSV = ROOT / "compat" / "import_catalogue.tsv"
HEADER = "name\tkind\tseen_in\tanswer"
KINDS = ("module", "function", "class", "attribute", "constant")


@dataclass(frozen=True)
class Row:
    name: str
    kind: str
    seen_in: str
    answer: str
    line: int

    @property
    def refusal(self) -> str | None:
        return self.answer[len("refused: "):] if self.answer.startswith("refused: ") else None


def read(path: Path = TSV) -> list[Row]:
    """The rows of ``path``; ValueError naming the line of a malformed one."""
    lines = path.read_text().splitlines()
    if not lines or lines[0] != HEADER:
        raise ValueError(f"{path}:1: the header must be {HEADER!r}")
    rows = []
    for number, text in enumerate(lines[1:], start=2):
        fields = text.split("\t")
        if len(fields) != 4:
            raise ValueError(f"{path}:{number}: expected 4 tab-separated fields, got {len(fields)}")
        rows.append(Row(*fields, line=number))
    return rows


def install_alias() -> None:
    """Make ``import deepspeed`` be dslaunch in this process (``compat/deepspeed`` from the tree)."""
    if "deepspeed" not in sys.modules:
        sys.path.insert(0, str(ROOT / "compat" / "deepspeed"))
    importlib.import_module("deepspeed")


def resolve(name: str) -> Any:
    """The object ``name`` denotes: the longest importable module prefix, then attributes.

    Raises ImportError/AttributeError as a script's ``from a.b import c`` would.
    """
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        module = ".".join(parts[:cut])
        try:
            obj: Any = importlib.import_module(module)
        except ModuleNotFoundError as err:
            if err.name is not None and module.startswith(err.name):
                continue  # this prefix is no module: try a shorter one
            raise
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(f"no module for {name}")


def kind_of(name: str, obj: Any) -> str:
    if isinstance(obj, ModuleType):
        return "module"
    if inspect.isclass(obj):
        return "class"
    if callable(obj):
        return "function"
    return "constant" if name.rsplit(".", 1)[-1].isupper() else "attribute"


def use(obj: Any) -> None:
    """Use a refused name the simplest way: call it (a class: make an instance) with no arguments."""
    obj()


def is_refused(obj: Any) -> bool:
    """A name ``dslaunch.utils.refused`` made (its docstring says so)."""
    return callable(obj) and str(getattr(obj, "__doc__", "") or "").startswith("Not in dslaunch: ")


def refused_names(module: ModuleType) -> list[str] | None:
    """The public callables of a module of a feature dslaunch lacks (all refused), else None."""
    names = [n for n in getattr(module, "__all__", ()) if callable(getattr(module, n))]
    return names if names and all(is_refused(getattr(module, n)) for n in names) else None


def answer_of(name: str, obj: Any) -> str:
    """``works``, or ``refused: <line>`` when using ``obj`` (for a module: each of its names)
    raises dslaunch's refusal."""
    from dslaunch.errors import NotInDslaunchError

    if isinstance(obj, ModuleType) and refused_names(obj):
        obj = getattr(obj, refused_names(obj)[0])
    if not is_refused(obj):
        return "works"
    try:
        use(obj)
    except NotInDslaunchError as err:
        return "refused: " + str(err).split(": ", 1)[1]
    return "works"


def fill(path: Path) -> int:
    """Answer the ``?`` rows of ``path`` in place; print the names that do not resolve."""
    install_alias()
    lines = path.read_text().splitlines()
    out, unresolved = [lines[0]], []
    for text in lines[1:]:
        name, kind, seen_in, answer = text.split("\t")
        if kind == "?" or answer == "?":
            try:
                obj = resolve(name)
            except (ImportError, AttributeError) as err:
                unresolved.append(f"{name}: {err}")
            else:
                kind, answer = kind_of(name, obj), answer_of(name, obj)
        out.append("\t".join((name, kind, seen_in, answer)))
    path.write_text("\n".join(out) + "\n")
    for line in unresolved:
        print(line)
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] != "fill":
        sys.exit(__doc__)
    sys.exit(fill(Path(sys.argv[2])))
