"""``dslaunch zero-to-fp32 CHECKPOINT_DIR OUTPUT [options]``: one fp32 state dict from a checkpoint.

A thin click command: the arguments go unchanged to ``dslaunch.runtime.checkpoint.export.main``,
which ``python -m dslaunch.utils.zero_to_fp32`` runs too; both parse them with ``parser`` (here:
``dslaunch.runtime.export_cli``, torch-free), so they accept the same options and ``--help`` shows them. That module imports torch,
only when this command runs and after ``CHECKPOINT_DIR`` is known to be a directory: a file, a
FIFO or a device is refused at once, without seconds of imports.
"""

from __future__ import annotations

import os

import click

from dslaunch.errors import CheckpointError, UsageError
from dslaunch.runtime.export_cli import parser

__all__ = ["command", "parser"]


@click.command("zero-to-fp32", add_help_option=False,
               context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def command(args: tuple[str, ...]) -> int:
    """Consolidate a ZeRO checkpoint into one fp32 state dict (options: --help)."""
    _refuse_a_file(list(args))
    try:
        from dslaunch.runtime.checkpoint.export import main
    except ModuleNotFoundError as err:
        if err.name != "dslaunch.runtime.checkpoint.export":
            raise
        raise UsageError("zero-to-fp32 is not available in this installation") from None
    return main(list(args)) or 0


def _refuse_a_file(args: list[str]) -> None:
    """A ``CHECKPOINT_DIR`` that exists and is no directory (a file, a FIFO, a device), refused as
    the converter would, before torch is imported. Anything else (``--help``, a usage error, a
    missing path) is the converter's to answer."""
    if "-h" in args or "--help" in args:
        return
    try:
        checkpoint_dir = parser().parse_args(args).checkpoint_dir
    except SystemExit:  # argparse printed nothing useful to us yet: let the converter say it
        return
    if os.path.exists(checkpoint_dir) and not os.path.isdir(checkpoint_dir):
        raise CheckpointError("not a directory (expected a save_dir or one of its tag directories)", checkpoint_dir)
