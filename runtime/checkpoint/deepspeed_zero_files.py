"""A DeepSpeed tag's ZeRO optimizer files, per rank of a (smaller) target shape: DeepSpeed's
``deepspeed.checkpoint.ZeROCheckpoint``, which Megatron-DeepSpeed's conversion tools and
``ds_to_universal`` use to read each rank's optimizer state.

``get_state_for_rank(pp, tp, dp)`` reads the files the target rank merges (``deepspeed_reshape``
says which), drops each file's padding of its flat partition (``group_paddings``), and joins them
with ``merge_state``: the flat fp32 partitions and per-element optimizer states end to end.

The map is DeepSpeed's, index for index (its own tests pin it): with the pipeline or tensor degree
reduced and the data-parallel one kept, target data-parallel rank d holds source files of other
stages or tensor ranks, not one replica's share; reshape to ``dp_degree=1`` for a stage's whole
state (as ``ds_to_universal`` reads it).

Limitations: ZeRO stages 1 and 2 (a ZeRO-3 tag's files hold per-parameter fragments that this
join does not put together: read those with ``dslaunch.utils.zero_to_fp32``); joined files keep
each file's ``param_slice_mappings`` as they are (offsets into that file's partition), as DeepSpeed's.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from dslaunch.errors import CheckpointError, ReshapeError, install_excepthook
from dslaunch.runtime.checkpoint.deepspeed_constants import (
    BASE_OPTIMIZER_STATE,
    GROUP_PADDINGS,
    OPTIMIZER_STATE_DICT,
    PARTITION_COUNT,
)
from dslaunch.runtime.checkpoint.deepspeed_read import read_checkpoint_file
from dslaunch.runtime.checkpoint.deepspeed_reshape import (
    basic_folder_validation,
    get_model_3d_descriptor,
    get_zero_files,
    merge_state,
    model_3d_desc,
)

__all__ = ["ZeROCheckpoint"]

GROUP_STATE_KEY = "state"


class ZeROCheckpoint:
    """The ZeRO files of the tag folder ``dir``, mapped onto a target (pipeline, tensor, data)
    shape (the saved one until ``reshape``).

    Raises:
        CheckpointError: ``dir`` is no folder or holds no ZeRO optimizer files.
    """

    def __init__(self, dir: str | os.PathLike, source_3d: model_3d_desc | None = None) -> None:  # DeepSpeed's name
        install_excepthook()  # as DeepSpeedCheckpoint's: one line for a script's bad input
        basic_folder_validation(dir)
        self.dir = dir
        self.file_list = get_zero_files(dir)
        self.num_files = len(self.file_list)
        if not self.file_list:
            raise CheckpointError("has no ZeRO optimizer files ([bf16_]zero_pp_rank_*_optim_states.pt): it was saved "
                                  "without ZeRO, or it is not a DeepSpeed checkpoint tag folder", str(dir))
        self.src_3d = get_model_3d_descriptor(dir) if source_3d is None else source_3d
        self.target_3d = model_3d_desc(self.src_3d.pp_degree, self.src_3d.tp_degree, self.src_3d.dp_degree)
        self._3d_file_map = self.src_3d.reshape(self.target_3d)

    def get_src_world_size(self) -> int:
        return self.src_3d.world_size()

    def get_src_tp_degree(self) -> int:
        return self.src_3d.tp_degree

    def get_src_pp_degree(self) -> int:
        return self.src_3d.pp_degree

    def get_src_dp_degree(self) -> int:
        return self.src_3d.dp_degree

    def get_file_indices_for_rank(self, pp_index: int, tp_index: int, dp_index: int) -> list[int]:
        """The indices (into ``file_list``) of the files the target rank merges.

        Raises:
            ReshapeError: an index outside the target shape.
        """
        valid, errors = self.target_3d.is_valid(pp_index, tp_index, dp_index)
        if not valid:
            raise ReshapeError(f"{'; '.join(errors)} (target {self.target_3d.get_desc()})", str(self.dir))
        return self._3d_file_map[dp_index].get_data(pp_index, tp_index)

    def get_files_for_rank(self, pp_index: int, tp_index: int, dp_index: int) -> list[str]:
        return [self.file_list[i] for i in self.get_file_indices_for_rank(pp_index, tp_index, dp_index)]

    def get_state_for_rank(self, pp_index: int, tp_index: int, dp_index: int, keys_to_ignore: list[str] | None = None,
                           strip_tensor_paddings: bool = True) -> dict:
        """The target rank's optimizer-states file: its source files joined (``merge_state``), each
        one's partition padding dropped first (``strip_tensor_paddings``), ``partition_count`` set
        to the target's data-parallel degree. ``keys_to_ignore``: top-level keys left out."""
        merged: dict | None = None
        for path in self.get_files_for_rank(pp_index, tp_index, dp_index):
            sd = read_checkpoint_file(Path(path))
            for key in keys_to_ignore or ():
                sd.pop(key, None)
            if strip_tensor_paddings:
                self._strip_tensor_paddings(sd)
            merged = sd if merged is None else merge_state(merged, sd)
        assert merged is not None  # every target rank holds at least one file
        self._update_partition_count(merged)
        if strip_tensor_paddings:
            self._clear_group_paddings(merged)
        return merged

    def print_3d_index_map(self, tag: str | None = None) -> None:
        if tag:
            print(f"3D index map: {tag}")
        for dp_index, two_d in enumerate(self._3d_file_map):
            two_d.print_data(f"dp = {dp_index}")

    def print_3d_file_map(self, tag: str | None = None) -> None:
        if tag:
            print(f"3D file map: {tag}")
        for dp_index, two_d in enumerate(self._3d_file_map):
            for pp_index in range(two_d.pp_degree):
                for tp_index in range(two_d.tp_degree):
                    files = [self.file_list[i] for i in two_d.get_data(pp_index, tp_index)]
                    print(f"{pp_index}, {tp_index}, {dp_index} => {files}")

    def reshape(self, target_3d_desc: model_3d_desc) -> None:
        """Map the files onto ``target_3d_desc`` (each degree dividing the saved one).

        Raises:
            ReshapeError: it does not (names the dimension and the valid degrees).
        """
        self._3d_file_map = self.src_3d.reshape(target_3d_desc)
        self.target_3d = target_3d_desc

    @staticmethod
    def _optimizer_state(sd: dict, key: str) -> Any:
        return (sd.get(OPTIMIZER_STATE_DICT) or {}).get(key)

    def _strip_tensor_paddings(self, sd: dict) -> None:
        base = self._optimizer_state(sd, BASE_OPTIMIZER_STATE)
        paddings = self._optimizer_state(sd, GROUP_PADDINGS)
        if not isinstance(base, dict) or not paddings:
            return  # an elastic checkpoint's base state (a list per group) is saved without padding
        for key, group_state in (base.get(GROUP_STATE_KEY) or {}).items():
            padding = paddings[key]
            if not padding:
                continue
            for name, value in group_state.items():
                if name != "step" and torch.is_tensor(value) and value.dim() > 0:
                    group_state[name] = value.narrow(0, 0, value.numel() - padding).clone()

    def _clear_group_paddings(self, sd: dict) -> None:
        paddings = self._optimizer_state(sd, GROUP_PADDINGS)
        if paddings:
            sd[OPTIMIZER_STATE_DICT][GROUP_PADDINGS] = [0] * len(paddings)

    def _update_partition_count(self, sd: dict) -> None:
        counts = self._optimizer_state(sd, PARTITION_COUNT)
        if counts:
            sd[OPTIMIZER_STATE_DICT][PARTITION_COUNT] = [self.target_3d.dp_degree] * len(counts)
