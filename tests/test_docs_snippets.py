"""Every code block the docs mark runnable runs, so the examples cannot rot.

A fenced ``bash`` or ``python`` block right after a ``<!-- runnable -->`` line in README.md or a
page under docs/ is executed from the repository root: bash with ``set -euo pipefail`` and this
venv's ``bin`` first on PATH, python with this interpreter. A page's blocks run in page order, one
test per page, since a walk-through builds on its earlier steps (``dslaunch status`` reads the job
run before it). Each page gets its own log directory (``DSLAUNCH_LOG_DIR``) and, for the launch
command, a free rendezvous port (a shell function puts ``--master_port`` first when the first
argument is a flag), so tests may run side by side.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.distributed import free_port

ROOT = Path(__file__).resolve().parents[1]
MARKER = "<!-- runnable -->"
_FENCE = re.compile(r"^```(\w+)\s*$")
_TIMEOUT_S = 90


@dataclass(frozen=True)
class Snippet:
    where: str  # file:line of the marker
    language: str
    code: str


def snippets(root: Path = ROOT) -> list[Snippet]:
    """The runnable blocks of README.md and docs/**/*.md, in file order."""
    found = []
    for path in [root / "README.md", *sorted((root / "docs").rglob("*.md"))]:
        lines = path.read_text().splitlines()
        for i, line in enumerate(lines):
            if line.strip() != MARKER:
                continue
            where = f"{path.relative_to(root)}:{i + 1}"
            fence = _FENCE.match(lines[i + 1]) if i + 1 < len(lines) else None
            if not fence or fence.group(1) not in ("bash", "python"):
                raise AssertionError(f"{where}: {MARKER} must be followed by a ```bash or ```python block")
            end = lines.index("```", i + 2)
            found.append(Snippet(where, fence.group(1), "\n".join(lines[i + 2:end]) + "\n"))
    return found


_LAUNCH_PORT = 'dslaunch() { if [[ "${1:-}" == -* ]]; then command dslaunch --master_port "$SNIPPET_PORT" "$@"; ' \
               'else command dslaunch "$@"; fi; }\n'


def test_the_docs_have_runnable_blocks_and_every_marker_is_well_formed() -> None:
    found = snippets()
    assert len(found) >= 4
    assert any(s.where.startswith("README.md") for s in found)


def _pages() -> dict[str, list[Snippet]]:
    pages: dict[str, list[Snippet]] = {}
    for snippet in snippets():
        pages.setdefault(snippet.where.partition(":")[0], []).append(snippet)
    return pages


@pytest.mark.timeout(180)
@pytest.mark.parametrize("page", sorted(_pages()))
def test_runnable_blocks_of(page: str, tmp_path: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DSLAUNCH_LOG_DIR": str(tmp_path / "logs"),
           "SNIPPET_PORT": str(free_port()), "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    for snippet in _pages()[page]:
        if snippet.language == "bash":
            command = ["bash", "-c", "set -euo pipefail\n" + _LAUNCH_PORT + snippet.code]
        else:
            command = [sys.executable, "-c", snippet.code]
        proc = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=_TIMEOUT_S)
        assert proc.returncode == 0, (f"{snippet.where} exited {proc.returncode}:\n{proc.stdout[-2000:]}\n"
                                      f"{proc.stderr[-3000:]}")
