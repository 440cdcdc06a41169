"""``dslaunch zero-to-fp32 CHECKPOINT_DIR OUTPUT [options]``: one fp32 state dict from a checkpoint.

A thin click command: the arguments go unchanged to ``dslaunch.runtime.checkpoint.export.main`` (the
parser ``python -m dslaunch.utils.zero_to_fp32`` uses too, so both accept the same options and
``--help`` shows them). That module imports torch: only when this command runs.
"""

from __future__ import annotations

import click

from dslaunch.errors import UsageError

__all__ = ["command"]


@click.command("zero-to-fp32", add_help_option=False,
               context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def command(args: tuple[str, ...]) -> int:
    """Consolidate a ZeRO checkpoint into one fp32 state dict (options: --help)."""
    try:
        from dslaunch.runtime.checkpoint.export import main
    except ModuleNotFoundError as err:
        if err.name != "dslaunch.runtime.checkpoint.export":
            raise
        raise UsageError("zero-to-fp32 is not available in this installation") from None
    return main(list(args)) or 0
