"""``dslaunch zero-to-fp32 CHECKPOINT_DIR OUTPUT [options]``: one fp32 state dict from a checkpoint.

A thin click command: the arguments go unchanged to ``dslaunch.runtime.export_cli``, which parses
them as ``python -m dslaunch.utils.zero_to_fp32`` does (same options, same ``--help``) and refuses
what the export would refuse before it reads weights (a bad flag, a missing directory or tag, no
checkpoint, an output it cannot write as asked), without importing torch; only then is the export
(``dslaunch.runtime.checkpoint.export``, torch) imported.
"""

from __future__ import annotations

import click

from dslaunch.errors import UsageError
from dslaunch.runtime.export_cli import check_arguments, parser

__all__ = ["command", "parser"]


@click.command("zero-to-fp32", add_help_option=False,
               context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def command(args: tuple[str, ...]) -> int:
    """Consolidate a ZeRO checkpoint into one fp32 state dict (options: --help)."""
    checked = check_arguments(list(args))
    try:
        from dslaunch.runtime.checkpoint.export import run
    except ModuleNotFoundError as err:
        if err.name != "dslaunch.runtime.checkpoint.export":
            raise
        raise UsageError("zero-to-fp32 is not available in this installation") from None
    return run(checked) or 0
