"""The documentation tells the truth about the code: the status page against the import catalogue,
the README as a front page, every capability page's closing sections, and the generated reference
pages (built from the code by ``scripts/docs/reference.py``; ``make docs`` builds the site strict).
"""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
STATUSES = ("works", "differs", "not yet")


def _load_reference():
    spec = importlib.util.spec_from_file_location("docs_reference", ROOT / "scripts" / "docs" / "reference.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


reference = _load_reference()


def _table(text: str, header: str) -> list[list[str]]:
    """The rows of the Markdown table whose header line starts with ``header``, as cells."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header))
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in re.split(r"(?<!\\)\|", line.strip())[1:-1]])
    return rows


def _features() -> list[tuple[str, list[str], str]]:
    rows = _table((DOCS / "status.md").read_text(), "| feature | DeepSpeed names |")
    return [(row[0], re.findall(r"`([^`]+)`", row[1]), row[2]) for row in rows]


def test_the_status_page_agrees_with_the_import_catalogue() -> None:
    answers = {row.name: row.status for row in reference.catalogue_rows()}
    named: set[str] = set()
    for feature, names, status in _features():
        assert status in STATUSES, f"status.md: {feature!r}: status {status!r} is not one of {STATUSES}"
        assert names, f"status.md: {feature!r} names no catalogue row"
        for name in names:
            assert name in answers, f"status.md: {feature!r}: {name} is not in compat/import_catalogue.tsv"
            want = ("works",) if status != "not yet" else ("refused", "missing")
            assert answers[name] in want, (f"status.md: {feature!r} is {status!r} but the catalogue answers "
                                           f"{answers[name]!r} for {name}")
        named.update(names)
    # a module the catalogue refuses (or lacks) must be on the page as "not yet"
    not_yet = {n for _, names, status in _features() if status == "not yet" for n in names}
    unlisted = [row.name for row in reference.catalogue_rows()
                if row.kind == "module" and row.status != "works" and row.name not in not_yet]
    assert not unlisted, f"status.md: add these refused or missing modules to the features table: {unlisted}"


def test_the_generated_catalogue_tables_count_every_row() -> None:
    rows = reference.catalogue_rows()
    modules = reference.catalogue_modules(rows)
    assert sum(sum(c.values()) for c in modules.values()) == len(rows)
    assert modules["deepspeed.comm"]["works"] >= 1
    counts = reference.MARKERS["catalogue-counts"]()
    assert f"**{len(rows)}**" in counts


def test_the_readme_is_a_front_page_that_starts_with_its_two_commands() -> None:
    text = (ROOT / "README.md").read_text()
    lines = text.splitlines()
    assert len(lines) <= 250, len(lines)
    assert lines[2:5] == ["```bash", lines[3], lines[4]] and lines[3].startswith("make demo ") \
        and lines[4].startswith("make test "), lines[2:6]
    for target in re.findall(r"\]\((docs/[^)#]+)", text):
        assert (ROOT / target).is_file(), f"README.md links to {target}, which does not exist"
    headline = {row[0]: row[1] for row in _table(text, "| area | status |")}
    assert headline and set(headline.values()) <= set(STATUSES), headline
    assert "](docs/status.md)" in text


CAPABILITY_PAGES = sorted(p.name for p in DOCS.glob("*.md")
                          if p.name not in ("status.md", "architecture.md", "files.md"))


@pytest.mark.parametrize("page", CAPABILITY_PAGES)
def test_every_capability_page_ends_with_differences_then_limitations(page: str) -> None:
    headings = re.findall(r"^## (.+)$", _outside_code((DOCS / page).read_text()), flags=re.M)
    assert headings[-2:] == ["Differences from DeepSpeed", "Limitations"], f"docs/{page}: {headings[-3:]}"


def _outside_code(text: str) -> str:
    return re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)


def test_the_cli_reference_names_every_command_and_flag() -> None:
    from dslaunch.launcher.cli import SUBCOMMANDS
    from dslaunch.launcher.cli.flags import build_parser

    page = reference.cli_page()
    for name in SUBCOMMANDS:
        assert f"## `dslaunch {name}" in page
    for action in build_parser()._actions:
        for flag in set(action.option_strings) - {"-h", "--help"}:
            assert f"`{flag}`" in page, flag
    assert "## `dslaunch k8s manifest`" in page and "`--nproc_per_node`" in page


def test_the_config_reference_has_every_default_and_deepspeeds() -> None:
    from dslaunch.runtime.config import load_config
    from dslaunch.runtime.config.deepspeed_defaults import DEEPSPEED_0_19_8

    page = reference.config_page()
    cfg = load_config({"train_micro_batch_size_per_gpu": 2}, 1)
    for path in DEEPSPEED_0_19_8:
        row = next((line for line in page.splitlines() if line.startswith(f"| `{path}` |")), None)
        assert row is not None, f"{path} is missing from the config reference"
        value = cfg
        for part in path.split("."):
            value = getattr(value, part)
        if path != "zero_optimization.overlap_comm":  # null: follows the stage
            assert reference._code(value) in row, (path, row)
    assert "| `steps_per_print` |" in page and "**(differs)**" in page


def test_the_metrics_reference_lists_what_the_engine_writes() -> None:
    names = reference.metric_names()
    assert "Train/Samples/train_loss" in names and "Train/Samples/elapsed_time_ms_backward_allreduce" in names
    page = reference.metrics_page()
    assert all(f"`{name}`" in page for name in names)
