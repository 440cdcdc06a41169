"""The distribution lists every package in the tree (an editable install hides a missing one)."""

from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]


def _tree_packages() -> set[str]:
    with open(ROOT / "pyproject.toml", "rb") as f:
        dirs = tomllib.load(f)["tool"]["setuptools"]["package-dir"]
    found = set()
    for name, folder in dirs.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder)
            found.add(".".join([name, *rel.parts]))
    return found


def test_every_package_in_the_tree_is_in_pyproject():
    with open(ROOT / "pyproject.toml", "rb") as f:
        listed = set(tomllib.load(f)["tool"]["setuptools"]["packages"])
    missing = _tree_packages() - listed
    assert not missing, f"add to pyproject [tool.setuptools] packages: {sorted(missing)}"
