"""DeepSpeed's ``deepspeed.checkpoint.ds_to_universal``: a checkpoint tag into the universal layout,
done by ``dslaunch.runtime.checkpoint.universal.convert`` (``dslaunch ds-to-universal``).

``main(args)`` takes DeepSpeed's parsed arguments (``input_folder``, ``output_folder``; its other
flags have nothing to tune here: one process converts, writes go straight to the output through
safe_write, and no ``universal_checkpoint_info`` is needed, so ``inject_missing_state`` adds
nothing). ``python -m dslaunch.checkpoint.ds_to_universal --input_folder ... --output_folder ...``
runs the command with DeepSpeed's flags.
"""

from __future__ import annotations

import sys
from typing import Any

# DeepSpeed's converter checks the model-states files' metadata with this before converting
from dslaunch.runtime.checkpoint.deepspeed_metadata import (
    aggregate_model_metadata as _aggregate_autoep_zero12_metadata,  # noqa: F401
)

__all__ = ["main"]


def main(args: Any) -> None:
    """Convert ``args.input_folder`` (a tag folder: DeepSpeed's layout or dslaunch's) into a universal
    checkpoint in ``args.output_folder``, with ``latest_universal`` beside it, as DeepSpeed's ``main``.

    Raises:
        CheckpointError: the input is no checkpoint tag, or a file is missing, malformed or unwritable.
    """
    from dslaunch.runtime.checkpoint.universal import convert

    convert(args.input_folder, args.output_folder)


if __name__ == "__main__":
    from dslaunch.launcher.cli import main as dslaunch_main  # its errors: one line, exit code 1

    sys.exit(dslaunch_main(["ds-to-universal", *sys.argv[1:]]))
