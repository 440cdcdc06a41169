"""Run every benchmark in scripts/bench/, one after another, and say which results are new.

Each benchmark is a standalone script that writes ``results/<name>.json`` (raw numbers) and
``results/<name>.md`` (a table with ratios against the peer measured in the same run). They run
one after another, never in parallel (they share two cores). BENCHMARKS.md is written by people
from those tables: each section carries a table, how it was run, the load and a reading, often
several calls merged. So this script never rewrites it (it once regenerated the file and dropped
that prose); it lists the result tables the run changed, whose sections then need a new reading.

Usage: ``python scripts/bench/run_all.py [name ...]`` (default: every ``*_bench.py``).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
REPORT = HERE.parent.parent / "BENCHMARKS.md"


def _benches() -> dict[str, Path]:
    """Every benchmark by its short name (``zero3`` for ``zero3_bench.py``), in name order."""
    return {p.stem.removesuffix("_bench"): p for p in sorted(HERE.glob("*_bench.py"))}


def _run(bench: Path) -> bool:
    print(f"== {bench.name}", flush=True)
    return subprocess.run([sys.executable, str(bench)], cwd=HERE.parent.parent).returncode == 0


def _tables() -> dict[Path, int]:
    return {md: md.stat().st_mtime_ns for md in RESULTS.glob("*.md")}


def changed_tables(before: dict[Path, int], after: dict[Path, int]) -> list[str]:
    """The result tables written since ``before`` (new files or a newer modification time)."""
    return sorted(md.name for md, mtime in after.items() if before.get(md) != mtime)


def main(argv: list[str]) -> int:
    benches = _benches()
    names = [name.removesuffix("_bench") for name in argv]  # ``zero3`` or ``zero3_bench``
    if unknown := [arg for arg, name in zip(argv, names, strict=True) if name not in benches]:
        print(f"run_all: no benchmark named {', '.join(unknown)}; valid: {', '.join(benches)}", file=sys.stderr)
        return 2
    before = _tables()
    failed = [benches[n].name for n in (names or benches) if not _run(benches[n])]
    changed = changed_tables(before, _tables())
    if changed:
        print(f"new results in {RESULTS}: {', '.join(changed)}; "
              f"update their sections of {REPORT} (tables and readings)")
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
