"""The import catalogue ``compat/import_catalogue.tsv``: reading it, resolving its names, answering.

Each row is ``name<TAB>kind<TAB>seen_in<TAB>answer``: a dotted ``deepspeed`` name, its kind
(module, function, class, attribute, constant), where public code uses it, and dslaunch's answer:

- ``works``: it resolves under the ``deepspeed`` alias to dslaunch's implementation;
- ``refused: <line>``: it resolves, and using it (calling it, or making an instance) raises
  ``NotInDslaunchError`` whose message ends with ``<line>`` (what the feature is, what to use);
- ``missing: <why>``: not importable yet, and who or what would add it (rows a sibling change owns).

Usage::

    python scripts/catalogue/catalogue.py fill compat/import_catalogue.tsv   # answer the ``?`` rows
    python scripts/catalogue/catalogue.py check compat/import_catalogue.tsv  # one JSON verdict a row

``fill`` answers the rows ``scan.py --merge`` added by resolving each name; ``check`` verifies every
row against dslaunch (``tests/compat/test_import_catalogue.py`` runs it). Run either with the venv
that has dslaunch; they import ``compat/deepspeed``'s alias from the source tree.
"""

from __future__ import annotations

import importlib
import inspect
import json
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


def verdict(row: Row) -> str | None:
    """What is wrong with ``row`` (None: it holds). A ``missing`` row holds while it stays missing."""
    try:
        obj = resolve(row.name)
    except (ImportError, AttributeError) as err:
        return None if row.answer.startswith("missing: ") else f"does not resolve: {type(err).__name__}: {err}"
    except Exception as err:  # noqa: BLE001 (a script would die at this import: that is the finding)
        return f"dies at import: {type(err).__name__}: {err}"
    if row.answer.startswith("missing: "):
        return "resolves now: give it its answer (works or refused)"
    if row.kind not in KINDS or kind_of(row.name, obj) != row.kind:
        return f"kind is {kind_of(row.name, obj)}, the row says {row.kind}"
    if row.answer == "works":
        refused = is_refused(obj) or (isinstance(obj, ModuleType) and refused_names(obj))
        return "refused on use, the row says works" if refused else None
    if row.refusal is None:
        return f"answer must be works, refused: <line> or missing: <why>, got {row.answer!r}"
    uses = [getattr(obj, n) for n in refused_names(obj) or ()] if isinstance(obj, ModuleType) else [obj]
    if not uses:
        return "imports, but has no refused name to use"
    return next(filter(None, (_refusal_problem(row, u) for u in uses)), None)


def _refusal_problem(row: Row, obj: Any) -> str | None:
    from dslaunch.errors import NotInDslaunchError

    try:
        use(obj)
    except NotInDslaunchError as err:
        text = str(err)
        if "\n" in text or not text.endswith(": " + row.refusal) or not isinstance(err, NotImplementedError):
            return f"refusal is {text!r}"
        return None
    except Exception as err:  # noqa: BLE001
        return f"raised {type(err).__name__}: {err} instead of the refusal"
    return "did not refuse"


def check(path: Path) -> int:
    """Print ``{"name": ..., "problem": ...}`` per row (problem null when the row holds)."""
    install_alias()
    for row in read(path):
        print(json.dumps({"name": row.name, "problem": verdict(row)}), flush=True)
    return 0


if __name__ == "__main__":
    commands = {"fill": fill, "check": check}
    if len(sys.argv) != 3 or sys.argv[1] not in commands:
        sys.exit(__doc__)
    sys.exit(commands[sys.argv[1]](Path(sys.argv[2])))
