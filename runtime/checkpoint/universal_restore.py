"""One parameter restored from its folder of a universal checkpoint (``zero/<param name>/``):
DeepSpeed's ``load_hp_checkpoint_state``, bound to a parameter by ``enable_universal_checkpoint``.

The folder holds the whole tensor of each state (``fp32.pt``, ``exp_avg.pt``, ...; each a tensor
or ``{"param": tensor, ...}`` with DeepSpeed's keys beside it) and ``step.pt``. This tensor rank's
slice is cut as the parameter's AutoTP record says (``autotp_universal.rank_slice``), else by the
file's keys: ``sub_param_shape`` (each fused sub-parameter cut on its own), ``param_n_sub_params``,
``cat_dim`` (default 0); a padded vocabulary is padded for this degree. The fp32 slice goes into
the parameter's high-precision fragment (DeepSpeed's ``_hp_mapping``: the range of the slice this
rank's optimizer partition holds) and the other states into ``_hp_mapping.optim_fragment``; a
parameter without ``_hp_mapping`` (dslaunch's, or a script's own) gets the fp32 slice itself.

dslaunch's engine does not go through here: ``load_universal`` reads the whole tag
(``universal.read_universal``). This is for scripts that restore single parameters.

Limitations: expert slices (``ep_size`` > 1) are refused in one line (``NotInDslaunchError``).
"""

from __future__ import annotations

import math
import pickle
import types
from pathlib import Path
from typing import Any

import torch

from dslaunch.errors import CheckpointError, NotInDslaunchError
from dslaunch.runtime.checkpoint.autotp_universal import rank_slice, restore_meta
from dslaunch.runtime.checkpoint.deepspeed_constants import (
    CAT_DIM,
    FP32_WEIGHT_KEY,
    PARAM,
    PARAM_N_SUB_PARAMS,
    SUB_PARAM_SHAPE,
    VOCAB_TENSOR,
)

__all__ = ["load_state", "load_hp_checkpoint_state", "enable_universal_checkpoint", "get_param_uc_restore_meta",
           "resolve_autotp_partition"]

get_param_uc_restore_meta = restore_meta


def resolve_autotp_partition(current_param: Any, ckpt_dict: dict, full_hp_param: torch.Tensor, tp_rank: int,
                             tp_world_size: int, state_key: str = FP32_WEIGHT_KEY) -> torch.Tensor | None:
    """DeepSpeed's ``_resolve_autotp_partition``: ``rank_slice`` of ``current_param``'s AutoTP record
    (``ckpt_dict`` and ``state_key`` serve DeepSpeed's scaled affine pieces, which dslaunch refuses)."""
    return rank_slice(restore_meta(current_param), full_hp_param, tp_rank, tp_world_size)


def load_state(path: Path) -> tuple[torch.Tensor, dict]:
    """One ``zero/<param>/<state>.pt``: its tensor, and the dict around it (empty for a bare
    tensor). DeepSpeed's objects beside the tensor (its ``SubparamShape``) are read as stand-ins.

    Raises:
        CheckpointError: missing, unreadable or truncated, or it holds no tensor (names the file).
    """
    from dslaunch.runtime.checkpoint.deepspeed_read import read_file

    obj: Any
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise CheckpointError("missing: the universal checkpoint has no such file for this parameter",
                              str(path)) from None
    except pickle.UnpicklingError:  # a dict naming DeepSpeed's classes: read with stand-ins
        obj = read_file(path)
    except (OSError, RuntimeError, EOFError, ValueError) as exc:
        raise CheckpointError(f"unreadable or truncated ({type(exc).__name__}: {str(exc)[:200]})", str(path)) from None
    info = obj if isinstance(obj, dict) else {}
    tensor = obj.get(PARAM) if isinstance(obj, dict) else obj
    if not torch.is_tensor(tensor):
        raise CheckpointError(f"holds no tensor (expected a tensor or {{{PARAM!r}: tensor}})", str(path))
    return tensor, info


