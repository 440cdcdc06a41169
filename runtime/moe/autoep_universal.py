"""DeepSpeed's AutoEP universal-checkpoint helpers (``deepspeed.checkpoint.autoep_universal``).

DeepSpeed's ``ds_to_universal`` first extracts each ZeRO-1/2 rank's fragment of every parameter
into a temporary folder (``<tmp>/<param>/0/<state>.<dp rank>``, ``zero12_fragment_path``); for an
AutoEP block's expert weight, ``consolidate_autoep_zero12_expert_states`` then joins each expert
rank's fragments (its expert-data peers': ``ep_rank, ep_rank + ep_size, ...``, or a run of
``dp / ep_size`` ranks with ``use_data_before_expert_parallelism``) into its rows, and the expert
ranks' rows into the whole weight ``[num_experts, ...]``, written as DeepSpeed's universal file
``<out>/zero/<param>/<state>.pt`` = ``{"param", "cat_dim": 0, "is_expert_param": True,
"ep_num_experts"}`` (and ``step.pt``, the same on every rank).

dslaunch's own converter (``dslaunch ds-to-universal``, ``runtime/checkpoint/universal.py``)
does not go through these fragments; these functions are for scripts that call DeepSpeed's.

Limitations: expert tensor slices (``tp_degree`` > 1) are refused in one line, and so is
``consolidate_autoep_expert_files`` (DeepSpeed's per-expert files, folded AutoEP+AutoTP shards among
them, into a universal checkpoint); the placement is
DeepSpeed's uniform one (expert rank ``r`` holds experts ``[r * n, (r + 1) * n)``).
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import torch

from dslaunch import safe_write
from dslaunch.errors import CheckpointError, NotInDslaunchError

__all__ = ["consolidate_autoep_expert_files", "consolidate_autoep_zero12_expert_states", "zero12_fragment_path"]

_STATES = ("fp32", "exp_avg", "exp_avg_sq")


def zero12_fragment_path(temp_dir: str | os.PathLike, param_name: str, state_name: str, dp_rank: int) -> str:
    """DeepSpeed's ``_zero12_fragment_path``: data-parallel rank ``dp_rank``'s fragment of
    ``param_name``'s ``state_name`` in the conversion's temporary folder."""
    return os.path.join(temp_dir, param_name, "0", f"{state_name}.{dp_rank:0>2d}")


def _dp_ranks(ep_rank: int, dp_degree: int, ep_size: int, data_first: bool) -> range:
    """The data-parallel ranks holding expert rank ``ep_rank``'s fragments."""
    if dp_degree % ep_size:
        raise CheckpointError(f"ZeRO data-parallel degree {dp_degree} is not divisible by the AutoEP size {ep_size}")
    if data_first:
        edp = dp_degree // ep_size
        return range(ep_rank * edp, (ep_rank + 1) * edp)
    return range(ep_rank, dp_degree, ep_size)


def _fragments(temp_dir: Any, name: str, state: str, ranks: range) -> list[torch.Tensor]:
    out = []
    for r in ranks:
        path = zero12_fragment_path(temp_dir, name, state, r)
        if not os.path.isfile(path):
            continue
        t = torch.load(path, map_location="cpu", weights_only=True)
        if not torch.is_tensor(t) or (state != "step" and t.dtype != torch.float32):
            raise CheckpointError(f"an AutoEP {state} fragment must be an fp32 tensor, got "
                                  f"{getattr(t, 'dtype', type(t).__name__)}", path)
        out.append(t)
    return out


