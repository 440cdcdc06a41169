"""AutoEP tags in dslaunch's own layout made universal (``dslaunch ds-to-universal``).

A dslaunch tag keeps an AutoEP block's fused expert weights under the model's names, each expert
rank's rows in its expert param group, one set per expert-data group (``meta["experts"]`` names
each rank's rows by global expert). The universal layout DeepSpeed reads and writes
(``universal``) wants DeepSpeed's names and every expert's rows in one tensor:
``zero/<block>.experts.w1/fp32.pt`` = ``{"param": [num_experts, F, H], "cat_dim": 0,
"is_expert_param": True, "ep_num_experts": num_experts}``, the router as ``<block>.router.gate.*``,
and model states with ``ds_autoep_layers``. The save records what that needs of each block
(``record``: ``meta["autoep"]``); ``whole_groups`` joins every expert rank's rows and renames
(``deepspeed_autoep.to_deepspeed``); ``model_states`` adds the blocks' records to the model states.

Limitations: a tag saved before ``meta["autoep"]`` was recorded is refused (load it at the new
``autoep_size`` directly, and save again); AutoEP folded with AutoTP is not converted.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch

from dslaunch.errors import CheckpointError
from dslaunch.runtime.checkpoint import deepspeed_autoep as autoep
from dslaunch.runtime.checkpoint.reshard import assemble

__all__ = ["record", "blocks_of", "whole_groups", "model_states", "expert_extras"]


def record(module: torch.nn.Module) -> list[dict[str, Any]] | None:
    """``meta["autoep"]``: per AutoEP block (module order) what its universal form needs; None
    without blocks."""
    return [{"prefix": b.prefix, "router_name": b.router_name, "names": list(b.names), "num_experts": b.num_experts,
             "ep_size": b.ep_size} for b in autoep.autoep_blocks(module)] or None


def blocks_of(meta: dict, where: str) -> list[autoep.AutoEPBlock]:
    """The tag's blocks as expert rank 0 holds them (``meta["autoep"]``).

    Raises:
        CheckpointError: the tag has expert groups and no such record.
    """
    rows = meta.get("autoep")
    if not rows:
        raise CheckpointError("holds expert parameters without an AutoEP record (meta 'autoep'; a deepspeed.moe "
                              "model, or a tag saved before dslaunch recorded it): not convertible to a universal "
                              "checkpoint", where)
    return [autoep.AutoEPBlock(r["prefix"], r["router_name"], tuple(r["names"]), int(r["num_experts"]),
                               int(r["num_experts"]) // int(r["ep_size"]), int(r["ep_size"]), 0) for r in rows]


def _named(group: dict, shapes: list) -> dict[str, dict[str, torch.Tensor]]:
    """A whole group's master and optimizer state, per parameter: key ("master" or a state's) ->
    name -> tensor of its shape."""
    out: dict[str, dict[str, torch.Tensor]] = {}
    for key, flat in {"master": group["master"], **group["optim_state"]}.items():
        offset, named = 0, OrderedDict()
        for name, shape in zip(group["names"], shapes, strict=True):
            n = math.prod(shape)
            named[name] = flat.reshape(-1)[offset:offset + n].float().view(tuple(shape))
            offset += n
        out[key] = named
    return out


def _first_expert(rows: list[str], name: str) -> int:
    """The global expert of ``name``'s first row (``meta["experts"]``: ``<name>[<expert>]``)."""
    return min(int(r[len(name) + 1:-1]) for r in rows if r.startswith(f"{name}["))


