"""The import catalogue ``compat/import_catalogue.tsv``: every ``deepspeed`` name public code uses,
checked against dslaunch under the ``deepspeed`` alias.

``works`` rows resolve to the kind the row says and are not refusals; ``refused`` rows import and,
on use, raise ``NotInDslaunchError`` (a ``NotImplementedError`` too) with one line ending in the
row's text; ``missing`` rows (names a sibling change adds) must still be missing, so the row is
updated when they land. The checks run in one subprocess (``catalogue.py check``), so the alias
finder never enters this test process. Runs in the main venv: no Hugging Face package needed.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TOOLS = ROOT / "scripts" / "catalogue"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"catalogue_{name}", TOOLS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


catalogue = _load("catalogue")
scan = _load("scan")
ROWS = catalogue.read()


@pytest.fixture(scope="module")
def verdicts() -> dict[str, str | None]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(TOOLS / "catalogue.py"), "check", str(catalogue.TSV)],
                          capture_output=True, text=True, timeout=240, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = dict((d["name"], d["problem"]) for d in map(json.loads, proc.stdout.splitlines()))
    assert len(found) == len(ROWS), "the checker stopped early:\n" + proc.stderr[-3000:]
    return found


def test_the_catalogue_names_at_least_150_distinct_names_seen_in_public_code() -> None:
    names = [row.name for row in ROWS]
    assert len(names) == len(set(names)), "a name is listed twice"
    answered = [row for row in ROWS if row.answer == "works" or row.refusal]
    assert len(answered) >= 150, len(answered)
    assert all(row.name == "deepspeed" or row.name.startswith("deepspeed.") for row in ROWS)
    assert all(row.seen_in and row.seen_in != "?" for row in ROWS)
    # most rows come from the scanned code, not from hand-added names
    assert sum(":" in row.seen_in for row in answered) >= 150


@pytest.mark.timeout(300)
@pytest.mark.parametrize("row", ROWS, ids=[row.name for row in ROWS])
def test_entry(row, verdicts: dict[str, str | None]) -> None:
    assert verdicts[row.name] is None, f"{catalogue.TSV.name}:{row.line}: {row.name}: {verdicts[row.name]}"
    if row.answer.startswith("missing: "):
        pytest.skip(row.answer)  # checked: still missing


def test_scan_finds_imports_from_imports_and_attribute_chains(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text(
        "import deepspeed\n"
        "import deepspeed.comm as dist\n"
        "from deepspeed.runtime.utils import see_memory_usage as smu\n"
        "from deepspeed import comm\n"
        "from . import deepspeed_helpers\n"  # relative: not deepspeed's
        "deepspeed.runtime.utils.set_random_seed(1)\n"
        "dist.get_rank()\n"
        "comm.barrier()\n"
        "deepspeed.accelerator.get_accelerator().device_name()\n"
        "deepspeed.utils.logger.info('x')\n"  # a method call on a value: skipped on merge
        "deepspeed.checkpointing._CUDA_RNG_STATE_TRACKER\n")  # private: skipped on merge
    (tmp_path / "py2.py").write_text("print 'old example'\n")  # not Python 3: ignored
    seen = scan.Sightings()
    scan.scan("demo", tmp_path, seen)
    assert set(seen.count) == {
        "deepspeed", "deepspeed.comm", "deepspeed.runtime.utils", "deepspeed.runtime.utils.see_memory_usage",
        "deepspeed.comm.get_rank", "deepspeed.comm.barrier", "deepspeed.runtime.utils.set_random_seed",
        "deepspeed.accelerator.get_accelerator", "deepspeed.utils.logger.info",
        "deepspeed.checkpointing._CUDA_RNG_STATE_TRACKER"}
    assert seen.first["deepspeed.comm.get_rank"] == "demo:train.py"
    tsv = tmp_path / "catalogue.tsv"
    tsv.write_text(f"{scan.HEADER}\ndeepspeed.comm\tmodule\tsomewhere\tworks\n")
    new = scan.merge(tsv, seen)
    assert [row.split("\t")[0] for row in new] == sorted(
        set(seen.count) - {"deepspeed.comm", "deepspeed.utils.logger.info", "deepspeed.checkpointing._CUDA_RNG_STATE_TRACKER"})
    assert tsv.read_text().splitlines()[1] == "deepspeed.comm\tmodule\tsomewhere\tworks"  # kept as it was
    assert all(row.endswith("\t?") for row in new)


def test_a_malformed_row_is_named_by_its_line(tmp_path: Path) -> None:
    tsv = tmp_path / "catalogue.tsv"
    tsv.write_text(f"{scan.HEADER}\ndeepspeed.comm\tmodule\tworks\n")
    with pytest.raises(ValueError, match=r"catalogue.tsv:2: expected 4 tab-separated fields, got 3"):
        catalogue.read(tsv)
