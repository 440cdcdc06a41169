"""List the ``deepspeed`` names a checkout of Python code imports or reads.

Usage::

    python scripts/catalogue/scan.py LABEL=DIR [LABEL=DIR ...] [--merge compat/import_catalogue.tsv]

Walks every ``*.py`` file under each DIR with ``ast`` (no code is imported or run) and records:

- ``import deepspeed.a.b`` -> ``deepspeed.a.b``;
- ``from deepspeed.a import b`` -> ``deepspeed.a.b`` (relative imports are skipped);
- attribute chains on a name bound by those imports: after ``import deepspeed``,
  ``deepspeed.runtime.utils.see_memory_usage(...)`` -> ``deepspeed.runtime.utils.see_memory_usage``;
  after ``from deepspeed import comm as dist``, ``dist.get_rank()`` -> ``deepspeed.comm.get_rank``.
  A chain ends at a call, subscript or any non-attribute, so ``get_accelerator().device_name()``
  gives ``deepspeed.accelerator.get_accelerator`` only.

Without ``--merge`` it prints ``name<TAB>count<TAB>first seen`` sorted by name. With ``--merge``
it adds the names the catalogue lacks as rows whose kind and answer are ``?`` and prints the new
rows; rows already there are kept as they are. ``catalogue.py fill`` then answers the ``?`` rows by
resolving each name (review its output: the test refuses a ``?``). Names under ``SKIP`` (DeepSpeed
internals its own benchmarks reach into), private names and method calls on values are left out.
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

ROOT = "deepspeed"
HEADER = "name\tkind\tseen_in\tanswer"

# Seen but not catalogued, and why: the catalogue is the surface scripts call, not DeepSpeed's
# internals that its own benchmarks patch. A name starting with one of these prefixes is left out.
SKIP = {
    "deepspeed.compile.passes": "DeepCompile's internal graph passes (DeepSpeedExamples benchmarks)",
    "deepspeed.inference.v2": "DeepSpeed-FastGen's ragged engine internals (benchmarks)",
    "deepspeed.inference.RaggedInferenceEngineConfig": "DeepSpeed-FastGen (benchmarks)",
    "deepspeed.comm.TorchBackend": "comm's backend object (a communication benchmark)",
    "deepspeed.runtime.state_dict_factory": "a monkey-patch of DeepSpeed's Megatron checkpoint loader",
    "deepspeed.utils.is_initialized": "not in DeepSpeed 0.19 either (transformers' ESMFold probes it in a try)",
}
# A private component, or a method call on a value (`logger.info`, `OpBuilder.is_rocm_pytorch`).
SKIP_SUFFIXES = (".info", ".warning", ".setLevel", ".append", ".update", ".apply", ".from_meta", ".is_rocm_pytorch",
                 ".register_with_transformers")


@dataclass
class Sightings:
    """Names seen, how often, and the first file each was seen in (``label:relative/path``)."""

    count: Counter = field(default_factory=Counter)
    first: dict[str, str] = field(default_factory=dict)

    def add(self, name: str, where: str) -> None:
        self.count[name] += 1
        self.first.setdefault(name, where)


def _chain(node: ast.AST) -> list[str] | None:
    """``a.b.c`` as ``["a", "b", "c"]``; None when the base is not a plain name."""
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    parts.append(node.id)
    return parts[::-1]


def names_in(tree: ast.AST) -> list[str]:
    """Every ``deepspeed`` name ``tree`` imports or reads through an imported name."""
    bound: dict[str, str] = {}  # local name -> dotted deepspeed path
    found: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == ROOT or alias.name.startswith(ROOT + "."):
                    found.append(alias.name)
                    if alias.asname:
                        bound[alias.asname] = alias.name
                    else:
                        bound[ROOT] = ROOT  # `import deepspeed.x` binds `deepspeed`
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            if node.module == ROOT or node.module.startswith(ROOT + "."):
                found.append(node.module)
                for alias in node.names:
                    if alias.name != "*":
                        full = f"{node.module}.{alias.name}"
                        found.append(full)
                        bound[alias.asname or alias.name] = full
    inner = {id(node.value) for node in ast.walk(tree) if isinstance(node, ast.Attribute)}
    for node in ast.walk(tree):
        # only the outermost attribute of a chain: `a.b.c` is seen once, not also as `a.b`
        if isinstance(node, ast.Attribute) and id(node) not in inner:
            parts = _chain(node)
            if parts and parts[0] in bound:
                found.append(".".join([bound[parts[0]], *parts[1:]]))
    return found


def scan(label: str, top: Path, seen: Sightings) -> None:
    for path in sorted(top.rglob("*.py")):
        try:
            tree = ast.parse(path.read_text(encoding="utf-8", errors="replace"))
        except SyntaxError:
            continue  # Python 2 files in old examples
        where = f"{label}:{path.relative_to(top)}"
        for name in names_in(tree):
            seen.add(name, where)


def skipped(name: str) -> bool:
    return (any(name == p or name.startswith(p + ".") for p in SKIP) or name.endswith(SKIP_SUFFIXES)
            or any(part.startswith("_") for part in name.split(".")))


def merge(catalogue: Path, seen: Sightings) -> list[str]:
    """Append rows for the names ``catalogue`` lacks (skipped ones aside); return them."""
    lines = catalogue.read_text().splitlines() if catalogue.exists() else [HEADER]
    have = {line.split("\t", 1)[0] for line in lines[1:]}
    new = [f"{name}\t?\t{seen.first[name]}\t?" for name in sorted(seen.count)
           if name not in have and not skipped(name)]
    catalogue.write_text("\n".join([*lines, *new]) + "\n")
    return new


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("sources", nargs="+", metavar="LABEL=DIR")
    parser.add_argument("--merge", type=Path, metavar="TSV", help="add the names this catalogue lacks")
    args = parser.parse_args(argv)
    seen = Sightings()
    for source in args.sources:
        label, sep, top = source.partition("=")
        if not sep or not Path(top).is_dir():
            parser.error(f"{source!r}: expected LABEL=DIR with an existing directory")
        scan(label, Path(top), seen)
    if args.merge:
        for row in merge(args.merge, seen):
            print(row)
    else:
        for name in sorted(seen.count):
            print(f"{name}\t{seen.count[name]}\t{seen.first[name]}" + ("\t(skipped)" if skipped(name) else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
