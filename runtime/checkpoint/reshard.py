"""Resharding ZeRO state between world sizes and stages, and fp32 export.

Owns the pure functions on the strategy state format of the contract (see
``dslaunch.runtime.zero.strategy.ZeroStrategy.state_dict``): which saved shards a rank needs for its
new range (``needed_ranks``), cutting and concatenating shards into any [start, end) of each
group (``assemble``; [0, numel) is the consolidated state), and the per-parameter fp32 tensors
of consolidated groups (``fp32_params``). Nothing here touches files or ranks; the partition map
of a checkpoint (``partition_map``) is what the manifest records.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from typing import Any

import torch

from dslaunch.errors import CheckpointError

__all__ = ["partition_map", "check_meta", "partition_problem", "needed_ranks", "assemble", "fp32_params",
           "by_name", "group_by_name", "by_slices", "join_slices", "cut_slice", "check_compatible"]

Range = tuple[int, int]


def partition_map(shards: list[dict]) -> dict[str, Any]:
    """What the manifest records about ZeRO state: stage, world size, each group's layout and
    the [start, end) each saved rank holds (``shards``: the state dicts of the saving ranks)."""
    first = shards[0]
    groups = []
    for gi, g in enumerate(first["groups"]):
        groups.append({"names": list(g["names"]), "shapes": [list(s) for s in g["shapes"]],
                       "numel": int(g["numel"]),
                       "ranges": {str(sd["rank"]): [int(sd["groups"][gi]["start"]),
                                                    int(sd["groups"][gi]["end"])] for sd in shards},
                       **({"reduce_group": g["reduce_group"]} if "reduce_group" in g else {})})
    return {"stage": int(first["stage"]), "world_size": int(first["world_size"]), "groups": groups}


def check_meta(meta: dict[str, Any], source: str) -> None:
    """Raise CheckpointError unless a manifest's ``meta`` is an engine checkpoint's, as this
    version writes it (a tag written by another tool has a valid manifest but not this)."""
    problem = _meta_problem(meta)
    if problem:
        raise CheckpointError(f"not an engine checkpoint this dslaunch version reads: {problem}", source)


def _count(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def _group_ok(g: Any) -> bool:
    if not (isinstance(g, dict) and isinstance(g.get("names"), list) and isinstance(g.get("shapes"), list)
            and len(g["names"]) == len(g["shapes"]) and _count(g.get("numel"))
            and isinstance(g.get("ranges"), dict) and g["ranges"]):
        return False
    shapes_ok = all(isinstance(s, list) and all(_count(d) for d in s) for s in g["shapes"])
    ranges_ok = all(str(r).isdigit() and isinstance(v, list) and len(v) == 2 and all(_count(x) for x in v)
                    and v[0] <= v[1] <= g["numel"] for r, v in g["ranges"].items())
    return shapes_ok and ranges_ok


def _meta_problem(meta: dict[str, Any]) -> str | None:
    for key in ("world_size", "zero_stage"):
        if key not in meta:
            return f"meta {key!r} is missing"
        if not _count(meta[key]):
            return f"meta {key!r} is {str(meta[key])[:40]!r}, expected a whole number"
    if "model_parallel" in meta:  # one partition per part
        from dslaunch.runtime.checkpoint.model_parallel import check_parts_meta

        problem = check_parts_meta(meta)
        if problem:
            return problem
    else:
        problem = partition_problem(meta.get("partition"))
        if problem:
            return f"meta 'partition' {problem}"
    if "experts" in meta:
        from dslaunch.runtime.checkpoint.experts import experts_problem

        if problem := experts_problem(meta["experts"]):
            return f"meta 'experts' {problem}"
    for key in ("module_keys", "frozen_parameters"):
        if key in meta and not (isinstance(meta[key], list) and all(isinstance(k, str) for k in meta[key])):
            return f"meta {key!r} is not a list of names"
    shared = meta.get("shared_params", {})
    if not (isinstance(shared, dict) and all(isinstance(v, str) for v in shared.values())):
        return "meta 'shared_params' is not a map of names"
    return None


def partition_problem(pmap: Any) -> str | None:
    """What is wrong with a partition map read from a manifest, or None."""
    if not (isinstance(pmap, dict) and _count(pmap.get("stage")) and isinstance(pmap.get("groups"), list)):
        return "is missing or malformed"
    bad = next((gi for gi, g in enumerate(pmap["groups"]) if not _group_ok(g)), None)
    return f"group {bad} is malformed" if bad is not None else None


def needed_ranks(pmap: dict[str, Any], targets: list[Range]) -> list[int]:
    """Saved ranks whose shards intersect the target range of any group (sorted)."""
    need: set[int] = set()
    for g, (a, b) in zip(pmap["groups"], targets, strict=True):
        for rank, (s, e) in g["ranges"].items():
            if s < b and a < e:
                need.add(int(rank))
    if not need:  # every target is empty: one shard still supplies the scalars and hparams
        # (no groups at all: an engine without an optimizer, whose rank 0 saved the only shard)
        need.add(min(int(r) for r in pmap["groups"][0]["ranges"]) if pmap["groups"] else 0)
    return sorted(need)


def _cut(pieces: list[tuple[int, int, torch.Tensor]], a: int, b: int, what: str) -> torch.Tensor:
    """Concatenate the parts of ``pieces`` ((start, end, tensor) of a flat vector) within [a, b)."""
    out, pos = [], a
    for s, e, t in sorted(pieces, key=lambda p: p[0]):
        if e <= pos or s >= b:
            continue
        if s > pos:
            raise CheckpointError(f"the saved shards of {what} do not cover elements [{pos}, {s})")
        hi = min(e, b)
        out.append(t[pos - s:hi - s])
        pos = hi
        if pos >= b:
            break
    if pos < b:
        raise CheckpointError(f"the saved shards of {what} do not cover elements [{pos}, {b})")
    if len(out) == 1:
        return out[0]
    return torch.cat(out) if out else torch.empty(0, dtype=pieces[0][2].dtype if pieces else torch.float32)


def assemble(shards: list[dict], targets: list[Range]) -> dict:
    """Build one state dict whose group ``i`` holds exactly ``targets[i]`` = [start, end).

    Args:
        shards: saved strategy state dicts (any subset that covers the targets).
        targets: per group, the range wanted ([0, numel) to consolidate).
    Returns:
        A state dict in the contract's format that ``strategy.load_state_dict`` accepts.
    Raises:
        CheckpointError: the shards disagree on the layout or do not cover a target.
    """
    first = shards[0]
    groups = []
    for gi, (a, b) in enumerate(targets):
        parts = [sd["groups"][gi] for sd in shards]
        base = parts[0]
        live = [p for p in parts if p["end"] > p["start"]] or [base]
        what = f"param group {gi}"
        master = _cut([(p["start"], p["end"], p["master"]) for p in parts], a, b, what)
        keys = sorted({k for p in live for k in p["optim_state"]})
        optim_state = {k: _cut([(p["start"], p["end"], p["optim_state"][k]) for p in live
                                if k in p["optim_state"]], a, b, f"{what} optimizer state {k!r}")
                       for k in keys}
        groups.append({"names": list(base["names"]), "shapes": [tuple(s) for s in base["shapes"]],
                       "numel": int(base["numel"]), "start": a, "end": b, "master": master,
                       "optim_state": optim_state, "optim_scalars": dict(live[0]["optim_scalars"]),
                       "hparams": dict(base["hparams"])})
    return {"stage": first["stage"], "world_size": first["world_size"], "rank": first["rank"],
            "groups": groups}


def fp32_params(consolidated: dict) -> OrderedDict[str, torch.Tensor]:
    """Per-parameter fp32 master weights (name -> tensor of the parameter's shape)."""
    out: OrderedDict[str, torch.Tensor] = OrderedDict()
    for g in consolidated["groups"]:
        if g["start"] != 0 or g["end"] != g["numel"]:
            raise ValueError("fp32_params needs consolidated groups (start=0, end=numel)")
        offset = 0
        for name, shape in zip(g["names"], g["shapes"], strict=True):
            n = math.prod(shape)
            out[name] = g["master"][offset:offset + n].view(tuple(shape)).clone()
            offset += n
    return out


def by_name(saved: list[dict], current: dict) -> dict:
    """The live strategy's state (each group's [start, end)) built from consolidated states of
    another layout (other pipeline stages), matching parameters by name within each group index.

    Exact for the element-wise optimizers the flat groups allow: each parameter's master and
    optimizer state move as they are. Scalars and hparams come from the part holding the group's
    first parameter (every part of one model stepped together).

    Raises:
        CheckpointError: a live parameter is in no saved part or has another shape there, or the
            parts holding one group disagree on which optimizer state they keep.
    """
    groups = [group_by_name(gi, live, _locate(saved, gi)) for gi, live in enumerate(current["groups"])]
    return {"stage": current["stage"], "world_size": current["world_size"], "rank": current["rank"], "groups": groups}


_Where = dict[str, tuple[dict, int, tuple]]


def _locate(saved: list[dict], gi: int) -> _Where:
    """Group ``gi``'s parameters in the saved states: name -> (saved group, offset, shape)."""
    where: _Where = {}
    for sd in saved:
        if gi < len(sd["groups"]):
            g, offset = sd["groups"][gi], 0
            for name, shape in zip(g["names"], g["shapes"], strict=True):
                where.setdefault(name, (g, offset, tuple(shape)))
                offset += math.prod(shape)
    return where


def group_by_name(gi: int, live: dict, where: _Where) -> dict:
    """Live group ``gi``'s [start, end) of master and optimizer state, each parameter taken by name
    from ``where`` (name -> (consolidated saved group, offset, shape)).

    Raises:
        CheckpointError: a parameter is missing or has another shape, or the groups holding them
            keep different optimizer state.
    """
    missing = [n for n in live["names"] if n not in where]
    if missing:
        raise CheckpointError(f"param group {gi}: parameters {missing[:3]} are in no part of the checkpoint")
    for name, shape in zip(live["names"], live["shapes"], strict=True):
        if where[name][2] != tuple(shape):
            raise CheckpointError(f"{name!r} has shape {where[name][2]} in the checkpoint, {tuple(shape)} in the model")
    used = [where[n] for n in live["names"]]
    keys = {tuple(sorted(g["optim_state"])) for g, _, _ in used}
    if len(keys) > 1:
        raise CheckpointError(f"param group {gi}: the saved parts keep different optimizer state {sorted(keys)}")
    a, b = live["start"], live["end"]

    def gather(tensors: list[torch.Tensor]) -> torch.Tensor:
        pieces = [t[off:off + math.prod(shape)] for t, (_, off, shape) in zip(tensors, used, strict=True)]
        return torch.cat(pieces)[a:b] if pieces else torch.empty(0)

    first = used[0][0] if used else {}
    return {"names": list(live["names"]), "shapes": [tuple(s) for s in live["shapes"]], "numel": int(live["numel"]),
            "start": a, "end": b, "master": gather([g["master"] for g, _, _ in used]),
            "optim_state": {k: gather([g["optim_state"][k] for g, _, _ in used]) for k in (keys.pop() if keys else ())},
            "optim_scalars": dict(first.get("optim_scalars", {})), "hparams": dict(first.get("hparams", live["hparams"]))}


def check_compatible(pmap: dict[str, Any], current: dict, source: str) -> None:
    """Raise CheckpointError unless the saved groups hold the same params as the live strategy.

    Args:
        pmap: the checkpoint's partition map; ``current``: the live ``strategy.state_dict()``.
        source: the manifest path, named in the message.
    """
    saved, live = pmap["groups"], current["groups"]
    if len(saved) != len(live):
        raise CheckpointError(f"the checkpoint has {len(saved)} optimizer param groups, this "
                              f"engine has {len(live)}", source)
    for gi, (s, g) in enumerate(zip(saved, live, strict=True)):
        if list(s["names"]) != list(g["names"]) or [tuple(x) for x in s["shapes"]] != \
                [tuple(x) for x in g["shapes"]]:
            diff = _first_difference(s, g)
            raise CheckpointError(f"param group {gi} differs from the model: {diff}", source)


def _first_difference(saved: dict, live: dict) -> str:
    sn, ln = list(saved["names"]), list(live["names"])
    for i, (a, b) in enumerate(zip(sn, ln, strict=False)):
        if a != b:
            return f"parameter #{i} is {a!r} in the checkpoint, {b!r} in the model"
        if tuple(saved["shapes"][i]) != tuple(live["shapes"][i]):
            return f"{a!r} has shape {tuple(saved['shapes'][i])} in the checkpoint, " \
                   f"{tuple(live['shapes'][i])} in the model"
    extra = sn[len(ln):] or ln[len(sn):]
    where = "checkpoint" if len(sn) > len(ln) else "model"
    return f"only the {where} has {extra[:3]}"


def expert_groups(pmap: dict[str, Any]) -> list[str]:
    """The expert group names of a partition map's param groups (their values differ by expert
    rank: each rank's own shard file holds its experts)."""
    return [g["reduce_group"] for g in pmap["groups"] if "reduce_group" in g]


def join_slices(pieces: list[torch.Tensor], layouts: list[dict], name: str) -> torch.Tensor:
    """One parameter's tensor put together from every tensor slice's piece (slice order)."""
    dim, full = layouts[0][name][0], layouts[0][name][2]
    shape = list(pieces[0].shape)
    shape[dim] = full
    whole = pieces[0].new_empty(shape)
    for piece, layout in zip(pieces, layouts, strict=True):
        at = 0
        for a, b in layout[name][1]:
            whole.narrow(dim, a, b - a).copy_(piece.narrow(dim, at, b - a))
            at += b - a
    return whole


def cut_slice(whole: torch.Tensor, entry: list) -> torch.Tensor:
    """A rank's slice of a whole tensor (``entry``: its ``[dim, segments, ...]`` record)."""
    dim, segments = entry[0], entry[1]
    return torch.cat([whole.narrow(dim, a, b - a) for a, b in segments], dim=dim)


def by_slices(saved: list[dict], layouts: list[dict], mine: dict) -> dict:
    """One consolidated state holding this rank's tensor slices, from the consolidated states of
    every tensor slice of a tag saved at another tensor-parallel degree (for ``by_name``).

    Args:
        saved: each saved slice's consolidated strategy state, in slice order.
        layouts: each saved slice's ``name -> [dim, segments, whole size, ...]`` (AutoTP's record).
        mine: the same for this rank; a parameter in neither layout is whole on every slice.

    Exact for the element-wise optimizers of the flat groups: masters and optimizer state are cut
    and joined as the weights are.
    """
    groups = []
    for gi, base in enumerate(saved[0]["groups"]):
        parts = [sd["groups"][gi] for sd in saved]
        keys = sorted(base["optim_state"])
        pieces: dict[str, list[torch.Tensor]] = {}  # per name, per tensor kind: my slice
        shapes = []
        for name in base["names"]:
            per_part = []
            for g in parts:
                i = g["names"].index(name)
                offset = sum(math.prod(s) for s in g["shapes"][:i])
                shape = tuple(g["shapes"][i])
                per_part.append([t[offset:offset + math.prod(shape)].view(shape)
                                 for t in (g["master"], *(g["optim_state"][k] for k in keys))])
            kinds = []
            for k in range(1 + len(keys)):
                whole = join_slices([p[k] for p in per_part], layouts, name) if name in layouts[0] else per_part[0][k]
                if name in mine:
                    whole = cut_slice(whole, mine[name])
                kinds.append(whole.reshape(-1))
            shapes.append(tuple(whole.shape))
            for k, t in enumerate(kinds):
                pieces.setdefault(str(k), []).append(t)
        flat = {k: torch.cat(v) if v else torch.empty(0) for k, v in pieces.items()}
        numel = sum(math.prod(s) for s in shapes)
        groups.append({"names": list(base["names"]), "shapes": shapes, "numel": numel, "start": 0, "end": numel,
                       "master": flat.get("0", torch.empty(0)),
                       "optim_state": {key: flat[str(k + 1)] for k, key in enumerate(keys)},
                       "optim_scalars": dict(base["optim_scalars"]), "hparams": dict(base["hparams"])})
    return {"stage": saved[0]["stage"], "world_size": saved[0]["world_size"], "rank": 0, "groups": groups}