def _by_file_keys(full: torch.Tensor, info: dict, tp_rank: int, tp_world_size: int) -> torch.Tensor:
    """This rank's slice, flat, by the keys DeepSpeed's conversion stored beside the tensor."""
    dim, shape = int(info.get(CAT_DIM, 0)), info.get(SUB_PARAM_SHAPE)
    if shape is not None:
        pdim = int(shape.partition_dim)
        sizes = shape.shape[pdim]
        sizes = tuple(sizes) if isinstance(sizes, (tuple, list)) else (int(sizes),)
        view = full.view([sum(d) if isinstance(d, (tuple, list)) else d for d in shape.shape])
        pieces, offset = [], 0
        for size in sizes:
            pieces.append(view.narrow(pdim, offset, size).chunk(tp_world_size, dim=pdim)[tp_rank])
            offset += size
        return torch.cat(pieces, dim=pdim).flatten()
    count = int(info.get(PARAM_N_SUB_PARAMS, 1))
    if count > 1:
        return torch.cat([p.chunk(tp_world_size, dim)[tp_rank] for p in full.chunk(count, dim)], dim).flatten()
    return full.chunk(tp_world_size, dim)[tp_rank].flatten()


def load_hp_checkpoint_state(param: torch.nn.Parameter, folder: str | Path, tp_rank: int = 0,
                             tp_world_size: int = 1, ep_rank: int = 0, ep_size: int = 1) -> Any:
    """Load ``param``'s states from its universal folder ``folder``, this tensor rank's slice (the
    module docstring). Returns what ``step.pt`` holds (None without one).

    Raises:
        CheckpointError: a file is missing or unreadable, or its tensor does not hold ``param``
            whole or in ``tp_world_size`` slices (names the file);
        UnconvertibleLayoutError, SliceMetadataError: the parameter's AutoTP record refuses the
            restore or does not fit the tensor;
        NotInDslaunchError: a slice of experts (``ep_size`` > 1).
    """
    folder = Path(folder)
    if ep_size > 1:
        raise NotInDslaunchError(f"{folder}: loading one expert rank's slice of a universal checkpoint is not in "
                                 "dslaunch: load the universal tag with load_checkpoint")
    mapping = getattr(param, "_hp_mapping", None)
    if mapping is not None:
        mapping.optim_fragment = {}
    meta = restore_meta(param)
    step = None
    for path in sorted(folder.glob("*.pt")):
        key = path.stem
        if key == "step":
            step = torch.load(path, map_location="cpu", weights_only=True)
            continue
        full, info = load_state(path)
        rank, world = tp_rank, tp_world_size
        if tuple(full.shape) == tuple(param.shape) and meta is None:  # whole already (e.g. replicated)
            rank, world = 0, 1
        if info.get(VOCAB_TENSOR) and meta is None and param.dim() > 0:  # padded again for this degree
            short = param.shape[0] * world - full.shape[0]
            if short < 0:
                raise CheckpointError(f"holds a vocabulary of {full.shape[0]} rows, more than {world} slices of "
                                      f"{param.shape[0]}", str(path))
            full = torch.nn.functional.pad(full, (0, 0) * (full.dim() - 1) + (0, short))
        piece = rank_slice(meta, full, rank, world)
        if piece is None:
            if full.numel() != world * param.numel():
                raise CheckpointError(f"holds {tuple(full.shape)}, which is not the parameter's {tuple(param.shape)} "
                                      f"whole or cut in {world} along dim {int(info.get(CAT_DIM, 0))}", str(path))
            piece = _by_file_keys(full, info, rank, world)
        _place(param, mapping, key, piece, path)
    return step


def _place(param: torch.nn.Parameter, mapping: Any, key: str, piece: torch.Tensor, path: Path) -> None:
    if mapping is None:  # no optimizer fragment: the fp32 slice is the parameter
        if key == FP32_WEIGHT_KEY:
            if piece.numel() != param.numel():
                raise CheckpointError(f"gives this rank {piece.numel()} elements, the parameter has "
                                      f"{param.numel()}", str(path))
            with torch.no_grad():
                param.copy_(piece.view(param.shape).to(param.dtype))
        return
    address = mapping.lp_fragment_address
    fragment = piece.narrow(0, address.start, address.numel)
    if key == FP32_WEIGHT_KEY:
        target = mapping.get_hp_fragment()
        if target.numel() != math.prod(fragment.shape):
            raise CheckpointError(f"gives {fragment.numel()} elements, the fp32 fragment has {target.numel()}",
                                  str(path))
        target.data.copy_(fragment.data)
    else:
        mapping.optim_fragment[key] = fragment.clone().detach()


def enable_universal_checkpoint(param_list: list[torch.nn.Parameter]) -> None:
    """Give each parameter ``load_hp_checkpoint_state(folder, tp_rank, tp_world_size)``
    (``load_hp_checkpoint_state`` bound to it), as DeepSpeed's optimizers do before loading a
    universal tag."""
    for param in param_list:
        param.load_hp_checkpoint_state = types.MethodType(load_hp_checkpoint_state, param)
