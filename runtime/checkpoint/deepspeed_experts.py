"""DeepSpeed 0.19's MoE checkpoint files, both ways: one file per global expert, the dense rest.

An MoE model's tag in DeepSpeed's layout holds, beside the files of a dense one
(``deepspeed_layout``)::

    layer_L_expert_E_mp_rank_00_model_states.pt   MoE layer L's (in module order) global expert E:
                                                  {its state-dict keys, numbered globally: tensor},
                                                  written by the expert-data rank 0 holding it
    mp_rank_00_model_states.pt                    "module" without any expert key; "num_experts"
                                                  (one entry per MoE layer)
    expp_rank_R_mp_rank_00_optim_states.pt        without ZeRO: expert rank R's optimizer state
                                                  dict ({"optimizer": ...}), from its expert-data rank 0
    zero_pp_rank_D_mp_rank_00_optim_states.pt     ZeRO-1/2: as a dense model's, but an expert param
                                                  group is cut over its expert-data group only
                                                  ("partition_count" per group)

Global expert ``E`` of a layer at expert-parallel size ``ep`` is local expert ``E % n`` of expert
rank ``E // n`` (``n = num_experts / ep``); expert ranks are neighbours (rank ``% ep``), expert-data
peers every ``ep``-th rank: DeepSpeed's default layout, the only one its loader reads back.
"""

from __future__ import annotations

import re
from collections import OrderedDict
from typing import Any

import torch

from dslaunch.runtime.checkpoint.deepspeed_autoep import EP_SUFFIX
from dslaunch.runtime.checkpoint.experts import EXPERT_PREFIX, ep_rank, expert_names

__all__ = ["expert_file_name", "expert_ckpt_name", "load_moe_state_dict", "moe_layers", "dense_state", "expert_files", "localize", "global_names",
           "renumber", "expert_sets"]


_AUTOEP_WEIGHT = re.compile(r"(.*\.)?experts\.w[123]")  # DeepSpeed's expert_parameter_patterns


def expert_file_name(layer: int, expert: int, mp_rank: int = 0) -> str:
    """DeepSpeed's ``_get_expert_ckpt_name``: the file of MoE layer ``layer``'s global expert ``expert``."""
    return f"layer_{layer}_expert_{expert}_mp_rank_{mp_rank:02d}_model_states.pt"


def moe_layers(module: torch.nn.Module) -> list[tuple[str, Any]]:
    """``(prefix, MoE module)`` of every MoE layer, in module order (DeepSpeed's layer ids)."""
    from dslaunch.runtime.moe.layer import MoE

    return [(f"{name}." if name else "", m) for name, m in module.named_modules() if isinstance(m, MoE)]


def _is_expert_key(key: str) -> bool:
    return EXPERT_PREFIX in key


def dense_state(sd: dict[str, torch.Tensor]) -> OrderedDict:
    """The module state dict without expert keys (DeepSpeed's ``_get_non_moe_state_dict``)."""
    return OrderedDict((k, v) for k, v in sd.items() if not _is_expert_key(k))


def expert_files(module: torch.nn.Module, sd: dict[str, torch.Tensor], is_writer: bool) -> dict[str, dict]:
    """This rank's expert files: file name -> {global key: tensor}, for the layers whose
    expert-data rank 0 this rank is (``is_writer``; empty otherwise)."""
    if not is_writer:
        return {}
    out: dict[str, dict] = {}
    for layer, (prefix, moe) in enumerate(moe_layers(module)):
        first = ep_rank(moe.deepspeed_moe) * moe.num_local_experts
        for key, value in sd.items():
            head, sep, tail = key.partition(EXPERT_PREFIX)
            if sep and head == prefix:
                local, _, rest = tail.partition(".")
                expert = first + int(local)
                out.setdefault(expert_file_name(layer, expert), {})[f"{head}{sep}{expert}.{rest}"] = \
                    value.detach().clone()
    return out


