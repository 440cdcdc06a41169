"""Bad input to the commands that end up importing torch is answered before torch is imported.

One fresh interpreter runs every case in turn (a command's ``main``, or the module run as
``python -m`` runs it) and says after each whether ``torch`` is in ``sys.modules``: importing torch
costs 1-2 s here (5 s under load), the answer itself a few milliseconds.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import dslaunch

COMPAT = Path(dslaunch.__file__).resolve().parent.parent / "compat" / "deepspeed"

DRIVER = r"""
import contextlib, io, json, runpy, sys
sys.path.insert(0, sys.argv[2])  # the compat tree: `deepspeed` is dslaunch
from dslaunch.launcher.cli import main

def command(argv):
    return main(argv)

def module(name, argv):
    sys.argv = [name, *argv]
    runpy.run_module(name, run_name="__main__", alter_sys=True)

for case, kind, argv in json.loads(sys.argv[1]):
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            code = command(argv) if kind == "dslaunch" else module(kind, argv)
        except SystemExit as done:
            code = done.code
    print(json.dumps({"case": case, "code": code, "err": err.getvalue(), "torch": "torch" in sys.modules}))
"""


@pytest.mark.timeout(60)
def test_bad_input_is_one_line_without_importing_torch(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    (tmp_path / "train.py").write_text("pass\n")
    (tmp_path / "ds.json").write_text(json.dumps({"train_batch_size": 8, "autotuning": {"enabled": True},
                                                  "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 0}}}))
    missing, out = str(tmp_path / "missing"), str(tmp_path / "out.pt")
    cases = [
        ("missing dir", "dslaunch", ["zero-to-fp32", missing, out], 1, "not a directory"),
        ("missing tag", "dslaunch", ["zero-to-fp32", str(empty), out, "--tag", "step9"], 1,
         "no checkpoint tag 'step9' here"),
        ("no checkpoint", "dslaunch", ["zero-to-fp32", str(empty), out], 1, "no checkpoint here"),
        ("bad flag", "dslaunch", ["zero-to-fp32", str(empty), out, "--bogus"], 2, "unrecognized arguments: --bogus"),
        ("one file, shards", "dslaunch", ["zero-to-fp32", str(empty), out, "--max_shard_size", "1MB"], 2,
         "--max_shard_size shards a directory output"),
        ("python -m, bad tag", "dslaunch.utils.zero_to_fp32", [str(empty), out, "--tag", "../.."], 1,
         "zero-to-fp32: error: invalid checkpoint tag '../..'"),
        ("deepspeed's -m", "deepspeed.utils.zero_to_fp32", [missing, out], 1, "zero-to-fp32: error: "),
        ("ds-to-universal", "dslaunch", ["ds-to-universal", "--input_folder", str(empty), "--output_folder", out],
         1, "is neither a DeepSpeed checkpoint tag folder"),
        ("autotuning, bad scheduler", "dslaunch", ["--autotuning", "tune", "--dry-run", str(tmp_path / "train.py"),
                                                   "--deepspeed_config", str(tmp_path / "ds.json")],
         1, "'scheduler.params.warmup_num_steps': must be an integer"),
    ]
    proc = subprocess.run([sys.executable, "-c", DRIVER, json.dumps([c[:3] for c in cases]), str(COMPAT)],
                          capture_output=True, text=True, timeout=50, cwd=tmp_path,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [r["case"] for r in results] == [c[0] for c in cases]
    for (case, _, _, code, words), got in zip(cases, results, strict=True):
        assert (got["code"], got["torch"]) == (code, False), (case, got)
        lines = got["err"].splitlines()  # one line; argparse's usage may come before it
        assert words in lines[-1] and (len(lines) == 1 or lines[0].startswith("usage:")), (case, got["err"])


@pytest.mark.timeout(60)
def test_deepspeeds_ds_to_universal_module_takes_its_flags(tmp_path: Path) -> None:
    """``python -m deepspeed.checkpoint.ds_to_universal`` with all of DeepSpeed's flags: a folder that
    is no tag is one line (its package imports torch, so this one is not torch-free)."""
    proc = subprocess.run([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder",
                           str(tmp_path), "--output_folder", str(tmp_path / "out"), "--no_strict",
                           "--inject_missing_state", "--keep_temp_folder", "--num_extract_workers", "1",
                           "--num_merge_workers", "1"], capture_output=True, text=True, timeout=50,
                          env={**os.environ, "PYTHONPATH": str(COMPAT), "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.count("\n") == 1 and "is neither a DeepSpeed checkpoint tag folder" in proc.stderr
