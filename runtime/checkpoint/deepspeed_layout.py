"""The file names of DeepSpeed's own checkpoint layout, and telling such a tag from dslaunch's.

A tag folder real DeepSpeed 0.19 wrote (``save_dir/<tag>/``, ``save_dir/latest`` naming the
newest tag) holds::

    mp_rank_00_model_states.pt                      stages 0-2: module, counters, scheduler,
                                                    client state (model-parallel rank 00)
    zero_pp_rank_R_mp_rank_00_model_states.pt       stage 3: the same, one per data-parallel rank R
    [bf16_]zero_pp_rank_R_mp_rank_00_optim_states.pt  ZeRO: rank R's fp32 partition and optimizer
                                                    state (``bf16_`` from DeepSpeed's bf16 optimizer)

A pipeline's tag (``PipelineModule``, ``deepspeed_pipe``) has these files once per stage S (the
``mp_rank_SS`` of the names; ``module`` is None in its model states) and the weights of each layer
in a file of its own, written by data-parallel rank 0 of the layer's stage::

    layer_XX-model_states.pt                        layer XX's ``state_dict()`` (global layer index)

An AutoTP training tag (``tensor_parallel.autotp_size``, ``deepspeed_tp``) has the first files once
per tensor-parallel rank T (``mp_rank_TT``), each holding T's slices.

dslaunch writes its own layout by default (a manifest and ``.dsl`` files per tag,
``checkpointer.py``); it reads this one (``deepspeed_read.py``) and writes it with
``"checkpoint": {"format": "deepspeed"}`` (``deepspeed_write.py``). These names point into this
layout, never into dslaunch's.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from dslaunch.errors import CheckpointError
from dslaunch.runtime.checkpoint.store import LATEST, MANIFEST, CheckpointStore

__all__ = ["get_model_ckpt_name_for_rank", "get_zero_ckpt_name_for_rank", "get_layer_ckpt_name_for_rank", "model_states_name", "optim_states_name", "ckpt_name",
           "zero_ckpt_name", "optimizer_ckpt_name", "expert_optim_name", "layer_name", "is_pipeline", "deepspeed_tag",
           "is_deepspeed_folder", "get_optim_files", "get_model_state_files"]


def get_model_ckpt_name_for_rank(base_folder: str | os.PathLike, mp_rank_str: str) -> str:
    """The model-states file of model-parallel rank ``mp_rank_str`` (zero-padded, e.g. ``"00"``) in
    the tag folder ``base_folder`` of a DeepSpeed checkpoint: ``<base_folder>/mp_rank_00_model_states.pt``."""
    return os.path.join(base_folder, f"mp_rank_{mp_rank_str}_model_states.pt")


def get_zero_ckpt_name_for_rank(base_folder: str | os.PathLike, dp_rank: int, mp_rank: int) -> str:
    """The ZeRO optimizer-states file of data-parallel rank ``dp_rank`` and model-parallel rank
    ``mp_rank`` in ``base_folder``: ``<base_folder>/zero_pp_rank_D_mp_rank_MM_optim_states.pt``."""
    return os.path.join(base_folder, optim_states_name(dp_rank, False, mp_rank))


def get_layer_ckpt_name_for_rank(base_folder: str | os.PathLike, layer_id: str, tp_rank: int) -> str:
    """The file of pipeline layer ``layer_id`` (``"layer_03"``) of tensor rank ``tp_rank`` in
    ``base_folder`` (DeepSpeed's naming): ``<base_folder>/layer_03-model_TT_model_states.pt``."""
    return os.path.join(base_folder, f"{layer_id}-model_{tp_rank:02d}_model_states.pt")


def _natural_key(path: str) -> list[Any]:
    # rank 10 after rank 9: the numbers in a name compare as numbers
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", path)]


def _files(checkpoint_dir: str | os.PathLike, suffix: str) -> list[str]:
    folder = Path(checkpoint_dir)
    found = sorted((str(f) for f in folder.glob(f"*{suffix}")), key=_natural_key)
    if not found:
        raise FileNotFoundError(f"can't find *{suffix} files in directory '{checkpoint_dir}'")
    return found


def get_optim_files(checkpoint_dir: str | os.PathLike) -> list[str]:
    """DeepSpeed's ``zero_to_fp32.get_optim_files``: the tag folder's ``*_optim_states.pt`` files,
    by rank (``zero_pp_rank_2`` before ``zero_pp_rank_10``).

    Raises:
        FileNotFoundError: there is none (DeepSpeed's error).
    """
    return _files(checkpoint_dir, "_optim_states.pt")


def get_model_state_files(checkpoint_dir: str | os.PathLike) -> list[str]:
    """DeepSpeed's ``zero_to_fp32.get_model_state_files``: the ``*_model_states.pt`` files, by rank."""
    return _files(checkpoint_dir, "_model_states.pt")


def model_states_name(dp_rank: int | None = None, mp_rank: int = 0) -> str:
    """``mp_rank_00_model_states.pt``; with ``dp_rank`` (stage 3) ``zero_pp_rank_R_mp_rank_00_...``."""
    prefix = "" if dp_rank is None else f"zero_pp_rank_{dp_rank}_"
    return f"{prefix}mp_rank_{mp_rank:02d}_model_states.pt"


def optim_states_name(dp_rank: int, bf16: bool = False, mp_rank: int = 0) -> str:
    return f"{'bf16_' if bf16 else ''}zero_pp_rank_{dp_rank}_mp_rank_{mp_rank:02d}_optim_states.pt"


def ckpt_name(checkpoints_path: str | os.PathLike, tag: object, partitioned: bool, dp_rank: int = 0,
              mp_rank: str = "00") -> str:
    """DeepSpeed's ``engine._get_ckpt_name``: the model-states file of this rank in ``tag``."""
    name = (f"zero_pp_rank_{dp_rank}_" if partitioned else "") + f"mp_rank_{mp_rank}_model_states.pt"
    return os.path.join(checkpoints_path, str(tag), name)


def zero_ckpt_name(checkpoints_path: str | os.PathLike, tag: object, dp_rank: int, bf16: bool,
                   mp_rank: int = 0) -> str:
    """DeepSpeed's ``engine._get_zero_ckpt_name``: this rank's ZeRO optimizer-states file."""
    return os.path.join(checkpoints_path, str(tag), optim_states_name(dp_rank, bf16, mp_rank))


def optimizer_ckpt_name(checkpoints_path: str | os.PathLike, tag: object, expp_rank: int, mp_rank: int = 0) -> str:
    """DeepSpeed's ``engine._get_optimizer_ckpt_name``: the optimizer file of expert-parallel rank
    ``expp_rank`` (MoE models without ZeRO)."""
    return os.path.join(checkpoints_path, str(tag), expert_optim_name(expp_rank, mp_rank))


def expert_optim_name(expp_rank: int, mp_rank: int = 0) -> str:
    """``expp_rank_R_mp_rank_00_optim_states.pt``: expert rank R's optimizer state without ZeRO."""
    return f"expp_rank_{expp_rank}_mp_rank_{mp_rank:02d}_optim_states.pt"


def layer_name(index: int) -> str:
    """``layer_XX-model_states.pt``: a pipeline layer's weights (``XX``: its index in the model)."""
    return f"layer_{index:02d}-model_states.pt"


def is_pipeline(folder: Path) -> bool:
    """A pipeline's tag: it has layer files (MoE experts' ``layer_L_expert_E_...`` are not such)."""
    return any(folder.glob("layer_*-model_states.pt"))


def deepspeed_tag(load_dir: str | os.PathLike, tag: object = None) -> Path | None:
    """The tag folder to load if ``load_dir`` holds a DeepSpeed checkpoint there, else None.

    ``tag`` None: the tag ``load_dir/latest`` names. A folder is DeepSpeed's when it has a
    ``*model_states.pt`` file and no dslaunch manifest.
    """
    root = Path(load_dir)
    if tag is None:
        try:
            tag = (root / LATEST).read_text().strip()
        except (OSError, UnicodeDecodeError):
            return None
    folder = root / str(tag)
    return folder if is_deepspeed_folder(folder) else None


def is_deepspeed_folder(folder: Path) -> bool:
    """A tag folder in DeepSpeed's layout: ``*model_states.pt`` files and no dslaunch manifest, or
    the manifest dslaunch writes beside the files of a DeepSpeed-format save (``checkpoint.format``)."""
    if not folder.is_dir() or not any(folder.glob("*model_states.pt")):
        return False
    if not (folder / MANIFEST).exists():
        return True
    try:
        return CheckpointStore(folder.parent).manifest(folder.name).meta.get("format") == "deepspeed"
    except CheckpointError:  # a broken dslaunch tag: its loader says what is wrong
        return False


def tag_folder_format(folder: Path) -> str:
    """``"deepspeed"`` or ``"dslaunch"``: the layout of the tag folder ``folder``, without torch (a
    command checks its input with it before importing what reads the files).

    Raises:
        CheckpointError: ``folder`` is neither (names it, says what to pass).
    """
    if is_deepspeed_folder(folder):
        return "deepspeed"
    if (folder / MANIFEST).exists():
        return "dslaunch"
    raise CheckpointError("is neither a DeepSpeed checkpoint tag folder (*model_states.pt) nor a dslaunch one "
                          f"({MANIFEST}): pass the tag folder, e.g. <save_dir>/global_step100", str(folder))
