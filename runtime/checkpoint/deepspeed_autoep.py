"""DeepSpeed 0.19.8's AutoEP checkpoint layout, both ways (ZeRO stages 0-2).

DeepSpeed's converted block (``AutoEPMoELayer``) names its weights otherwise than dslaunch's
(``AutoEPMoE``, which keeps the model's names)::

    dslaunch                                     DeepSpeed
    <block>.gate.router.weight                   <block>.router.gate.weight (and, in the module
                                                 file, its alias <block>.<router name>.gate.weight)
    <block>.gate.router.e_score_correction_bias  <block>.router.e_score_correction_bias
    <block>.experts.gate_up_proj [n, 2F, H]      <block>.experts.w1 [n, F, H] (the gate rows) and
                                                 <block>.experts.w3 [n, F, H] (the up rows)
    <block>.experts.down_proj [n, H, F]          <block>.experts.w2 [n, H, F]

(a model with a separate up projection maps its three weights to ``w1``, ``w2``, ``w3``). In an
expert param group DeepSpeed's flat order is ``w1, w2, w3`` per block. A tag holds, beside a dense
model's files, one file per global expert ``E`` of AutoEP block ``L`` (module order),
``layer_L_expert_E_mp_rank_00_model_states.pt`` = ``{<block>.experts.w1.E: [F, H], ...}``, written
by the expert-data rank 0 holding it; the model-states file's ``module`` lacks ``w1/w2/w3``, and it
records the blocks in ``ds_autoep_layers`` (and ``universal_checkpoint_info``).

``to_deepspeed`` renames and splits dslaunch's tensors into DeepSpeed's (in DeepSpeed's order);
``from_deepspeed`` is the inverse, joining each block's expert weights whole over every expert
(``[num_experts, ...]``) and then taking this rank's rows, so a tag loads at another
``autoep_size``. ``check_metadata`` validates ``ds_autoep_layers`` as DeepSpeed's load does, with
one line naming the file and the key.

DeepSpeed's ZeRO-3 AutoEP layout (``checkpoint_format: "zero3_partitioned"``: the experts' weights
only in the ZeRO shards, no per-expert files) is read and written with the same names
(``deepspeed_autoep_zero3`` owns its records).

Limitations: a model with both ``deepspeed.moe`` layers and AutoEP blocks is not written in this
layout.
"""

from __future__ import annotations

import re
from collections import OrderedDict
from dataclasses import dataclass, replace
from typing import Any

import torch

from dslaunch.errors import CheckpointLayoutError, ExpertShapeError

__all__ = ["AutoEPBlock", "autoep_blocks", "to_deepspeed", "from_deepspeed", "expert_weight_names", "module_file",
           "expert_files", "metadata", "is_alias", "check_metadata", "names_from_deepspeed", "join_expert_ranks", "EP_SUFFIX", "REQUIRED_FIELDS"]

EP_SUFFIX = "#ep"
"""``<name>#ep<r>``: expert rank ``r``'s rows of an AutoEP weight, as ``deepspeed_read`` names
the partitions of an expert param group that several expert ranks saved under one name."""

REQUIRED_FIELDS = ("moe_layer_id", "module_path", "num_experts", "num_local_experts", "ep_size", "expert_key_prefix")
"""The fields DeepSpeed's load requires of each ``ds_autoep_layers`` entry."""

_DS_ROUTER, _OURS_ROUTER = "router.gate.", "gate.router."
_BIAS = "e_score_correction_bias"
_DS_EXPERT = re.compile(r"(.*)experts\.(w[123])(?:\.(\d+)|#ep(\d+))?")


@dataclass(frozen=True)
class AutoEPBlock:
    """One converted block as the checkpoint sees it."""

    prefix: str
    """``<block>.`` ('' at the root)."""
    router_name: str
    """The model's name of the router (DeepSpeed's alias of its own)."""
    names: tuple[str, str, str | None]
    """dslaunch's expert weights: gate (or fused gate+up), down, up (None: fused)."""
    num_experts: int
    num_local: int
    ep_size: int
    ep_rank: int

    @property
    def path(self) -> str:
        return self.prefix[:-1]


def autoep_blocks(module: torch.nn.Module) -> list[AutoEPBlock]:
    """Every AutoEP block of ``module``, in module order (DeepSpeed's ``moe_layer_id``)."""
    from dslaunch.runtime.moe.autoep import AutoEPMoE

    return [AutoEPBlock(f"{name}." if name else "", m.router_name, tuple(m.experts.names), m.num_experts,
                        m.num_local_experts, m.ep_size, m.ep_rank)
            for name, m in module.named_modules() if isinstance(m, AutoEPMoE)]


