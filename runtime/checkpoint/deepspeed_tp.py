"""DeepSpeed's AutoTP training checkpoints (``tensor_parallel.autotp_size``), read whole.

Owns joining tensor-parallel rank T's files (``mp_rank_TT_model_states.pt`` and its data-parallel
ranks' ``zero_pp_rank_D_mp_rank_TT_optim_states.pt``, each a plain ZeRO tag of T's slices, names in
``deepspeed_layout``) into whole parameters. DeepSpeed 0.19 records where each rank's slice lies
in ``universal_checkpoint_info["affine_map"]`` (in every model-states file): per parameter (a
``^name$`` pattern) its logical shape and, per rank, pieces, each a strided view of the logical
tensor (``source``: offset, strides) equal to a strided view of the rank's slice (``dest``). A
parameter no pattern names is the same on every rank (rank 0's is taken). Fp32 masters, Adam
moments and module weights are joined the same way; ``deepspeed_load`` cuts them again for the
live engine's tensor-parallel degree (any that divides the shapes), so the saving degree does not
matter.

ZeRO-3 tags of DeepSpeed 0.19.4+'s AutoTP (``zero_pp_rank_D_mp_rank_TT_model_states.pt``, no
``mp_rank_TT`` file) are read the same way, each tensor rank's data-parallel partitions joined first.

Limitations: stage 0's optimizer state numbers one rank's slices only: load it with
``load_optimizer_states=False``; a tag without the affine map (DeepSpeed before 0.18, a Megatron
``mpu``'s) is refused in one line.
"""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from dslaunch.errors import CheckpointError
from dslaunch.runtime.checkpoint.deepspeed_layout import model_states_name
from dslaunch.runtime.checkpoint.deepspeed_read import DeepSpeedState, read_file, read_part

__all__ = ["is_tensor_parallel", "joiner", "read_tensor_parallel"]


def is_tensor_parallel(folder: Path) -> bool:
    """A tag with model-parallel ranks other than 00 and no pipeline layer files."""
    return (folder / model_states_name(None, 1)).exists() or (folder / model_states_name(0, 1)).exists()


def _affine_map(states: dict, path: Path) -> dict[str, dict]:
    info = states.get("universal_checkpoint_info")
    params = ((info or {}).get("affine_map") or {}).get("params") if isinstance(info, dict) else None
    if not isinstance(params, dict):
        raise CheckpointError("a tensor-parallel checkpoint without DeepSpeed AutoTP's slice map "
                              "(universal_checkpoint_info.affine_map): only AutoTP training tags of DeepSpeed "
                              ">= 0.18 can be loaded, not a Megatron mpu's", str(path))
    return params


def joiner(params: dict[str, dict], folder: Path) -> Any:
    """``join(name, [each rank's tensor]) -> whole``, by the affine map."""
    patterns = [(re.compile(p), entry) for p, entry in params.items()]

    def join(name: str, shards: list[torch.Tensor]) -> torch.Tensor:
        entry = next((e for p, e in patterns if p.fullmatch(name)), None)
        if entry is None:
            return shards[0]
        ranks = entry["ranks"]
        if len(ranks) != len(shards):
            raise CheckpointError(f"{name!r} is cut over {len(ranks)} ranks in the slice map, the tag has "
                                  f"{len(shards)} tensor-parallel ranks", str(folder))
        whole = shards[0].new_empty(tuple(entry["logical_shape"])).contiguous()
        for rank, shard in enumerate(shards):
            plan = ranks.get(rank, ranks.get(str(rank)))
            if plan is None or tuple(shard.shape) != tuple(plan["shard_shape"]):
                raise CheckpointError(f"{name!r} of tensor-parallel rank {rank} has shape {tuple(shard.shape)}, "
                                      f"the slice map says {plan and plan['shard_shape']}", str(folder))
            shard = shard.contiguous()
            if shard.storage_offset():  # as_strided's offsets count from the storage's start
                shard = shard.clone()
            for piece in plan["pieces"]:
                (src, src_strides), (dst, dst_strides) = piece["source"], piece["dest"]
                whole.as_strided(piece["shape"], src_strides, src).copy_(
                    shard.as_strided(piece["shape"], dst_strides, dst))
        return whole

    return join


def read_tensor_parallel(folder: Path, optimizer: bool = True, trained: list[str] | None = None
                         ) -> DeepSpeedState:
    """``deepspeed_read.read_deepspeed`` of an AutoTP tag: every tensor-parallel rank's state,
    joined into whole parameters (the module docstring).

    Raises:
        CheckpointError: a rank's file missing or broken (names it), no slice map, or optimizer
            state without ZeRO.
    """
    # ZeRO-3 (DeepSpeed 0.19.4+): each tensor rank's model states are its data-parallel rank 0's file
    partition = None if (folder / model_states_name(None, 0)).exists() else 0
    first = read_file(folder / model_states_name(partition, 0))
    dims = first.get("checkpoint_parallel_dimensions") or {}
    degree = int(dims.get("tp_degree", first.get("mp_world_size", 1)))
    missing = [model_states_name(partition, t) for t in range(degree)
               if not (folder / model_states_name(partition, t)).exists()]
    if missing:
        raise CheckpointError(f"the checkpoint was saved at tensor-parallel degree {degree} (tp_degree) but "
                              f"{missing[:3]} are missing", str(folder))
    join = joiner(_affine_map(first, folder / model_states_name(partition, 0)), folder)
    parts = [read_part(folder, optimizer, None, t) for t in range(degree)]
    if optimizer and parts[0].stage == 0 and parts[0].states.get("optimizer") is not None:
        raise CheckpointError("a DeepSpeed AutoTP checkpoint without ZeRO numbers each rank's optimizer state by "
                              "position only: load it with load_optimizer_states=False, or save at ZeRO stage 1 or 2",
                              str(folder))
    module = {k: join(k, [p.module[k] for p in parts]) if torch.is_tensor(v) else v
              for k, v in parts[0].module.items()}
    fp32 = {k: join(k, [p.fp32[k] for p in parts]) for k in parts[0].fp32}
    optim = {k: {s: join(k, [p.optim[k][s] for p in parts]) for s in state} for k, state in parts[0].optim.items()}
    return replace(parts[0], module={**module, **fp32}, fp32=fp32, optim=optim)
