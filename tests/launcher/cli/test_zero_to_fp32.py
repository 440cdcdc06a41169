"""``dslaunch zero-to-fp32``: the click command checks its arguments, then hands them to the converter."""

from __future__ import annotations

import sys
import types

import pytest

from dslaunch.errors import UsageError
from dslaunch.launcher import cli


def _fake_converter(monkeypatch, result=0):
    seen = []
    fake = types.ModuleType("dslaunch.runtime.checkpoint.export")

    def run(args):
        seen.append(args)
        if isinstance(result, Exception):
            raise result
        return result

    fake.run = run
    monkeypatch.setitem(sys.modules, "dslaunch.runtime.checkpoint.export", fake)
    return seen


def _save_dir(tmp_path) -> str:
    """A save_dir whose ``latest`` names a tag in DeepSpeed's layout: enough for the checks before
    the converter (which reads the files)."""
    (tmp_path / "ckpt" / "global_step2").mkdir(parents=True)
    (tmp_path / "ckpt" / "global_step2" / "mp_rank_00_model_states.pt").write_bytes(b"")
    (tmp_path / "ckpt" / "latest").write_text("global_step2")
    return str(tmp_path / "ckpt")


def test_zero_to_fp32_is_dispatched_with_its_arguments(monkeypatch, tmp_path):
    seen = _fake_converter(monkeypatch)
    ckpt = _save_dir(tmp_path)
    assert cli.main(["zero-to-fp32", ckpt, "out", "--max_shard_size", "5GB", "-t", "global_step2",
                     "--safe_serialization"]) == 0
    (args,) = seen
    assert (args.checkpoint_dir, args.output, args.max_shard_size, args.tag, args.safe_serialization) == (
        ckpt, "out", "5GB", "global_step2", True)


def test_help_is_the_converters_own_and_needs_no_converter(monkeypatch, capsys):
    seen = _fake_converter(monkeypatch)
    with pytest.raises(SystemExit) as done:
        cli.main(["zero-to-fp32", "ckpt", "--help"])
    assert done.value.code == 0 and seen == []
    assert "--exclude_frozen_parameters" in capsys.readouterr().out


def test_converter_errors_are_one_line(monkeypatch, tmp_path, capsys):
    _fake_converter(monkeypatch, UsageError("no checkpoint in ckpt"))
    assert cli.main(["zero-to-fp32", _save_dir(tmp_path), "out"]) == 2
    assert capsys.readouterr().err == "dslaunch: error: no checkpoint in ckpt\n"
