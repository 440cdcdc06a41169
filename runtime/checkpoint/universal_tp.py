"""Tensor-parallel tags into the universal layout: every rank's slices of a parameter joined into
the whole tensor, with the keys DeepSpeed's restore cuts it by (``autotp_universal.SliceRules``).

Two inputs:

- a DeepSpeed AutoTP tag (one ZeRO tag per tensor rank, ``mp_rank_TT_model_states.pt`` or at
  ZeRO-3 ``zero_pp_rank_D_mp_rank_TT_model_states.pt``): ``read_tensor_parallel_whole`` reads each
  rank's parameters whole over its data-parallel ranks (``deepspeed_read.read_part``) and joins
  them by the tag's ``universal_checkpoint_info``;
- DeepSpeed's own intermediate folder (``ds_to_universal``'s ``tmp/<param>/<tp rank>/<state>.<dp
  rank>`` fragments): ``merge_zero_shards`` and ``merge_tp_slices`` are its steps, by DeepSpeed's
  names and arguments (``deepspeed.checkpoint.ds_to_universal``).

Limitations: the whole fp32 and optimizer state is read into host memory; pipeline x tensor tags
are not converted (``DeepSpeedCheckpoint`` reads them file by file).
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from dslaunch import safe_write
from dslaunch.errors import CheckpointError, SliceMetadataError
from dslaunch.runtime.checkpoint.autotp_universal import SliceRules, SubparamShape, refuse_unsupported
from dslaunch.runtime.checkpoint.deepspeed_constants import PARAM, UNIVERSAL_CHECKPOINT_INFO
from dslaunch.runtime.checkpoint.deepspeed_layout import model_states_name
from dslaunch.runtime.checkpoint.deepspeed_pickle import DeepSpeedObject, to_bytes
from dslaunch.runtime.checkpoint.deepspeed_read import DeepSpeedState, read_part

__all__ = ["tp_degree", "read_tensor_parallel_whole", "merge_zero_shards", "merge_tp_slices", "stored"]

_log = logging.getLogger(__name__)
_STATES = ("fp32", "exp_avg", "exp_avg_sq")
_SUBPARAM_CLASS = "deepspeed.checkpoint.universal_checkpoint.SubparamShape"


def tp_degree(folder: Path) -> int:
    """How many tensor-parallel ranks a DeepSpeed tag has (its ``mp_rank_TT`` model-states files,
    ZeRO-3's of data-parallel rank 0 included); 1 for a data-parallel tag."""
    degree = 0
    while (folder / model_states_name(None, degree)).exists() or (folder / model_states_name(0, degree)).exists():
        degree += 1
    return max(degree, 1)


def stored(whole: torch.Tensor, extras: dict[str, Any]) -> bytes:
    """A ``zero/<param>/<state>.pt`` file's bytes: ``{**extras, "param": whole}``, a ``SubparamShape``
    as DeepSpeed's class (its restore reads the attributes)."""
    out = {k: (DeepSpeedObject(_SUBPARAM_CLASS, (list(v.patterns), tuple(v.shape), int(v.partition_dim)))
               if isinstance(v, SubparamShape) else v) for k, v in extras.items()}
    return to_bytes({**out, PARAM: whole.contiguous()})


def read_tensor_parallel_whole(folder: Path, strict: bool = True) -> tuple[DeepSpeedState, dict[str, dict]]:
    """Every trained parameter of the DeepSpeed AutoTP tag ``folder`` whole (fp32 master and
    optimizer state), and per parameter the keys to store beside it (``cat_dim``, ...).

    Args:
        strict: every pattern of ``universal_checkpoint_info`` must name some parameter (DeepSpeed's
            default; its ``--no_strict`` only warns).
    Raises:
        CheckpointError: a rank's file is missing or broken (names it), patterns left unused
            (``strict``), or the tag holds no optimizer state (ZeRO stage 0);
        UnconvertibleLayoutError: a layer could not describe its split;
        SliceMetadataError: the slice records do not describe the slices.
    """
    parts = [read_part(folder, True, None, t) for t in range(tp_degree(folder))]
    if parts[0].stage == 0:
        raise CheckpointError("holds no ZeRO optimizer files (ZeRO stage 0): universal checkpoints are made "
                              "from ZeRO checkpoints", str(folder))
    info = parts[0].states.get(UNIVERSAL_CHECKPOINT_INFO) or {}
    refuse_unsupported(info, str(parts[0].model_file))
    rules = SliceRules.from_info(info)
    unused = rules.patterns()
    fp32: dict[str, torch.Tensor] = {}
    optim: dict[str, dict[str, torch.Tensor]] = {}
    extras: dict[str, dict] = {}

    def joined(name: str, pieces: list[torch.Tensor]) -> torch.Tensor:
        whole, keys, used = rules.merge(name, pieces, len(parts))
        unused.difference_update(used)
        extras.setdefault(name, keys)
        return whole if whole is not None else torch.empty(0)  # None only without any slice

    for name in parts[0].fp32:
        missing = [t for t, p in enumerate(parts) if name not in p.fp32]
        if missing:
            raise CheckpointError(f"tensor-parallel ranks {missing} hold no optimizer state for {name!r}", str(folder))
        fp32[name] = joined(name, [p.fp32[name] for p in parts])
        optim[name] = {k: joined(name, [p.optim[name][k] for p in parts]) for k in parts[0].optim.get(name, {})}
    if unused:
        message = f"universal_checkpoint_info patterns {sorted(unused)} name no parameter of the checkpoint"
        if strict:
            raise CheckpointError(f"{message} (pass --no_strict to convert anyway)", str(parts[0].model_file))
        _log.warning("%s: %s", parts[0].model_file, message)
    return replace(parts[0], module={**parts[0].module, **fp32}, fp32=fp32, optim=optim), extras


def _load(path: Path) -> Any:
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except (OSError, RuntimeError, EOFError, ValueError) as exc:
        raise CheckpointError(f"unreadable or truncated ({type(exc).__name__}: {str(exc)[:200]})", str(path)) from None


def merge_zero_shards(param_base_path: str | Path, state: str, tp_degree: int,
                      slice_shapes: Sequence[Any] | None = None) -> list[Any]:
    """Each tensor rank's ``state`` of one parameter from the intermediate folder
    ``param_base_path/<tp rank>/<state>.<dp rank>``: the data-parallel fragments joined (in
    ``slice_shapes[t]``, else flat); for ``step`` one value per rank. A rank that wrote no fragment
    (it holds none of an uneven parameter) gets an empty tensor of its recorded shape, so later
    ranks keep their place.

    Raises:
        SliceMetadataError: the ranks' steps differ, or a rank whose recorded shape is not empty
            wrote no fragment.
    """
    base = Path(param_base_path)
    found = re.compile(re.escape(state) + r"\.([0-9]+)$")
    slices: list[Any] = []
    gaps: list[tuple[int, int]] = []
    for tp in range(tp_degree):
        folder = base / str(tp)
        paths = sorted((int(m.group(1)), p) for p in (folder.iterdir() if folder.is_dir() else ())
                       if (m := found.match(p.name)))
        if not paths:
            gaps.append((tp, len(slices)))
            continue
        shards = [_load(p) for _, p in paths]
        if state == "step":
            if any(not torch.equal(torch.as_tensor(s), torch.as_tensor(shards[0])) for s in shards[1:]):
                raise SliceMetadataError(f"the data-parallel ranks of tensor rank {tp} saved different steps", str(base))
            slices.append(shards[0])
            continue
        flat = torch.cat([s.reshape(-1) for s in shards])
        slices.append(flat.reshape(tuple(slice_shapes[tp])) if slice_shapes is not None else flat)
    if gaps and slice_shapes is not None and slices and torch.is_tensor(slices[0]):
        for tp, at in reversed(gaps):
            if math.prod(slice_shapes[tp]) != 0:
                raise SliceMetadataError(f"tensor rank {tp} wrote no {state} fragment, but its recorded shape "
                                         f"{tuple(slice_shapes[tp])} is not empty: the extraction lost data", str(base))
            slices.insert(at, torch.empty(tuple(slice_shapes[tp]), dtype=slices[0].dtype))
    return slices


def merge_tp_slices(uc_info: dict, dir: str | Path, slice_dir: str | Path, tp_degree: int,
                    name_and_shapes: tuple[str, Sequence[Any]]) -> set[str]:
    """DeepSpeed's merge step: the parameter ``name`` (``name_and_shapes``: it and its shape on each
    tensor rank) joined from ``slice_dir/<name>/`` into ``dir/<name>/{fp32,exp_avg,exp_avg_sq,step}.pt``.
    Returns the ``uc_info`` patterns that did not name it.

    Raises:
        SliceMetadataError: as ``SliceRules.merge``; CheckpointError: a fragment is unreadable or a
            write failed.
    """
    name, shapes = name_and_shapes
    rules = SliceRules.from_info(uc_info)
    source, target = Path(slice_dir) / name, Path(dir) / name
    unmatched = rules.patterns()
    files: dict[str, bytes] = {}
    step = merge_zero_shards(source, "step", tp_degree, shapes)
    if step:
        files["step.pt"] = to_bytes(step[0])
    for state in _STATES:
        whole, extras, used = rules.merge(name, merge_zero_shards(source, state, tp_degree, shapes), tp_degree)
        unmatched -= used
        if whole is not None:
            files[f"{state}.pt"] = stored(whole, extras)
    try:
        if files:
            safe_write.make_dirs(target)
        for file, data in files.items():
            safe_write.write_file(target, file, data)
    except OSError as exc:
        raise CheckpointError(f"cannot write the universal checkpoint: {safe_write.explain(exc, target)}") from None
    return unmatched

