"""MkDocs hooks (``mkdocs.yml`` ``hooks:``): the generated pages, added at build time, never written to docs/.

- ``reference.PAGES``: the CLI, ds_config and metrics references, from the code;
- ``index.md``: the repository's README.md, its ``docs/`` links made relative to the site (one copy);
- ``benchmarks.md``: the repository's BENCHMARKS.md as a page (one copy, kept at the root);
- ``<!-- generated: NAME -->`` on a hand-written page: replaced by ``reference.MARKERS[NAME]()``.
"""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

_HERE = Path(__file__).resolve().parent
_MARKER = re.compile(r"<!-- generated: ([\w-]+) -->")
_REPO_LINK = re.compile(r"\[([^\]]+)\]\((?!https?:|#|docs/)([^)#]+)(#[^)]*)?\)")


def _repo_links_as_paths(markdown: str) -> str:
    """``[text](scripts/x.md)`` -> ``text (`scripts/x.md`)``: a repository file is not a page of the site."""
    return _REPO_LINK.sub(lambda m: f"{m.group(1)} (`{m.group(2)}`)", markdown)


def _reference() -> Any:
    spec = importlib.util.spec_from_file_location("docs_reference", _HERE / "reference.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def on_files(files: Files, config: Any) -> Files:
    reference = _reference()
    for path, page in reference.PAGES.items():
        files.append(File.generated(config, path, content=page()))
    readme = _repo_links_as_paths((reference.ROOT / "README.md").read_text()).replace("](docs/", "](")
    files.append(File.generated(config, "index.md", content=readme))
    benchmarks = _repo_links_as_paths((reference.ROOT / "BENCHMARKS.md").read_text())
    files.append(File.generated(config, "benchmarks.md", content=benchmarks))
    return files


def on_page_markdown(markdown: str, page: Any, config: Any, files: Files) -> str:
    markers = _reference().MARKERS

    def fill(match: re.Match[str]) -> str:
        name = match.group(1)
        if name not in markers:
            raise SystemExit(f"{page.file.src_uri}: unknown marker <!-- generated: {name} -->; known: {', '.join(markers)}")
        return markers[name]()

    return _MARKER.sub(fill, markdown)
