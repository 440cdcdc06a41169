"""The file names of DeepSpeed's own checkpoint layout, for scripts that look inside a checkpoint
real DeepSpeed wrote.

dslaunch writes its own layout (a manifest and ``.dsl`` files per tag, ``checkpointer.py``), not
these files: a name from here points into a DeepSpeed checkpoint, never into one of dslaunch's.
"""

from __future__ import annotations

import os

__all__ = ["get_model_ckpt_name_for_rank"]


def get_model_ckpt_name_for_rank(base_folder: str | os.PathLike, mp_rank_str: str) -> str:
    """The model-states file of model-parallel rank ``mp_rank_str`` (zero-padded, e.g. ``"00"``) in
    the tag folder ``base_folder`` of a DeepSpeed checkpoint: ``<base_folder>/mp_rank_00_model_states.pt``."""
    return os.path.join(base_folder, f"mp_rank_{mp_rank_str}_model_states.pt")