def whole_groups(read: Callable[[int], dict], meta: dict, blocks: list[autoep.AutoEPBlock], where: str) -> list[dict]:
    """Every param group whole in DeepSpeed's names (``names``, ``shapes``, flat ``master`` and
    ``optim_state``, ``optim_scalars``, ``hparams``), an expert group's weights joined over every
    expert (``read(rank)``: that saved rank's strategy state).

    Raises:
        CheckpointError: the shards do not cover a group, or a block's experts are not all saved.
    """
    pmap = meta["partition"]
    shards = {int(r): read(int(r)) for r in sorted({r for g in pmap["groups"] for r in g["ranges"]}, key=int)}
    out = []
    for gi, g in enumerate(pmap["groups"]):
        full = [(0, int(g["numel"]))]
        if "reduce_group" not in g:
            whole = assemble([{**sd, "groups": [sd["groups"][gi]]} for sd in shards.values()], full)["groups"][0]
            named = _named(whole, whole["shapes"])
        else:  # one expert-data group per set of rows: each expert rank's rows, then stacked
            sets: dict[tuple[str, ...], list[int]] = {}
            for r in shards:
                sets.setdefault(tuple(meta["experts"][str(r)][str(gi)]), []).append(r)
            pieces: dict[str, dict[str, dict[int, torch.Tensor]]] = {}
            for rows, ranks in sets.items():
                whole = assemble([{**shards[r], "groups": [shards[r]["groups"][gi]]} for r in ranks],
                                 full)["groups"][0]
                for key, named in _named(whole, whole["shapes"]).items():
                    for name, value in named.items():
                        pieces.setdefault(key, {}).setdefault(name, {})[_first_expert(list(rows), name)] = value
            named = {key: {n: torch.cat([parts[e] for e in sorted(parts)]) for n, parts in by_name.items()}
                     for key, by_name in pieces.items()}
            for name, value in named["master"].items():
                block = next(b for b in blocks if name.startswith(f"{b.prefix}experts."))
                if value.shape[0] != block.num_experts:
                    raise CheckpointError(f"expert param group {gi}: {name} has {value.shape[0]} of "
                                          f"{block.num_experts} experts' rows", where)
        ds = {key: autoep.to_deepspeed(blocks, tensors) for key, tensors in named.items()}
        out.append({"names": list(ds["master"]), "shapes": [tuple(v.shape) for v in ds["master"].values()],
                    "master": _flat(ds["master"]), "optim_state": {k: _flat(v) for k, v in ds.items() if k != "master"},
                    "optim_scalars": dict(whole["optim_scalars"]), "hparams": dict(whole["hparams"])})
    return out


def _flat(named: dict) -> torch.Tensor:
    return torch.cat([v.reshape(-1) for v in named.values()]) if named else torch.empty(0)


def expert_extras(blocks: list[autoep.AutoEPBlock]) -> dict[str, dict[str, Any]]:
    """DeepSpeed's keys beside each expert weight in its universal files."""
    return {f"{b.prefix}experts.{w}": {"cat_dim": 0, "is_expert_param": True, "ep_num_experts": b.num_experts}
            for b in blocks for w in ("w1", "w2", "w3")}


def model_states(blocks: list[autoep.AutoEPBlock], module: dict, shapes: list[OrderedDict], stage: int) -> dict:
    """The model states' AutoEP keys for a universal tag (``module``: the model's weights in
    dslaunch's names, experts whole; ``shapes``: ``param_shapes`` in DeepSpeed's names, experts
    whole): ``module`` in DeepSpeed's names without the experts, ``param_shapes`` with expert rank
    0's rows, ``num_experts``, ``ds_autoep_layers`` (expert rank 0's) and
    ``universal_checkpoint_info``."""
    local = {f"{b.prefix}experts.{w}": b.num_local for b in blocks for w in ("w1", "w2", "w3")}
    param_shapes = [OrderedDict((n, torch.Size([local[n], *s[1:]]) if n in local else s) for n, s in g.items())
                    for g in shapes]
    layers = autoep.metadata(blocks, {}, 0, 1, shapes={n: s for g in param_shapes for n, s in g.items()},
                             partitioned=stage == 3)
    return {"module": autoep.module_file(blocks, module), "param_shapes": param_shapes,
            "num_experts": [b.num_experts for b in blocks], "ds_autoep_layers": layers,
            "universal_checkpoint_info": {"universal_checkpoint_version": 0.4,
                                          "expert_parameter_patterns": [r".*\.experts\.w[123]$"],
                                          "ds_autoep_layers": layers}}
