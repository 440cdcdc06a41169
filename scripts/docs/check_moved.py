"""Check that every paragraph of an old README is on a docs page or in the new README (the README -> docs/ move).

    python scripts/docs/check_moved.py OLD_README [DOCS_DIR]

A paragraph is a run of non-blank lines (a code block counts whole). Compared after collapsing
whitespace, dropping heading marks and link targets (a README anchor became ``page.md#anchor``).
Headings alone are not checked (pages retitle and merge sections). Prints each paragraph not
found, with its line; exits 1 if there is one. Read-only.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path


def _norm(text: str) -> str:
    text = re.sub(r"^<!-- section: .* -->$", "", text, flags=re.M)  # the old README's own markers
    text = re.sub(r"^#+ ", "", text, flags=re.M)
    text = re.sub(r"\]\([^)]*\)", "]()", text)
    return " ".join(text.split())


def paragraphs(text: str) -> list[tuple[int, str]]:
    """(first line, text) of each paragraph; a fenced block is one paragraph, blank lines and all;
    headings and HTML comments are left out."""
    out, cur, start, fence = [], [], 0, False
    for i, line in enumerate(text.splitlines(), 1):
        if line.startswith("```"):
            fence = not fence
        if not fence and (not line.strip() or line.startswith(("#", "<!--"))):
            if cur:
                out.append((start, "\n".join(cur)))
            cur = []
            continue  # a heading or marker is structure, not text: pages retitle and merge sections
        if not cur:
            start = i
        cur.append(line)
    if cur:
        out.append((start, "\n".join(cur)))
    return out


def main(argv: list[str]) -> int:
    old = Path(argv[0]).read_text()
    docs = Path(argv[1]) if len(argv) > 1 else Path(__file__).resolve().parents[2] / "docs"
    pages = [docs.parent / "README.md", *sorted(docs.rglob("*.md"))]  # the README is the site's index
    haystack = _norm("\n".join(p.read_text() for p in pages))
    lost = [(n, p) for n, p in paragraphs(old) if _norm(p) and _norm(p) not in haystack]
    for n, p in lost:
        print(f"{argv[0]}:{n}: not in docs/: {p[:160]!r}")
    total = len(paragraphs(old))
    print(f"{total - len(lost)} of {total} paragraphs found in {docs}")
    return 1 if lost else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