def expert_weight_names(blocks: list[AutoEPBlock]) -> set[str]:
    """dslaunch's names of the blocks' expert weights."""
    return {f"{b.prefix}experts.{n}" for b in blocks for n in b.names if n}


def _router_to_ds(block: AutoEPBlock, key: str) -> str | None:
    head = f"{block.prefix}{_OURS_ROUTER}"
    if not key.startswith(head):
        return None
    rest = key[len(head):]
    return f"{block.prefix}router.{rest}" if rest == _BIAS else f"{block.prefix}{_DS_ROUTER}{rest}"


def _split(block: AutoEPBlock, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A block's expert weights in DeepSpeed's names (``w1``, ``w2``, ``w3``), from dslaunch's."""
    w1, w2, w3 = (tensors[f"{block.prefix}experts.{n}"] if n else None for n in block.names)
    if w3 is None:
        w1, w3 = w1.chunk(2, dim=1)
    return {f"{block.prefix}experts.{k}": v.contiguous() for k, v in (("w1", w1), ("w2", w2), ("w3", w3))}


def to_deepspeed(blocks: list[AutoEPBlock], tensors: dict[str, Any]) -> OrderedDict:
    """``tensors`` (dslaunch's names, in order: a param group's, or a module state dict) in
    DeepSpeed's names and order: routers renamed, each block's expert weights split into ``w1``,
    ``w2``, ``w3`` where its first one was. Other entries pass unchanged."""
    out: OrderedDict = OrderedDict()
    experts = {f"{b.prefix}experts.{n}": b for b in blocks for n in b.names if n}
    for key, value in tensors.items():
        block = experts.get(key)
        if block is not None:
            if f"{block.prefix}experts.w1" not in out:
                out.update(_split(block, tensors))
            continue
        renamed = next((r for r in (_router_to_ds(b, key) for b in blocks) if r), key)
        out[renamed] = value
    return out


def _local_counts(block: AutoEPBlock, saved: int) -> str:
    """DeepSpeed's words for an expert-count mismatch: experts per expert rank, model and checkpoint."""
    return f"target_local_experts={block.num_local}, checkpoint_local_experts={saved / block.ep_size:g}"


def _join(parts: dict[int, torch.Tensor], what: str, where: str) -> torch.Tensor:
    """Parts numbered from 0 (global experts' 2D weights, or expert ranks' 3D rows) in one tensor."""
    if sorted(parts) != list(range(len(parts))):
        raise CheckpointLayoutError(f"{what}: has parts {sorted(parts)}, expected 0..{len(parts) - 1}", where)
    return torch.cat([parts[i].unsqueeze(0) if parts[i].dim() == 2 else parts[i] for i in sorted(parts)])


def names_from_deepspeed(blocks: list[AutoEPBlock], names: list[str]) -> list[str]:
    """A param group's DeepSpeed names in dslaunch's, in order (a block's ``w1``/``w3`` become its
    first weight, each name once)."""
    out: dict[str, None] = {}
    for name in names:
        m = _DS_EXPERT.fullmatch(name)
        block = next((b for b in blocks if m and b.prefix == m.group(1)), None)
        if block is not None:
            w = {"w1": block.names[0], "w2": block.names[1], "w3": block.names[2] or block.names[0]}[m.group(2)]
            out[f"{block.prefix}experts.{w}"] = None
            continue
        out[_router_from_ds(blocks, name) or name] = None
    return list(out)


def _router_from_ds(blocks: list[AutoEPBlock], key: str) -> str | None:
    for b in blocks:
        if key.startswith(f"{b.prefix}{_DS_ROUTER}"):
            return f"{b.prefix}{_OURS_ROUTER}{key[len(b.prefix + _DS_ROUTER):]}"
        if key == f"{b.prefix}router.{_BIAS}":
            return f"{b.prefix}{_OURS_ROUTER}{_BIAS}"
    return None


def is_alias(blocks: list[AutoEPBlock], key: str) -> bool:
    """DeepSpeed's alias of a block's router under the model's router name (the same tensor)."""
    return any(b.router_name != "router" and key.startswith(f"{b.prefix}{b.router_name}.gate.") for b in blocks)


def from_deepspeed(blocks: list[AutoEPBlock], tensors: dict[str, Any], where: str, local: bool = True) -> dict:
    """DeepSpeed's names in dslaunch's: routers renamed (DeepSpeed's alias dropped), each block's
    expert weights (a per-expert file's ``experts.w1.<E>``, an expert rank's ``experts.w1#ep<r>``,
    or a whole ``experts.w1``; the first kind found) whole over the block's ``num_experts`` and,
    with ``local``, cut to this rank's rows. Other entries pass unchanged.

    Raises:
        CheckpointLayoutError: a block's expert weights are missing or do not have its experts.
    """
    out: dict = {}
    pieces: dict[tuple[str, str], dict[str, dict[int, torch.Tensor]]] = {}
    prefixes = {b.prefix for b in blocks}
    for key, value in tensors.items():
        m = _DS_EXPERT.fullmatch(key)
        if m and m.group(1) in prefixes:
            kind, index = ("expert", m.group(3)) if m.group(3) is not None else \
                ("rank", m.group(4)) if m.group(4) is not None else ("whole", "0")
            pieces.setdefault((m.group(1), m.group(2)), {}).setdefault(kind, {})[int(index)] = value
        elif not is_alias(blocks, key):
            out[_router_from_ds(blocks, key) or key] = value
    for block in blocks:
        whole = {}
        for w in ("w1", "w2", "w3"):
            name = f"{block.prefix}experts.{w}"
            found = pieces.get((block.prefix, w), {})
            kind = next((k for k in ("expert", "rank", "whole") if k in found), None)
            if kind is None:
                if whole:
                    raise CheckpointLayoutError(f"{name} is missing", where)
                break
            whole[w] = _join(found[kind], name, where)
            if whole[w].shape[0] != block.num_experts:
                raise ExpertShapeError(f"{name} holds {whole[w].shape[0]} experts, the model's block "
                                       f"{block.num_experts} ({_local_counts(block, whole[w].shape[0])})", where)
        if not whole:
            continue
        lo, hi = (block.ep_rank * block.num_local, (block.ep_rank + 1) * block.num_local) if local \
            else (0, block.num_experts)
        mine = {k: v[lo:hi] for k, v in whole.items()}
        w1, w2, w3 = block.names
        out[f"{block.prefix}experts.{w2}"] = mine["w2"]
        if w3 is None:
            out[f"{block.prefix}experts.{w1}"] = torch.cat([mine["w1"], mine["w3"]], dim=1)
        else:
            out[f"{block.prefix}experts.{w1}"], out[f"{block.prefix}experts.{w3}"] = mine["w1"], mine["w3"]
    return out


def module_file(blocks: list[AutoEPBlock], sd: dict) -> OrderedDict:
    """The model-states file's ``module`` (``sd``: dslaunch's module state dict, this rank's rows):
    without expert weights, routers in DeepSpeed's names, each with its alias."""
    out: OrderedDict = OrderedDict()
    experts = expert_weight_names(blocks)
    for key, value in to_deepspeed(blocks, {k: v for k, v in sd.items() if k not in experts}).items():
        out[key] = value
        block = next((b for b in blocks if key.startswith(f"{b.prefix}{_DS_ROUTER}")), None)
        if block is not None and block.router_name != "router":
            out[f"{block.prefix}{block.router_name}.gate.{key[len(block.prefix + _DS_ROUTER):]}"] = value
    return out


def expert_files(blocks: list[AutoEPBlock], sd: dict, first_layer: int = 0) -> dict[str, dict]:
    """File name -> ``{<block>.experts.w<i>.<E>: [.., ..]}`` for each global expert this rank
    holds (``sd``: dslaunch's module state dict, this rank's rows)."""
    from dslaunch.runtime.checkpoint.deepspeed_experts import expert_file_name

    out: dict[str, dict] = {}
    for layer, block in enumerate(blocks, start=first_layer):
        split = _split(block, sd)
        for j in range(block.num_local):
            expert = block.ep_rank * block.num_local + j
            out[expert_file_name(layer, expert)] = {f"{k}.{expert}": v[j].detach().clone() for k, v in split.items()}
    return out


def metadata(blocks: list[AutoEPBlock], sd: dict, edp_rank: int, edp_size: int, first_layer: int = 0,
             shapes: dict | None = None, partitioned: bool = False) -> list[dict]:
    """``ds_autoep_layers`` as DeepSpeed's writing rank records it (``sd``: dslaunch's module
    state dict, this rank's rows; or ``shapes``: DeepSpeed's name of each expert weight -> this
    rank's shape). ``partitioned``: ZeRO-3's ``zero3_partitioned`` entries
    (``deepspeed_autoep_zero3``)."""
    from dslaunch.runtime.checkpoint import deepspeed_autoep_zero3 as zero3

    out = []
    for layer, block in enumerate(blocks, start=first_layer):
        local = {k: tuple(shapes[k]) for k in (f"{block.prefix}experts.{w}" for w in ("w1", "w2", "w3"))} \
            if shapes is not None else {k: tuple(v.shape) for k, v in _split(block, sd).items()}
        placement = {"version": 1, "num_experts": block.num_experts, "ep_size": block.ep_size,
                     "ranks": [{"rank": r, "experts": list(range(r * block.num_local, (r + 1) * block.num_local))}
                               for r in range(block.ep_size)]}
        maps = {}
        for w in ("w1", "w2", "w3"):
            shard = list(local[f"{block.prefix}experts.{w}"])
            rows = 1
            for d in shard[1:]:
                rows *= d
            strides = [rows, *[_stride(shard, i) for i in range(1, len(shard))]]
            maps[f"{block.prefix}experts.{w}"] = {
                "logical_shape": [block.num_experts, *shard[1:]],
                "ranks": {r: {"shard_shape": shard, "pieces": [{"shape": shard, "source": [r * block.num_local * rows,
                                                                                         strides],
                                                                 "dest": [0, strides], "locations": [r]}]}
                          for r in range(block.ep_size)}}
        out.append({"moe_layer_id": layer, "module_path": block.path, "num_experts": block.num_experts,
                    "num_local_experts": block.num_local, "ep_size": block.ep_size, "expert_placement": placement,
                    "affine_maps": {"version": 1, "params": maps}, "expert_key_prefix": f"{block.prefix}experts",
                    "checkpoint_format": zero3.FORMAT if partitioned else "per_expert_files",
                    "checkpoint_format_version": zero3.VERSION if partitioned else None,
                    "ep_group_name": f"ep_size_{block.ep_size}", "ep_rank": block.ep_rank,
                    "expert_data_parallel_rank": edp_rank, "expert_data_parallel_world_size": edp_size,
                    "global_expert_start": block.ep_rank * block.num_local,
                    "global_expert_end": (block.ep_rank + 1) * block.num_local})
    return out


def _stride(shape: list[int], dim: int) -> int:
    out = 1
    for d in shape[dim + 1:]:
        out *= d
    return out


def join_expert_ranks(state: Any) -> tuple[Any, dict[str, dict]]:
    """A DeepSpeed AutoEP tag as ``deepspeed_read`` gives it (``state``), each block's expert
    weights whole (``<block>.experts.w1 [num_experts, ...]``, the expert ranks' rows joined) for a
    universal checkpoint; and per such name the keys DeepSpeed's universal files carry beside the
    tensor (``cat_dim``, ``is_expert_param``, ``ep_num_experts``).

    Raises:
        CheckpointLayoutError: ``ds_autoep_layers`` is malformed, or the rows do not add up to a
            block's experts.
    """
    where = str(state.model_file)
    layers = state.states.get("ds_autoep_layers")
    check_metadata(layers, [], where)
    experts = {e["expert_key_prefix"]: e["num_experts"] for e in layers}

    def whole(named: dict) -> dict:
        out, pieces = {}, {}
        for key, value in named.items():
            base, sep, rank = key.partition(EP_SUFFIX)
            if sep:
                pieces.setdefault(base, {})[int(rank)] = value
            else:
                out[key] = value
        out.update({base: _join(parts, base, where) for base, parts in pieces.items()})
        return out

    fp32 = whole(state.fp32)
    optim: dict[str, dict] = {}
    for k in sorted({k for st in state.optim.values() for k in st}):
        for n, v in whole({n: st[k] for n, st in state.optim.items() if k in st}).items():
            optim.setdefault(n, {})[k] = v
    extras = {}
    for name, value in fp32.items():
        m = _DS_EXPERT.fullmatch(name)
        if m is None:
            continue
        want = experts.get(f"{m.group(1)}experts")
        if want != value.shape[0]:
            raise CheckpointLayoutError(f"{name} holds {value.shape[0]} experts, key 'ds_autoep_layers' says {want}",
                                        where)
        extras[name] = {"cat_dim": 0, "is_expert_param": True, "ep_num_experts": want}
    groups = [replace(g, names=list(dict.fromkeys(n.partition(EP_SUFFIX)[0] for n in g.names))) for g in state.groups]
    return replace(state, fp32=fp32, optim=optim, groups=groups), extras


def check_metadata(layers: Any, blocks: list[AutoEPBlock], where: str) -> None:
    """Validate a tag's ``ds_autoep_layers`` against the model's AutoEP blocks, as DeepSpeed's load
    does: a list of dicts with ``REQUIRED_FIELDS``, no layer id or prefix twice, ``num_experts =
    num_local_experts * ep_size``, each entry a block of the model with as many experts, under
    ``<module_path>.experts``. Another ``ep_size`` than the model's is fine (the experts are joined
    whole and cut again).

    Raises:
        CheckpointLayoutError: (a ``RuntimeError`` too) one line naming the file and the key.
    """
    key = "ds_autoep_layers"
    if not isinstance(layers, list):
        raise CheckpointLayoutError(f"key {key!r} is malformed: expected a list of layer entries, got "
                                    f"{type(layers).__name__}", where)
    seen: dict[str, set] = {"moe_layer_id": set(), "expert_key_prefix": set()}
    ours = {b.path: b for b in blocks}
    for i, entry in enumerate(layers):
        if not isinstance(entry, dict):
            raise CheckpointLayoutError(f"key {key!r} entry {i} is malformed: expected a dict, got "
                                        f"{type(entry).__name__}", where)
        missing = sorted(set(REQUIRED_FIELDS) - entry.keys())
        if missing:
            raise CheckpointLayoutError(f"key {key!r} entry {i} is invalid: missing fields {missing}", where)
        for field in seen:
            if entry[field] in seen[field]:
                raise CheckpointLayoutError(f"key {key!r} has duplicate {field}: {entry[field]!r}", where)
            seen[field].add(entry[field])
        ints = [entry[f] for f in ("num_experts", "num_local_experts", "ep_size")]
        if not all(isinstance(v, int) and v > 0 for v in ints) or ints[0] != ints[1] * ints[2]:
            raise CheckpointLayoutError(f"key {key!r} entry {i} is inconsistent: num_local_experts={ints[1]} x "
                                        f"ep_size={ints[2]} != num_experts={ints[0]}", where)
        _check_format(entry, i, where)
        if not blocks:
            continue  # no model to hold it against (a conversion)
        block = ours.get(entry["module_path"])
        if block is None:
            raise CheckpointLayoutError(f"key {key!r} names module_path {entry['module_path']!r}, which is not an "
                                        f"AutoEP block of this model (its blocks: {sorted(ours)})", where)
        if entry["num_experts"] != block.num_experts:
            raise ExpertShapeError(f"key {key!r}: {block.path} has {entry['num_experts']} experts in the "
                                   f"checkpoint, {block.num_experts} in the model ({_local_counts(block, entry['num_experts'])})",
                                   where)
        if entry["expert_key_prefix"] != f"{block.prefix}experts":
            raise CheckpointLayoutError(f"key {key!r}: {block.path} has expert_key_prefix "
                                        f"{entry['expert_key_prefix']!r}, expected '{block.prefix}experts'", where)
    if blocks and len(layers) != len(blocks):
        missing = sorted(set(ours) - {e["module_path"] for e in layers})
        raise CheckpointLayoutError(f"key {key!r} lacks the model's AutoEP blocks {missing}", where)


def _check_format(entry: dict, i: int, where: str) -> None:
    """An entry's ``checkpoint_format``: DeepSpeed's per-expert files (ZeRO 0-2), or its ZeRO-3
    ``zero3_partitioned`` layout at the version DeepSpeed 0.19.8 writes, with that layout's fields."""
    from dslaunch.runtime.checkpoint import deepspeed_autoep_zero3 as zero3

    key, form = "ds_autoep_layers", entry.get("checkpoint_format", "per_expert_files")
    if form == "per_expert_files":
        return
    if form != zero3.FORMAT:
        raise CheckpointLayoutError(f"key {key!r} entry {i} has checkpoint_format {form!r}: expected "
                                    f"'per_expert_files' or {zero3.FORMAT!r}", where)
    if entry.get("checkpoint_format_version") != zero3.VERSION:
        raise CheckpointLayoutError(f"key {key!r} entry {i} has checkpoint_format_version "
                                    f"{entry.get('checkpoint_format_version')!r}: DeepSpeed 0.19.8's "
                                    f"{zero3.FORMAT!r} layout is version {zero3.VERSION}", where)
    missing = sorted({"ep_rank", "expert_data_parallel_rank", "expert_data_parallel_world_size",
                      "global_expert_start", "global_expert_end"} - entry.keys())
    if missing:
        raise CheckpointLayoutError(f"key {key!r} entry {i} ({zero3.FORMAT}) is invalid: missing fields {missing}",
                                    where)
