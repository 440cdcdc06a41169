"""Which files of a DeepSpeed checkpoint make up each rank of a smaller (pipeline, tensor,
data)-parallel shape: DeepSpeed's ``reshape_meg_2d``, ``reshape_3d_utils`` and ``reshape_utils``.

A tag saved at pipeline degree PP and tensor degree TP numbers its model-states files pipeline-major
(``mp_rank_XX`` with XX = pp * TP + tp) and its ZeRO files data-parallel-major (file index
dp * PP * TP + XX, as ``get_zero_files`` sorts them). Reshaping to a target shape gives each
target rank the list of source indices it merges: tensor ranks first (consecutive tp ranks of one
stage go together), then stages (consecutive stages of one tp rank), then data-parallel ranks.
``merge_state`` joins what those files hold (tensors end to end along dim 0).

Only contraction: a target degree must divide the source's (DeepSpeed's files cannot be split
here); anything else is one ``ReshapeError`` line naming the dimension and the valid degrees.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from dslaunch.errors import CheckpointError, CheckpointLayoutError, ReshapeError
from dslaunch.runtime.checkpoint.deepspeed_constants import (
    BF16_ZERO_FILE_PREFIX,
    CHECKPOINT_PARALLEL_DIMS,
    CHECKPOINT_PP_DEGREE,
    CHECKPOINT_TP_DEGREE,
    FP16_ZERO_FILE_PREFIX,
    LAYER_FILE_PREFIX,
    MODEL_FILE_PREFIX,
    ZERO_FILE_PREFIX,
)
from dslaunch.runtime.checkpoint.deepspeed_read import read_checkpoint_file

__all__ = ["check_contraction", "meg_2d_parallel_map", "reshape_meg_2d_parallel", "model_3d_desc", "get_model_3d_descriptor",
           "model_3d_descriptor_from_metadata", "flatten_dp_dimension", "unflatten_dp_dimension",
           "basic_folder_validation", "get_files", "get_files_with_prefix", "get_zero_files", "sort_zero_files",
           "validate_files", "partition_data", "merge_state", "merge_state_dict", "merge_state_list"]

PP_DIM, TP_DIM, DP_DIM = "PP", "TP", "DP"


# ---- files -------------------------------------------------------------------------------------
def basic_folder_validation(dir: str | os.PathLike) -> None:  # DeepSpeed's argument name
    """Raises ``CheckpointError`` unless ``dir`` is an existing folder."""
    if not os.path.exists(dir):
        raise CheckpointError("does not exist: pass a DeepSpeed checkpoint tag folder", str(dir))
    if not os.path.isdir(dir):
        raise CheckpointError("is not a folder: pass a DeepSpeed checkpoint tag folder", str(dir))


def get_files(dir: str | os.PathLike) -> list[str]:
    """Every file under ``dir`` (recursively), as paths."""
    return [os.path.join(root, f) for root, _, files in os.walk(dir) for f in files]


def get_files_with_prefix(all_files: Sequence[str], prefix: str) -> list[str]:
    """The paths in ``all_files`` whose file name starts with ``prefix``, sorted."""
    return sorted(f for f in all_files if os.path.basename(f).startswith(prefix))


def validate_files(file_list: Sequence[str]) -> None:
    """Prints a line for each path in ``file_list`` that is not a file (DeepSpeed's check)."""
    for f in file_list:
        if not os.path.isfile(f):
            print(f"Error: {f} is not existent")


def sort_zero_files(files: Sequence[str], prefix: str) -> list[str]:
    """ZeRO files by (data-parallel rank, model-parallel rank), numbers compared as numbers."""
    pattern = re.compile(f"{re.escape(prefix)}([0-9]+)_{MODEL_FILE_PREFIX}([0-9]+)")
    ranked = []
    for f in files:
        found = pattern.search(os.path.basename(f))
        if found is None:
            raise CheckpointError(f"cannot read the data- and model-parallel ranks from the name (expected "
                                  f"{prefix}<dp>_{MODEL_FILE_PREFIX}<mp>_optim_states.pt)", f)
        ranked.append((int(found[1]), int(found[2]), f))
    return [f for _, _, f in sorted(ranked)]


def get_zero_files(dir: str | os.PathLike) -> list[str]:
    """The ZeRO optimizer files under ``dir`` (plain, ``fp16_`` or ``bf16_``, the first kind found),
    by rank; empty when there are none."""
    everything = get_files(dir)
    for prefix in (ZERO_FILE_PREFIX, FP16_ZERO_FILE_PREFIX, BF16_ZERO_FILE_PREFIX):
        found = get_files_with_prefix(everything, prefix)
        if found:
            return sort_zero_files(found, prefix)
    return []


def partition_data(data_list: Sequence[Any], num_partitions: int) -> list[Sequence[Any]]:
    """``data_list`` cut into ``num_partitions`` consecutive equal parts.

    Raises:
        ReshapeError: ``num_partitions`` does not divide its length.
    """
    if num_partitions < 1 or len(data_list) % num_partitions:
        raise ReshapeError(f"{len(data_list)} items cannot be cut into {num_partitions} equal parts")
    size = len(data_list) // num_partitions
    return [data_list[i:i + size] for i in range(0, len(data_list), size)]


# ---- merging what the files hold ---------------------------------------------------------------
def _type_name(value: Any) -> str:
    # by name: each file's DeepSpeed classes are stand-ins of their own (``deepspeed_read``)
    return f"{type(value).__module__}.{type(value).__qualname__}"


def merge_state(state_a: Any, state_b: Any, key_list: Sequence[str] = ()) -> Any:
    """``state_b`` joined onto ``state_a``: dicts key by key (keys of either), lists and tuples item
    by item, tensors concatenated along dim 0; any other value is ``state_a``'s.

    Raises:
        ReshapeError: the two differ in type, or two lists in length (names the key path).
    """
    if _type_name(state_a) != _type_name(state_b):
        raise ReshapeError(f"cannot merge a {type(state_a).__name__} with a {type(state_b).__name__} at "
                           f"{'.'.join(key_list) or 'the top level'}")
    if isinstance(state_a, dict):
        return merge_state_dict(state_a, state_b, key_list)
    if isinstance(state_a, (list, tuple)):
        return type(state_a)(merge_state_list(state_a, state_b, key_list))
    if torch.is_tensor(state_a) and state_a.dim() > 0:
        return torch.cat([state_a, state_b], 0)
    return state_a


def merge_state_dict(dict_a: dict, dict_b: dict, key_list: Sequence[str] = ()) -> dict:
    merged = type(dict_a)()
    for key in [*dict_a, *(k for k in dict_b if k not in dict_a)]:
        if key in dict_a and key in dict_b:
            merged[key] = merge_state(dict_a[key], dict_b[key], [*key_list, str(key)])
        else:
            merged[key] = dict_a[key] if key in dict_a else dict_b[key]
    return merged


def merge_state_list(list_a: Sequence[Any], list_b: Sequence[Any], key_list: Sequence[str] = ()) -> list:
    if len(list_a) != len(list_b):
        raise ReshapeError(f"cannot merge lists of {len(list_a)} and {len(list_b)} items at "
                           f"{'.'.join(key_list) or 'the top level'}")
    return [merge_state(a, b, key_list) for a, b in zip(list_a, list_b, strict=True)]


# ---- the 2D (pipeline x tensor) map --------------------------------------------------------------
class meg_2d_parallel_map:  # noqa: N801 (DeepSpeed's name)
    """For each (pipeline, tensor) index, the source file indices it holds (``"pp,tp"`` keys)."""

    def __init__(self, pp_degree: int, tp_degree: int) -> None:
        self.pp_degree, self.tp_degree = pp_degree, tp_degree
        self.map: dict[str, list[int]] = {}

    def simple_init(self) -> None:
        """The source layout: index i at (i // tp_degree, i % tp_degree)."""
        self.map = {self._make_key(i // self.tp_degree, i % self.tp_degree): [i]
                    for i in range(self.pp_degree * self.tp_degree)}

    def add_data(self, pp_index: int, tp_index: int, data: list[int]) -> None:
        self._validate_indices(pp_index, tp_index)
        self.map.setdefault(self._make_key(pp_index, tp_index), []).extend(data)

    def get_data(self, pp_index: int | None = None, tp_index: int | None = None) -> list[int]:
        """The indices of (``pp_index``, ``tp_index``); None: of every index of that dimension."""
        self._validate_indices(pp_index, tp_index)
        pps = range(self.pp_degree) if pp_index is None else [pp_index]
        tps = range(self.tp_degree) if tp_index is None else [tp_index]
        return [d for i in pps for j in tps for d in self.map.get(self._make_key(i, j), [])]

    def print_data(self, tag: str) -> None:
        print(tag)
        for key, value in self.map.items():
            print(f"{key} = {value}")

    def _validate_indices(self, pp_index: int | None, tp_index: int | None) -> None:
        for index, degree, dim in ((pp_index, self.pp_degree, PP_DIM), (tp_index, self.tp_degree, TP_DIM)):
            if index is not None and not 0 <= index < degree:
                raise ReshapeError(f"{dim} index {index} is out of range: the degree is {degree}")

    @staticmethod
    def _make_key(i: int, j: int) -> str:
        return f"{i},{j}"


def check_contraction(argument: str, old: int, new: Any) -> None:
    """Raises ``ReshapeError`` naming ``argument`` unless ``new`` is a positive integer dividing ``old``."""
    if isinstance(new, bool) or not isinstance(new, int) or new < 1 or old % new:
        divisors = [d for d in range(1, old + 1) if old % d == 0]
        raise ReshapeError(f"{argument}={new!r} does not fit the checkpoint's {argument} {old}: it must be one of "
                           f"{divisors} (DeepSpeed's files are only merged, never split)")


def reshape_meg_2d_parallel(old_pp_degree: int, old_tp_degree: int, new_pp_degree: int, new_tp_degree: int,
                            verbose: bool = False) -> meg_2d_parallel_map:
    """The source file indices each (pipeline, tensor) index of the target holds.

    Raises:
        ReshapeError: a target degree larger than the source's or not dividing it.
    """
    check_contraction("pp_degree", old_pp_degree, new_pp_degree)
    check_contraction("tp_degree", old_tp_degree, new_tp_degree)
    current = meg_2d_parallel_map(old_pp_degree, old_tp_degree)
    current.simple_init()
    if verbose:
        current.print_data("original_2d_map:")
    if new_tp_degree != old_tp_degree:
        by_tp = meg_2d_parallel_map(old_pp_degree, new_tp_degree)
        for i in range(old_pp_degree):
            for j, part in enumerate(partition_data(current.get_data(pp_index=i), new_tp_degree)):
                by_tp.add_data(i, j, list(part))
        current = by_tp
    if verbose:
        current.print_data("after_tp_reshape:")
    if new_pp_degree != old_pp_degree:
        by_pp = meg_2d_parallel_map(new_pp_degree, current.tp_degree)
        for j in range(current.tp_degree):
            for i, part in enumerate(partition_data(current.get_data(tp_index=j), new_pp_degree)):
                by_pp.add_data(i, j, list(part))
        current = by_pp
    if verbose:
        current.print_data("final_2d_map:")
    return current


# ---- the 3D descriptor -------------------------------------------------------------------------
class model_3d_desc:  # noqa: N801 (DeepSpeed's name)
    """A (pipeline, tensor, data)-parallel shape."""

    def __init__(self, pp_degree: int = 1, tp_degree: int = 1, dp_degree: int = 1) -> None:
        self.pp_degree, self.tp_degree, self.dp_degree = pp_degree, tp_degree, dp_degree

    def reshape(self, target_3d_desc: model_3d_desc, verbose: bool = False) -> list[meg_2d_parallel_map]:
        """Per target data-parallel rank, the 2D map of source ZeRO file indices.

        Raises:
            ReshapeError: the target is larger in a dimension, or does not divide the source.
        """
        valid, errors = self.can_reshape(target_3d_desc)
        if not valid:
            raise ReshapeError("; ".join(errors))
        check_contraction("dp_degree", self.dp_degree, target_3d_desc.dp_degree)
        two_d = reshape_meg_2d_parallel(self.pp_degree, self.tp_degree, target_3d_desc.pp_degree,
                                        target_3d_desc.tp_degree, verbose)
        flat = flatten_dp_dimension(two_d, self.pp_degree * self.tp_degree, self.dp_degree)
        return unflatten_dp_dimension(flat, target_3d_desc.dp_degree)

    def get_desc(self) -> str:
        return f"{PP_DIM},{TP_DIM},{DP_DIM} = ({self.pp_degree}, {self.tp_degree}, {self.dp_degree})"

    def world_size(self) -> int:
        return self.pp_degree * self.tp_degree * self.dp_degree

    def is_valid(self, pp_index: int, tp_index: int, dp_index: int) -> tuple[bool, list[str]]:
        """(whether the indices are within the shape, a message per one that is not)."""
        errors = [f"{dim} indexing error: index {index} >= degree {degree}"
                  for index, degree, dim in ((pp_index, self.pp_degree, PP_DIM), (tp_index, self.tp_degree, TP_DIM),
                                             (dp_index, self.dp_degree, DP_DIM)) if index >= degree]
        return not errors, errors

    def can_reshape(self, target_3d_desc: model_3d_desc) -> tuple[bool, list[str]]:
        """(whether ``target_3d_desc`` is no larger in any dimension, a message per one that is)."""
        errors = [f"Expansion reshape not supported - {dim}: {old} ---> {new}"
                  for dim, old, new in ((PP_DIM, self.pp_degree, target_3d_desc.pp_degree),
                                        (TP_DIM, self.tp_degree, target_3d_desc.tp_degree),
                                        (DP_DIM, self.dp_degree, target_3d_desc.dp_degree)) if new > old]
        return not errors, errors

    def __repr__(self) -> str:
        return f"model_3d_desc({self.get_desc()})"


def flatten_dp_dimension(meg_2d_map: meg_2d_parallel_map, src_2d_size: int, dp_degree: int) -> meg_2d_parallel_map:
    """Each entry's source indices with those of every data-parallel rank (index + r * src_2d_size)."""
    flat = meg_2d_parallel_map(meg_2d_map.pp_degree, meg_2d_map.tp_degree)
    for i in range(meg_2d_map.pp_degree):
        for j in range(meg_2d_map.tp_degree):
            for idx in meg_2d_map.get_data(i, j):
                flat.add_data(i, j, [idx + r * src_2d_size for r in range(dp_degree)])
    return flat


def unflatten_dp_dimension(meg_2d_map: meg_2d_parallel_map, dp_degree: int) -> list[meg_2d_parallel_map]:
    """``meg_2d_map``'s indices cut into ``dp_degree`` maps, one per target data-parallel rank."""
    maps = [meg_2d_parallel_map(meg_2d_map.pp_degree, meg_2d_map.tp_degree) for _ in range(dp_degree)]
    for i in range(meg_2d_map.pp_degree):
        for j in range(meg_2d_map.tp_degree):
            for part, target in zip(partition_data(meg_2d_map.get_data(i, j), dp_degree), maps, strict=True):
                target.add_data(i, j, list(part))
    return maps


def _recorded_dims(model_file: str, metadata: dict) -> tuple[int, int] | None:
    dims = metadata.get(CHECKPOINT_PARALLEL_DIMS)
    if dims is None:
        return None
    if not isinstance(dims, dict):
        raise CheckpointLayoutError(f"{CHECKPOINT_PARALLEL_DIMS} must be a dictionary", model_file)
    values = tuple(dims.get(key) for key in (CHECKPOINT_PP_DEGREE, CHECKPOINT_TP_DEGREE))
    for key, value in zip((CHECKPOINT_PP_DEGREE, CHECKPOINT_TP_DEGREE), values, strict=True):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise CheckpointLayoutError(f"{CHECKPOINT_PARALLEL_DIMS}.{key} must be a positive integer, got {value!r}",
                                        model_file)
    return values  # type: ignore[return-value]


def model_3d_descriptor_from_metadata(file_list: Sequence[str], zero_file_list: Sequence[str],
                                      model_state_metadata: Sequence[tuple[str, dict]]) -> model_3d_desc:
    """The shape a tag was saved at, from its model-states files' ``checkpoint_parallel_dimensions``
    (DeepSpeed 0.19.8 writes them) or, for older tags, from the file counts: tensor degree = the
    number of ``layer_01*`` files (pipelines) or of model-states files.

    Raises:
        CheckpointLayoutError: the files record no, or different, dimensions, or the file counts do
            not match them.
    """
    recorded = [(f, _recorded_dims(f, meta)) for f, meta in model_state_metadata]
    found = [dims for _, dims in recorded if dims is not None]
    models = len(model_state_metadata)
    if found:
        missing = [f for f, dims in recorded if dims is None]
        if missing:
            raise CheckpointLayoutError(f"{CHECKPOINT_PARALLEL_DIMS} is missing from model-state files: {missing}")
        if len(set(found)) != 1:
            raise CheckpointLayoutError(f"{CHECKPOINT_PARALLEL_DIMS} disagrees across model-state files: {found}")
        pp, tp = found[0]
        if models != pp * tp:
            raise CheckpointLayoutError(f"{models} model-state files, but {CHECKPOINT_PP_DEGREE}={pp} * "
                                        f"{CHECKPOINT_TP_DEGREE}={tp} were saved")
        if len(zero_file_list) % (pp * tp):
            raise CheckpointLayoutError(f"{len(zero_file_list)} ZeRO files is not a multiple of "
                                        f"{CHECKPOINT_PP_DEGREE}={pp} * {CHECKPOINT_TP_DEGREE}={tp}")
        return model_3d_desc(pp, tp, max(1, len(zero_file_list) // (pp * tp)))
    first_layers = len(get_files_with_prefix(file_list, f"{LAYER_FILE_PREFIX}01"))
    tp = first_layers or models
    if tp < 1:
        raise CheckpointLayoutError("has no model-state files (mp_rank_*_model_states.pt)")
    pp = max(1, models // tp) if first_layers else 1
    return model_3d_desc(pp, tp, max(1, len(zero_file_list) // (pp * tp)))


def get_model_3d_descriptor(dir: str | os.PathLike) -> model_3d_desc:
    """The (pipeline, tensor, data)-parallel shape the tag folder ``dir`` was saved at (reads each
    model-states file once).

    Raises:
        CheckpointError: ``dir`` is no folder, a file is unreadable (names it), or the files disagree.
    """
    basic_folder_validation(dir)
    files = get_files(dir)
    metadata = [(f, {CHECKPOINT_PARALLEL_DIMS: read_checkpoint_file(Path(f)).get(CHECKPOINT_PARALLEL_DIMS)})
                for f in get_files_with_prefix(files, MODEL_FILE_PREFIX)]
    return model_3d_descriptor_from_metadata(files, get_zero_files(dir), metadata)