def consolidate_autoep_zero12_expert_states(temp_dir: str | os.PathLike, output_dir: str | os.PathLike,
                                            expert_param_info: dict[str, dict], slice_shapes: dict[str, Any],
                                            dp_degree: int, tp_degree: int, use_data_before_expert_parallel: bool = False,
                                            fp32_fallback_dir: Any = None) -> None:
    """Write each AutoEP expert weight's whole fp32 master, ``exp_avg`` and ``exp_avg_sq`` (and its
    ``step``) from the ranks' ZeRO-1/2 fragments (the module docstring).

    Args:
        expert_param_info: param name -> its block's ``num_experts``, ``num_local_experts``, ``ep_size``.
        slice_shapes: param name -> one expert rank's shape (``[num_local_experts, ...]``).
        dp_degree: ZeRO data-parallel ranks of the saving run; ``tp_degree``: must be 1.
        fp32_fallback_dir: DeepSpeed's fallback for ranks without fragments; not used here (each
            expert rank's fragments must all be there).
    Raises:
        NotInDslaunchError: ``tp_degree`` > 1 (expert tensor slices);
        CheckpointError: a fragment is missing or of another size, or the steps differ (one line).
    """
    if tp_degree != 1:
        raise NotInDslaunchError("deepspeed.checkpoint.autoep_universal.consolidate_autoep_zero12_expert_states with "
                                 f"tp_degree={tp_degree} (AutoEP expert tensor slices) is not in dslaunch; convert a "
                                 "tag without tensor parallelism")
    for name, meta in expert_param_info.items():
        if name not in slice_shapes:
            raise CheckpointError(f"AutoEP expert parameter {name} is missing from the checkpoint's parameter shapes")
        local = tuple(slice_shapes[name])
        ep_size, num_experts = int(meta["ep_size"]), int(meta["num_experts"])
        where = Path(output_dir) / "zero" / name
        safe_write.make_dirs(where)
        for state in _STATES:
            rows = []
            for ep_rank in range(ep_size):
                parts = _fragments(temp_dir, name, state, _dp_ranks(ep_rank, dp_degree, ep_size,
                                                                     use_data_before_expert_parallel))
                flat = torch.cat([p.reshape(-1) for p in parts]) if parts else torch.empty(0)
                if flat.numel() != math.prod(local):
                    raise CheckpointError(f"AutoEP {state} fragments of {name} for expert rank {ep_rank} hold "
                                          f"{flat.numel()} elements, expected {math.prod(local)} ({local})",
                                          str(Path(temp_dir) / name))
                rows.append(flat.view(local))
            whole = torch.cat(rows)
            if whole.shape[0] != num_experts:
                raise CheckpointError(f"AutoEP {name}: {whole.shape[0]} experts joined, expected {num_experts}")
            _write(where, f"{state}.pt", {"param": whole, "cat_dim": 0, "is_expert_param": True,
                                          "ep_num_experts": num_experts})
        steps = _fragments(temp_dir, name, "step", range(dp_degree))
        if not steps:
            raise CheckpointError(f"AutoEP {name}: no optimizer step fragment", str(Path(temp_dir) / name))
        if any(not torch.equal(torch.as_tensor(s), torch.as_tensor(steps[0])) for s in steps[1:]):
            raise CheckpointError(f"AutoEP {name}: the ranks' optimizer steps differ", str(Path(temp_dir) / name))
        _write(where, "step.pt", steps[0])


def _write(folder: Path, name: str, obj: Any) -> None:
    from dslaunch.runtime.checkpoint.deepspeed_pickle import to_bytes

    safe_write.write_file(folder, name, to_bytes(obj))


def consolidate_autoep_expert_files(*args: Any, **kwargs: Any) -> None:
    """Refused: DeepSpeed's per-expert files (folded AutoEP+AutoTP expert shards among them) into a
    universal checkpoint.

    Raises:
        NotInDslaunchError: always.
    """
    raise NotInDslaunchError("deepspeed.checkpoint.autoep_universal.consolidate_autoep_expert_files (DeepSpeed's "
                             "consolidation of AutoEP expert files, folded AutoEP+AutoTP shards among them, for a "
                             "universal checkpoint) is not in dslaunch; a folded tag loads at its saving layout, and "
                             "`dslaunch ds-to-universal` converts a DeepSpeed-format AutoEP tag of ZeRO-1/2")
