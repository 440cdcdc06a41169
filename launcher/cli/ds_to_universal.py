"""``dslaunch ds-to-universal --input_folder TAG --output_folder OUT``: DeepSpeed's universal layout.

A thin click command with DeepSpeed's ``ds_to_universal`` flag names: ``dslaunch.runtime.checkpoint.
universal.convert`` does the work; an input folder that is no checkpoint tag is refused before torch
is imported (seconds), which happens only once the input is known to be one. ``--no_strict``: an
AutoTP tag's ``universal_checkpoint_info`` patterns that name no parameter are warned about, not
refused. DeepSpeed's worker-count, temp-folder and state-injection flags are accepted and have
nothing to tune here (one process converts, straight into the output).
"""

from __future__ import annotations

from pathlib import Path

import click

from dslaunch.runtime.checkpoint.deepspeed_layout import tag_folder_format

__all__ = ["command"]


@click.command("ds-to-universal")
@click.option("--input_folder", required=True, help="the DeepSpeed-format tag folder, e.g. <save_dir>/global_step100")
@click.option("--output_folder", required=True, help="the universal tag folder to write (latest_universal beside it)")
@click.option("--num_extract_workers", type=int, default=4, hidden=True, help="accepted as DeepSpeed's; unused")
@click.option("--num_merge_workers", type=int, default=2, hidden=True, help="accepted as DeepSpeed's; unused")
@click.option("--keep_temp_folder", is_flag=True, hidden=True, help="accepted as DeepSpeed's; no temp folder is made")
@click.option("--no_strict", is_flag=True, help="an AutoTP tag's universal_checkpoint_info patterns that name no "
              "parameter are warned about, not refused (DeepSpeed's flag)")
@click.option("--inject_missing_state", is_flag=True, hidden=True,
              help="accepted as DeepSpeed's; no universal_checkpoint_info is needed")
def command(input_folder: str, output_folder: str, num_extract_workers: int, num_merge_workers: int,
            keep_temp_folder: bool, no_strict: bool, inject_missing_state: bool) -> int:
    """Convert a checkpoint tag (DeepSpeed's format or dslaunch's, data- or AutoTP tensor-parallel) into
    a universal checkpoint (load it with "checkpoint": {"load_universal": true} at any world size, ZeRO
    stage and autotp_size)."""
    tag_folder_format(Path(input_folder))
    from dslaunch.runtime.checkpoint.universal import convert

    out = convert(input_folder, output_folder, strict=not no_strict)
    click.echo(f"wrote universal checkpoint {out}")
    return 0
