"""A DeepSpeed checkpoint tag read file by file, as Megatron-DeepSpeed's conversion tools read it:
DeepSpeed's ``deepspeed.checkpoint.DeepSpeedCheckpoint``.

``DeepSpeedCheckpoint(dir, tp_degree, pp_degree, dp_degree)`` reads the tag folder's model-states
files once (the saved shape, each file's parameter shapes, the iteration, Megatron's ``args``) and
maps every rank of a target shape (each degree dividing the saved one; default: the saved shape)
onto the files it merges: the pipeline's layer files (``layer_XX-model_states.pt``, or
``layer_XX-model_TT-model_states.pt`` with a tensor axis), the model-states files and, through
``ZeROCheckpoint``, the ZeRO files. Layer files by role, in layer-number order: the first is the
embedding, the last (``final_layer_norm_idx``) the final norm, those between the transformer layers.
Joining tensor-parallel slices follows Megatron's GPT layout: ``SEQUENTIAL_LAYERS`` are replicated
(the first rank's taken), ``LAYER_CONCAT_DIM`` names the row-parallel weights cut along dim 1,
everything else is cut along dim 0.

dslaunch saves this layout with ``"checkpoint": {"format": "deepspeed"}`` (``deepspeed_write``,
``deepspeed_pipe``); the engine's own loading of such a tag is ``deepspeed_read``. Files are read
with ``weights_only=True`` (``read_checkpoint_file``). Nothing is written.

Limitations: pipeline or plain ZeRO-0/1/2 tags (a ZeRO-3 tag has no ``mp_rank_*`` files: read it with
``dslaunch.utils.zero_to_fp32``); only contraction (a target degree that divides the saved one).
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import torch

from dslaunch.errors import CheckpointError, ReshapeError, install_excepthook
from dslaunch.runtime.checkpoint.deepspeed_constants import (
    CHECKPOINT_PARALLEL_DIMS,
    CHECKPOINT_PP_DEGREE,
    CHECKPOINT_TP_DEGREE,
    LAYER_FILE_PREFIX,
    MODEL_FILE_PREFIX,
    PARAM_SHAPES,
    UNIVERSAL_CHECKPOINT_INFO,
)
from dslaunch.runtime.checkpoint.deepspeed_metadata import model_state_summary
from dslaunch.runtime.checkpoint.deepspeed_read import read_checkpoint_file
from dslaunch.runtime.checkpoint.deepspeed_reshape import (
    basic_folder_validation,
    check_contraction,
    get_files,
    get_files_with_prefix,
    get_zero_files,
    meg_2d_parallel_map,
    merge_state,
    model_3d_desc,
    model_3d_descriptor_from_metadata,
    partition_data,
    reshape_meg_2d_parallel,
    validate_files,
)
from dslaunch.runtime.checkpoint.deepspeed_zero_files import ZeROCheckpoint

__all__ = ["DeepSpeedCheckpoint", "checkpoint_parallel_metadata", "EMBEDDING_LAYER_INDEX", "FINAL_LAYER_NORM_INDEX",
           "ARGS_KEY", "CHECKPOINT_INFO_KEY", "ITERATION_KEY", "LAYER_FILE_PREFIX_PATTERN", "SEQUENTIAL_LAYERS",
           "LAYER_CONCAT_DIM"]

EMBEDDING_LAYER_INDEX = 0
FINAL_LAYER_NORM_INDEX = -1
ARGS_KEY = "args"
CHECKPOINT_INFO_KEY = "checkpoint_info"
ITERATION_KEY = "iteration"
LAYER_FILE_PREFIX_PATTERN = r"layer_(\d+)-model_.*"
# Megatron GPT's replicated layer weights, and its row-parallel ones (cut along dim 1)
SEQUENTIAL_LAYERS = ["input_layernorm.weight", "input_layernorm.bias", "self_attention.dense.bias",
                     "post_attention_layernorm.weight", "post_attention_layernorm.bias", "mlp.dense_4h_to_h.bias",
                     "position_embeddings.weight"]
LAYER_CONCAT_DIM = {"self_attention.dense.weight": 1, "mlp.dense_4h_to_h.weight": 1}


def checkpoint_parallel_metadata(mpu: Any) -> dict:
    """``{"checkpoint_parallel_dimensions": {"pp_degree": .., "tp_degree": ..}}`` of ``mpu`` (a
    Megatron-style mpu or dslaunch's grid; None: 1 and 1), the key DeepSpeed 0.19.8 writes into
    every model-states file (DeepSpeed's ``engine._checkpoint_parallel_metadata``)."""
    from dslaunch.runtime.parallel.mpu import (
        bwc_pipeline_parallel_world_size,
        bwc_tensor_model_parallel_world_size,
    )

    return {CHECKPOINT_PARALLEL_DIMS: {CHECKPOINT_PP_DEGREE: bwc_pipeline_parallel_world_size(mpu),
                                       CHECKPOINT_TP_DEGREE: bwc_tensor_model_parallel_world_size(mpu)}}


def _layer_files(files: list[str]) -> list[str]:
    return sorted(f for f in files if re.fullmatch(LAYER_FILE_PREFIX_PATTERN, os.path.basename(f)))


def _split(items: list[str], parts: int) -> list[list[str]]:
    """``items`` in ``parts`` consecutive runs, the longer ones first (no item dropped)."""
    size, extra = divmod(len(items), parts)
    bounds = [i * size + min(i, extra) for i in range(parts + 1)]
    return [items[bounds[i]:bounds[i + 1]] for i in range(parts)]


class DeepSpeedCheckpoint:
    """The DeepSpeed checkpoint tag folder ``dir`` seen at a target (tensor, pipeline, data)-parallel
    shape (see the module docstring).

    Args:
        dir: the tag folder (``<save_dir>/global_step100``).
        tp_degree, pp_degree, dp_degree: the target shape; None: the saved degree. Each must divide
            the saved one.
        final_layer_norm_idx: which layer file (in layer order) is the final norm.
    Raises:
        CheckpointError: ``dir`` is not a DeepSpeed checkpoint tag folder, or a file is unreadable
            (names it); ``CheckpointLayoutError``: its files disagree about the saved shape;
            ``ReshapeError``: a target degree does not divide the saved one (names the argument).
    """

    def __init__(self, dir: str | os.PathLike, tp_degree: int | None = None, pp_degree: int | None = None,
                 dp_degree: int | None = None, final_layer_norm_idx: int = FINAL_LAYER_NORM_INDEX) -> None:
        install_excepthook()  # a conversion tool never calls initialize: its bad input reads as one line too
        self.final_layer_norm_idx = final_layer_norm_idx
        self.dir = dir
        basic_folder_validation(dir)
        self.file_list = get_files(dir)
        self.layer_files = _layer_files(self.file_list)
        self.mp_rank_files = get_files_with_prefix(self.file_list, MODEL_FILE_PREFIX)
        if not self.mp_rank_files:
            raise CheckpointError(f"is not a DeepSpeed checkpoint tag folder: no {MODEL_FILE_PREFIX}*_model_states.pt "
                                  "files (pass the tag folder, e.g. <save_dir>/global_step100; a ZeRO-3 tag is read "
                                  "with zero_to_fp32)", str(dir))
        self.model_state_metadata, self.global_state = self._discover_model_state_metadata()
        zero_files = get_zero_files(dir)
        self.src_3d = model_3d_descriptor_from_metadata(self.file_list, zero_files, self.model_state_metadata)
        self.zero_checkpoint = ZeROCheckpoint(dir, source_3d=self.src_3d) if zero_files else None
        self.layer_keys = self._get_layer_keys()
        self.layer_count = len(self.layer_keys)
        src = self.src_3d
        for name, old, new in (("tp_degree", src.tp_degree, tp_degree), ("pp_degree", src.pp_degree, pp_degree),
                               ("dp_degree", src.dp_degree, dp_degree)):
            if new is not None:
                try:
                    check_contraction(name, old, new)
                except ReshapeError as exc:
                    raise ReshapeError(str(exc), str(dir)) from None
        self.tp_degree = src.tp_degree if tp_degree is None else tp_degree
        self.pp_degree = src.pp_degree if pp_degree is None else pp_degree
        self.dp_degree = src.dp_degree if dp_degree is None else dp_degree
        self.original_world_size = src.world_size()
        self.world_size = self.tp_degree * self.pp_degree * self.dp_degree
        self.old_2d_map = meg_2d_parallel_map(src.pp_degree, src.tp_degree)
        self.old_2d_map.simple_init()
        self.new_2d_map = reshape_meg_2d_parallel(src.pp_degree, src.tp_degree, self.pp_degree, self.tp_degree)
        if self.zero_checkpoint is not None and (self.is_change_pp_degree() or self.is_change_tp_degree()
                                                 or self.is_change_dp_degree()):
            self.zero_checkpoint.reshape(model_3d_desc(self.pp_degree, self.tp_degree, self.dp_degree))
        self.pp_to_transformer_map = self._build_pp_transformer_map()
        self.transformer_file_map = self._build_transformer_file_map()
        self.tp_to_embedding_map = self._build_tp_other_layer_map(EMBEDDING_LAYER_INDEX)
        self.tp_to_final_norm_map = self._build_tp_other_layer_map(self.final_layer_norm_idx)

    # ---- what was read once ------------------------------------------------------------------------
    def _discover_model_state_metadata(self) -> tuple[list[tuple[str, dict]], dict]:
        """Each model-states file read once: its ``_summary``; and the first file's global keys."""
        metadata, first = [], {}
        for i, path in enumerate(self.mp_rank_files):
            states = read_checkpoint_file(Path(path))
            metadata.append((path, model_state_summary(states)))
            if i == 0:
                first = {ITERATION_KEY: states.get(ITERATION_KEY, 0),
                         **{k: states.get(k) for k in (ARGS_KEY, CHECKPOINT_INFO_KEY, UNIVERSAL_CHECKPOINT_INFO)}}
        return metadata, first

    def _get_checkpoint_value(self, key: str) -> Any:
        if key not in self.global_state:
            self.global_state[key] = read_checkpoint_file(Path(self.mp_rank_files[0])).get(key)
        return self.global_state[key]

    def get_iteration(self) -> int:
        """The model-states file's ``iteration`` (Megatron's; 0 when absent)."""
        return self._get_checkpoint_value(ITERATION_KEY) or 0

    def get_args(self) -> Any:
        """Megatron's ``args`` saved in the model-states file (None when absent)."""
        return self._get_checkpoint_value(ARGS_KEY)

    def get_checkpoint_info(self, info_key: str = CHECKPOINT_INFO_KEY) -> Any:
        return self._get_checkpoint_value(info_key)

    def is_change_tp_degree(self) -> bool:
        return self.tp_degree != self.src_3d.tp_degree

    def is_change_pp_degree(self) -> bool:
        return self.pp_degree != self.src_3d.pp_degree

    def is_change_dp_degree(self) -> bool:
        return self.dp_degree != self.src_3d.dp_degree

    # ---- states of a target rank -------------------------------------------------------------------
    def _check(self, tp_index: int | None = None, pp_index: int | None = None) -> None:
        for name, index, degree in (("tp_index", tp_index, self.tp_degree), ("pp_index", pp_index, self.pp_degree)):
            if index is not None and not 0 <= index < degree:
                raise ReshapeError(f"{name}={index} is out of range: the target degree is {degree}", str(self.dir))

    def _zero(self) -> ZeROCheckpoint:
        if self.zero_checkpoint is None:
            raise CheckpointError("has no ZeRO optimizer files ([bf16_]zero_pp_rank_*_optim_states.pt): it was saved "
                                  "without ZeRO", str(self.dir))
        return self.zero_checkpoint

    def get_zero_checkpoint_state(self, pp_index: int, tp_index: int, dp_index: int,
                                  strip_tensor_paddings: bool = True) -> dict:
        """The target rank's optimizer state: its ZeRO files joined (``ZeROCheckpoint``)."""
        return self._zero().get_state_for_rank(pp_index, tp_index, dp_index, keys_to_ignore=[PARAM_SHAPES],
                                               strip_tensor_paddings=strip_tensor_paddings)

    def get_zero_files(self, pp_index: int, tp_index: int, dp_index: int) -> list[str]:
        return self._zero().get_files_for_rank(pp_index, tp_index, dp_index)

    def get_embedding_layer_id(self) -> str:
        return self.layer_keys[EMBEDDING_LAYER_INDEX]

    def get_final_norm_layer_id(self) -> str:
        return self.layer_keys[self.final_layer_norm_idx]

    def get_embedding_state(self, tp_index: int) -> dict:
        """The embedding layer's weights of target tensor rank ``tp_index`` (its slices joined)."""
        return self._merge_state_dicts([read_checkpoint_file(Path(f)) for f in self.get_embedding_files(tp_index)])

    def get_embedding_files(self, tp_index: int) -> list[str]:
        self._check(tp_index=tp_index)
        return self.tp_to_embedding_map.get(tp_index, [])

    def get_transformer_state(self, tp_index: int, pp_index: int) -> list[dict]:
        """The weights of each transformer layer of target rank (``tp_index``, ``pp_index``)."""
        self._check(tp_index, pp_index)
        return [self._merge_state_dicts([read_checkpoint_file(Path(f)) for f in files])
                for files in self.transformer_file_map.get((tp_index, pp_index), [])]

    def get_pp_transformer_map(self, pp_index: int) -> list[str]:
        self._check(pp_index=pp_index)
        return self.pp_to_transformer_map[pp_index]

    def get_final_norm_state(self, tp_index: int) -> dict:
        """The final norm's weights (replicated: target tensor rank ``tp_index``'s first file's)."""
        files = self.get_final_norm_files(tp_index)
        if not files:
            raise CheckpointError("has no pipeline layer files (layer_XX-model_*): no final norm to read", str(self.dir))
        return read_checkpoint_file(Path(files[0]))

    def get_final_norm_files(self, tp_index: int) -> list[str]:
        self._check(tp_index=tp_index)
        return self.tp_to_final_norm_map.get(tp_index, [])

    def get_2d_parallel_files(self, tp_index: int, pp_index: int) -> list[str]:
        """The model-states files target rank (``tp_index``, ``pp_index``) merges."""
        self._check(tp_index, pp_index)
        return [self.mp_rank_files[i] for i in self.new_2d_map.get_data(pp_index=pp_index, tp_index=tp_index)]

    def get_2d_parallel_state(self, tp_index: int, pp_index: int) -> dict:
        """Those model-states files joined (``merge_state``)."""
        merged: dict | None = None
        for path in self.get_2d_parallel_files(tp_index, pp_index):
            sd = read_checkpoint_file(Path(path))
            merged = sd if merged is None else merge_state(merged, sd)
        assert merged is not None  # every target rank holds at least one file
        return merged

    # ---- the maps ----------------------------------------------------------------------------------
    def _get_layer_keys(self) -> list[str]:
        ids = {re.fullmatch(LAYER_FILE_PREFIX_PATTERN, os.path.basename(f))[1] for f in self.layer_files}  # type: ignore[index]
        return [f"{LAYER_FILE_PREFIX}{i}" for i in sorted(ids, key=int)]

    def _layer_partitions(self, key: str) -> list[list[str]]:
        """Layer ``key``'s files (one per saved tensor rank) in ``tp_degree`` runs."""
        files = get_files_with_prefix(self.layer_files, f"{key}-")
        try:
            return [list(p) for p in partition_data(files, self.tp_degree)]
        except ReshapeError:
            raise ReshapeError(f"{key} has {len(files)} files, which tp_degree={self.tp_degree} does not divide",
                               str(self.dir)) from None

    def _build_tp_other_layer_map(self, layer_index: int) -> dict[int, list[str]]:
        if not self.layer_keys:
            return {}
        return dict(enumerate(self._layer_partitions(self.layer_keys[layer_index])))

    def _transformer_keys(self) -> list[str]:
        return self.layer_keys[1:self.final_layer_norm_idx]

    def _build_pp_transformer_map(self) -> dict[int, list[str]]:
        return dict(enumerate(_split(self._transformer_keys(), self.pp_degree)))

    def _build_transformer_file_map(self) -> dict[tuple[int, int], list[list[str]]]:
        out: dict[tuple[int, int], list[list[str]]] = {}
        for pp_index, keys in self.pp_to_transformer_map.items():
            for key in keys:
                for tp_index, files in enumerate(self._layer_partitions(key)):
                    out.setdefault((tp_index, pp_index), []).append(files)
        return out

    def _merge_state_dicts(self, sd_list: list[dict]) -> dict:
        """One layer's tensor-parallel slices joined (the module docstring's rules)."""
        merged = {}
        for key, value in sd_list[0].items():
            if key in SEQUENTIAL_LAYERS or not torch.is_tensor(value):
                merged[key] = value
            else:
                merged[key] = torch.cat([sd[key] for sd in sd_list], dim=LAYER_CONCAT_DIM.get(key, 0))
        return merged

    # ---- printing ----------------------------------------------------------------------------------
    def show_2d_mapping(self) -> None:
        print("reshaped 2d map ---- begin")
        for i in range(self.pp_degree):
            for j in range(self.tp_degree):
                print(f"[{i}, {j}] = {self.get_2d_parallel_files(tp_index=j, pp_index=i)}")
        print("reshaped 2d map ---- end")

    def show_tp_embedding_map(self) -> None:
        self._dump_mapping(self.tp_to_embedding_map, "tp_to_embedding_layers")

    def show_tp_final_norm_map(self) -> None:
        self._dump_mapping(self.tp_to_final_norm_map, "tp_to_final_norm_layers")

    def show_pp_transformer_map(self) -> None:
        self._dump_mapping(self.pp_to_transformer_map, "pp_to_transformer_layers")

    def show_transformer_file_map(self) -> None:
        self._dump_mapping(self.transformer_file_map, "rank_to_transformer_files")

    def _dump_mapping(self, data_map: dict, map_tag: str | None = None) -> None:
        if map_tag is not None:
            print(f"Dump mapping: {map_tag}")
        for k, v in data_map.items():
            print(f"{k} = {v}")

    def validate_files(self) -> None:
        validate_files(self.file_list)
