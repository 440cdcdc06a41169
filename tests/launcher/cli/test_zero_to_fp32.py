"""``dslaunch zero-to-fp32``: the click subcommand hands its arguments, unchanged, to the converter."""

from __future__ import annotations

import sys
import types

from dslaunch.errors import UsageError
from dslaunch.launcher import cli


def _fake_converter(monkeypatch, result=0):
    seen = []
    fake = types.ModuleType("dslaunch.runtime.checkpoint.export")

    def main(argv):
        seen.append(argv)
        if isinstance(result, Exception):
            raise result
        return result

    fake.main = main
    monkeypatch.setitem(sys.modules, "dslaunch.runtime.checkpoint.export", fake)
    return seen


def test_zero_to_fp32_is_dispatched_with_its_arguments(monkeypatch):
    seen = _fake_converter(monkeypatch)
    assert cli.main(["zero-to-fp32", "ckpt", "out.bin"]) == 0
    assert seen == [["ckpt", "out.bin"]]


def test_options_and_help_reach_the_converters_own_parser(monkeypatch):
    seen = _fake_converter(monkeypatch)
    argv = ["ckpt", "out", "--max_shard_size", "5GB", "-t", "global_step2", "--safe_serialization", "--help"]
    assert cli.main(["zero-to-fp32", *argv]) == 0
    assert seen == [argv]


def test_converter_errors_are_one_line(monkeypatch, capsys):
    _fake_converter(monkeypatch, UsageError("no checkpoint in ckpt"))
    assert cli.main(["zero-to-fp32", "ckpt", "out"]) == 2
    assert capsys.readouterr().err == "dslaunch: error: no checkpoint in ckpt\n"