def localize(module: torch.nn.Module, sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A state dict with globally numbered expert keys as this rank's module names them: its own
    experts' keys renamed to local ones, other experts' dropped."""
    to_local = {g: n for n, g in expert_names(module).items()}
    return {to_local.get(k, k): v for k, v in sd.items() if not _is_expert_key(k) or k in to_local}


def renumber(names: list[str], ep_rank: int) -> list[str]:
    """Expert parameter names as expert rank 0 numbers them (local ``j`` = global ``j``) renumbered
    for expert rank ``ep_rank``: each layer holds as many local experts as rank 0's names show. An
    AutoEP block's weight (``<block>.experts.w1``, one name on every expert rank) is named for its
    rank: ``<block>.experts.w1#ep<ep_rank>`` (``deepspeed_autoep.EP_SUFFIX``)."""
    per_layer: dict[str, int] = {}
    for n in names:
        head, sep, tail = n.partition(EXPERT_PREFIX)
        if sep:
            per_layer[head] = max(per_layer.get(head, 0), int(tail.split(".", 1)[0]) + 1)
    out = []
    for n in names:
        head, sep, tail = n.partition(EXPERT_PREFIX)
        if not sep:  # an AutoEP block's fused weight (``experts.w1``): this expert rank's rows
            out.append(f"{n}{EP_SUFFIX}{ep_rank}" if _AUTOEP_WEIGHT.fullmatch(n) else n)
            continue
        local, _, rest = tail.partition(".")
        out.append(f"{head}{sep}{ep_rank * per_layer[head] + int(local)}.{rest}")
    return out


def global_names(module: torch.nn.Module, current: dict) -> dict:
    """The live strategy state with each expert group's names made global (for lookups by name)."""
    rename = expert_names(module)
    return {**current, "groups": [{**g, "names": [rename.get(n, n) for n in g["names"]]} for g in current["groups"]]}


def expert_sets(world: int, partition_count: int) -> list[list[int]]:
    """The saved ranks holding each expert rank's experts of a group cut ``partition_count`` ways
    (its expert-data peers: every ``ep``-th rank from the expert rank)."""
    ep = world // partition_count
    return [list(range(e, world, ep)) for e in range(ep)]


def expert_ckpt_name(checkpoints_path: str, layer_id: int, expert_id: int, tag: Any, mpu: Any = None,
                     checkpoint_mp_rank: int | None = None) -> str:
    """DeepSpeed's ``_get_expert_ckpt_name``: the path of a global expert's file; ``layer_id`` < 0
    names the files of DeepSpeed before per-layer files (``expert_E_mp_rank_XX_model_states.pt``).
    The model-parallel rank: ``checkpoint_mp_rank``, else ``mpu``'s, else 0."""
    import os

    mp = checkpoint_mp_rank if checkpoint_mp_rank is not None else 0 if mpu is None else mpu.get_model_parallel_rank()
    name = f"expert_{expert_id}_mp_rank_{mp:02d}_model_states.pt" if layer_id < 0 else expert_file_name(layer_id,
                                                                                                          expert_id, mp)
    return os.path.join(checkpoints_path, "" if tag is None else str(tag), name)


def load_moe_state_dict(checkpoint_path: str, tag: Any, state_dict: dict, old_moe_load: bool, model: Any = None,
                        mpu: Any = None, autoep_layers: Any = None, folding_spec: Any = None,
                        checkpoint_mp_rank: int | None = None) -> None:
    """DeepSpeed's ``DeepSpeedEngine.load_moe_state_dict``: add this rank's experts of ``model``'s
    MoE layers and AutoEP blocks (numbered together in module order) to ``state_dict``, from their
    files in ``checkpoint_path/tag``: a ``deepspeed.moe`` layer's under its local names, an AutoEP
    block's stacked into its fused weights (dslaunch's names). ``autoep_layers``: the tag's
    ``ds_autoep_layers``, validated first. ``old_moe_load``: files without a layer number.

    Raises:
        CheckpointError: a file is missing or lacks a key; CheckpointLayoutError (a RuntimeError):
            ``autoep_layers`` is malformed or does not fit the model; NotInDslaunchError: folding.
    """
    from dataclasses import replace
    from pathlib import Path

    from dslaunch.errors import CheckpointError, NotInDslaunchError
    from dslaunch.runtime.checkpoint.deepspeed_autoep import autoep_blocks, check_metadata, from_deepspeed
    from dslaunch.runtime.checkpoint.deepspeed_read import read_file
    from dslaunch.runtime.moe.autoep import AutoEPMoE
    from dslaunch.runtime.moe.layer import MoE

    if folding_spec is not None and getattr(folding_spec, "tp_size", 1) > 1:
        raise NotInDslaunchError("load_moe_state_dict with an AutoEP+AutoTP folding_spec is not in dslaunch")
    mp = checkpoint_mp_rank if checkpoint_mp_rank is not None else 0 if mpu is None else mpu.get_model_parallel_rank()
    blocks = {b.prefix: b for b in autoep_blocks(model)} if model is not None else {}
    where = str(Path(checkpoint_path) / str(tag))
    if autoep_layers is not None:
        check_metadata(autoep_layers, list(blocks.values()), where)
    if model is None:
        return
    if old_moe_load and blocks:
        raise CheckpointError("files without a layer number (old_moe_load) do not hold AutoEP blocks", where)
    layer = 0
    for name, module in model.named_modules():
        prefix = f"{name}." if name else ""
        if isinstance(module, AutoEPMoE):
            block = blocks[prefix]
            first, got = block.ep_rank * block.num_local, {}
            for j in range(block.num_local):
                path = Path(expert_ckpt_name(checkpoint_path, layer, first + j, tag, None, mp))
                sd = read_file(path)
                for w in ("w1", "w2", "w3"):
                    key = f"{prefix}experts.{w}.{first + j}"
                    if key not in sd:
                        raise CheckpointError(f"key {key!r} is missing", str(path))
                    got[f"{prefix}experts.{w}.{j}"] = sd[key]
            state_dict.update(from_deepspeed([replace(block, num_experts=block.num_local, ep_rank=0)], got, where))
            layer += 1
        elif isinstance(module, MoE):
            first = ep_rank(module.deepspeed_moe) * module.num_local_experts
            for j in range(module.num_local_experts):
                path = Path(expert_ckpt_name(checkpoint_path, -1 if old_moe_load else layer, first + j, tag, None, mp))
                for key, value in read_file(path).items():
                    state_dict[key.replace(f"{EXPERT_PREFIX}{first + j}.", f"{EXPERT_PREFIX}{j}.")] = value
            layer += 1
