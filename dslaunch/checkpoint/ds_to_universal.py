"""DeepSpeed's ``deepspeed.checkpoint.ds_to_universal``: a checkpoint tag into the universal layout,
done by ``dslaunch.runtime.checkpoint.universal.convert`` (``dslaunch ds-to-universal``).

``main(args)`` takes DeepSpeed's parsed arguments (``input_folder``, ``output_folder``, ``strict``;
its other flags have nothing to tune here: one process converts, writes go straight to the output
through safe_write, and no ``universal_checkpoint_info`` is needed for a data-parallel tag, so
``inject_missing_state`` adds nothing). An AutoTP tag's slices are joined by its
``universal_checkpoint_info`` (DeepSpeed's) or its own slice records (dslaunch's). DeepSpeed's steps
are here by its names too: ``merge_tp_slices`` and ``_merge_zero_shards`` on its intermediate
folder, ``_group_per_tp_shapes``, ``_validate_autotp_conversion_support``
(``dslaunch.runtime.checkpoint.universal_tp``, ``.autotp_universal``).
``python -m dslaunch.checkpoint.ds_to_universal --input_folder ... --output_folder ...`` runs the
command with DeepSpeed's flags.
"""

from __future__ import annotations

import sys
from typing import Any

from dslaunch.runtime.checkpoint.autotp_universal import (  # noqa: F401
    refuse_unsupported as _validate_autotp_conversion_support,
)
from dslaunch.runtime.checkpoint.autotp_universal import shapes_by_tp as _group_per_tp_shapes  # noqa: F401

# DeepSpeed's converter checks the model-states files' metadata with this before converting
from dslaunch.runtime.checkpoint.deepspeed_metadata import (
    aggregate_model_metadata as _aggregate_autoep_zero12_metadata,  # noqa: F401
)
from dslaunch.runtime.checkpoint.universal_tp import merge_tp_slices
from dslaunch.runtime.checkpoint.universal_tp import merge_zero_shards as _merge_zero_shards  # noqa: F401

__all__ = ["main", "merge_tp_slices"]


def main(args: Any) -> None:
    """Convert ``args.input_folder`` (a tag folder: DeepSpeed's layout or dslaunch's) into a universal
    checkpoint in ``args.output_folder``, with ``latest_universal`` beside it, as DeepSpeed's ``main``.

    Raises:
        CheckpointError: the input is no checkpoint tag, or a file is missing, malformed or unwritable;
        UnconvertibleLayoutError: an AutoTP layer could not describe its split (a ``ValueError``).
    """
    from dslaunch.runtime.checkpoint.universal import convert

    convert(args.input_folder, args.output_folder, strict=bool(getattr(args, "strict", True)))


if __name__ == "__main__":
    from dslaunch.launcher.cli import main as dslaunch_main  # its errors: one line, exit code 1

    sys.exit(dslaunch_main(["ds-to-universal", *sys.argv[1:]]))
