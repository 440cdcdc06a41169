"""Expert parameters in checkpoints: which global expert each rank's local copy is, and moving
experts' ZeRO state to another expert-parallel layout on load.

A rank of an ``MoE`` layer at expert-parallel size ``ep`` holds ``num_experts / ep`` local experts,
``...deepspeed_moe.experts.deepspeed_experts.<j>...``; local expert ``j`` of expert rank ``r`` is
global expert ``r * num_local_experts + j`` (DeepSpeed's numbering, which its checkpoint keys use).
A save records, for every rank and expert param group, the global names of the group's parameters
(``meta["experts"]``); a load at another layout (expert-parallel size, world size or ZeRO stage)
reads, for each global expert it now holds, the shards of one expert-data group that saved it,
puts each parameter's fp32 master and optimizer state together by global name and cuts this
rank's range (``reshard.group_by_name``): exact, since the optimizers are element-wise. Dense
groups are resharded as without experts (``reshard.assemble``). An AutoEP block's fused expert
weight holds several global experts, one per row: each row is named for its expert
(``expert_rows``), so the same by-name assembly places them at another ``autoep_size``. Expert
entries no optimizer holds (frozen parameters, buffers) go into the module file under their global
names, every rank's (``every_untrained``); a load takes those it holds now (``own_untrained``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from dslaunch.errors import CheckpointError
from dslaunch.runtime.checkpoint.reshard import assemble, check_compatible, group_by_name

__all__ = ["EXPERT_PREFIX", "ep_rank", "expert_names", "expert_rows", "row_shapes", "expert_record", "live_experts",
           "experts_problem", "unchanged", "every_untrained", "own_untrained", "expert_sources", "assemble_experts", "whole_experts"]

EXPERT_PREFIX = "deepspeed_moe.experts.deepspeed_experts."


def ep_rank(layer: Any) -> int:
    """This rank's index in the layer's expert group (0 without expert parallelism)."""
    group = getattr(layer, "ep_group", None)
    if getattr(layer, "ep_size", 1) == 1 or group is None:
        return 0
    import torch.distributed as dist

    return dist.get_rank(group=group)


def expert_names(module: torch.nn.Module, names: Iterable[str] | None = None) -> dict[str, str]:
    """Local expert parameter name -> its global name (the local index replaced by the global one),
    for every parameter (or, given ``names``, every state-dict entry named) under an MoE layer's
    ``deepspeed_moe.experts.deepspeed_experts``."""
    out: dict[str, str] = {}
    for name in (n for n, _ in module.named_parameters()) if names is None else names:
        head, sep, tail = name.partition(EXPERT_PREFIX)
        if not sep:
            continue
        layer = getattr(module.get_submodule(head.rstrip(".")) if head else module, "deepspeed_moe", None)
        local, _, rest = tail.partition(".")
        if layer is None or not local.isdigit() or not hasattr(layer, "num_local_experts"):
            continue  # not DeepSpeed's MoE layer: no global number (the tag records no experts)
        out[name] = f"{head}{sep}{ep_rank(layer) * layer.num_local_experts + int(local)}.{rest}"
    return out


def every_untrained(comm: Any, module: torch.nn.Module, sd: dict, trained: set[str]
                    ) -> tuple[dict, list[str], list[str]]:
    """``sd`` with the ``deepspeed.moe`` experts' entries no optimizer holds (frozen parameters,
    buffers) under their global names, every rank's: one rank writes the module file, and each
    rank's experts differ. Also the global names put in, and those of them that are frozen
    parameters (``sd`` unchanged and empty lists without any). collective: every rank (the same
    model on each).
    """
    rename = {k: g for k, g in expert_names(module, list(sd)).items() if k not in trained}
    if not rename:
        return sd, [], []
    params = {n for n, _ in module.named_parameters()}
    mine = {g: (sd[k].detach().cpu(), k in params) for k, g in rename.items()}
    out = type(sd)((k, v) for k, v in sd.items() if k not in rename)
    saved: set[str] = set()
    frozen: set[str] = set()
    for theirs in comm.all_gather_object(mine):
        for g, (value, is_param) in theirs.items():
            out[g] = value
            saved.add(g)
            frozen |= {g} if is_param else set()
    return out, sorted(saved), sorted(frozen)


def own_untrained(module: torch.nn.Module, sd: dict, saved: list[str]) -> dict:
    """The module file's ``saved`` global expert entries (``every_untrained``) this rank holds,
    under their local names; the other ranks' dropped. Local."""
    local = [n for n, _ in module.named_parameters()] + [n for n, _ in module.named_buffers()]
    to_local = {g: n for n, g in expert_names(module, local).items()}
    saved_set = set(saved)
    return {to_local.get(k, k): v for k, v in sd.items() if k not in saved_set or k in to_local}


def expert_rows(module: torch.nn.Module) -> dict[str, list[str]]:
    """Each expert parameter's global names: one for a ``deepspeed.moe`` expert's parameter
    (``expert_names``); one per row for an AutoEP block's fused weight, whose rows are global
    experts ``ep_rank * n ... + n - 1``: ``<block>.experts.<w>[<global expert>]``. A fused weight's
    rows lie one after another in its group, so a row is a parameter of its own to resharding."""
    from dslaunch.runtime.moe.autoep import AutoEPMoE

    out = {local: [name] for local, name in expert_names(module).items()}
    for prefix, layer in module.named_modules():
        if isinstance(layer, AutoEPMoE):
            first = layer.ep_rank * layer.num_local_experts
            for w, _ in layer.experts.named_parameters():
                head = f"{prefix}.experts.{w}" if prefix else f"experts.{w}"
                out[head] = [f"{head}[{first + j}]" for j in range(layer.num_local_experts)]
    return out


def row_shapes(names: list[str], shapes: list) -> list[tuple[int, ...]]:
    """The shapes of ``names`` (``expert_rows``' names of a group) from the group's parameter
    ``shapes``: a fused weight's rows each have its shape less the first dimension."""
    out: list[tuple[int, ...]] = []
    for shape in shapes:
        shape = tuple(shape)
        row = names[len(out)].endswith("]")
        out += [shape[1:]] * shape[0] if row else [shape]
    return out


def _stack_rows(masters: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Rows named ``<weight>[<expert>]`` stacked back into ``<weight>`` in expert order."""
    rows: dict[str, dict[int, torch.Tensor]] = {}
    out = {}
    for name, value in masters.items():
        head, sep, index = name.rpartition("[")
        if sep and index.endswith("]") and index[:-1].isdigit():
            rows.setdefault(head, {})[int(index[:-1])] = value
        else:
            out[name] = value
    out.update({head: torch.stack([got[e] for e in sorted(got)]) for head, got in rows.items()})
    return out


def live_experts(module: torch.nn.Module, current: dict) -> dict[int, list[str]]:
    """Per expert param group of the live strategy state (``reduce_group`` set), the global names of
    its parameters (``expert_rows``), in the group's order."""
    names = expert_rows(module)
    return {gi: [gn for n in g["names"] for gn in names.get(n, [n])] for gi, g in enumerate(current["groups"])
            if "reduce_group" in g}


def expert_record(comm: Any, module: torch.nn.Module, zero_sd: dict) -> dict[str, dict[str, list[str]]] | None:
    """``meta["experts"]``: saved rank -> expert group index -> its params' global names; None when
    a parameter marked as an expert's is not in an MoE layer's experts (marked by hand: which
    global expert it is cannot be told, and the tag then loads only at its saving layout).

    collective: call on all ranks.
    """
    rename = expert_rows(module)
    mine = {str(gi): [gn for n in g["names"] for gn in rename.get(n, [n])] for gi, g in enumerate(zero_sd["groups"])
            if "reduce_group" in g}
    known = all(n in rename for g in zero_sd["groups"] if "reduce_group" in g for n in g["names"])
    gathered = comm.all_gather_object(mine if known else None)
    if any(got is None for got in gathered):
        return None
    return {str(r): got for r, got in enumerate(gathered)}


def experts_problem(record: Any) -> str | None:
    """What is wrong with a manifest's ``experts`` record, or None."""
    if not isinstance(record, dict) or not record:
        return "is not a map of ranks"
    for rank, groups in record.items():
        if not (str(rank).isdigit() and isinstance(groups, dict)
                and all(str(gi).isdigit() and isinstance(ns, list) and all(isinstance(n, str) for n in ns)
                        for gi, ns in groups.items())):
            return f"rank {str(rank)[:20]!r} is malformed"
    return None


def unchanged(meta: dict, current: dict, live: dict[int, list[str]], rank: int) -> bool:
    """This rank saved exactly the experts and ranges it holds now (its own shard file serves)."""
    saved = meta["experts"].get(str(rank))
    return (meta["world_size"] == current["world_size"] and meta["partition"]["stage"] == current["stage"]
            and saved == {str(gi): names for gi, names in live.items()})


def _split(groups: list[dict]) -> tuple[list[int], list[int]]:
    dense = [gi for gi, g in enumerate(groups) if "reduce_group" not in g]
    return dense, [gi for gi, g in enumerate(groups) if "reduce_group" in g]


def _cover(ranges: dict[str, list[int]], lo: int, hi: int, ranks: list[int], prefer: int, what: str) -> set[int]:
    """Fewest of ``ranks`` whose saved ranges cover [lo, hi) (greedy; ``prefer`` wins ties)."""
    chosen: set[int] = set()
    pos = lo
    while pos < hi:
        best = max(((ranges[str(r)][1], r == prefer, r) for r in ranks
                    if ranges[str(r)][0] <= pos < ranges[str(r)][1]), default=None)
        if best is None:
            raise CheckpointError(f"the saved shards of {what} do not cover elements [{pos}, {hi})")
        chosen.add(best[2])
        pos = best[0]
    return chosen


def _holders(meta: dict) -> dict[tuple[int, tuple[str, ...]], list[int]]:
    """(saved group, its params' global names) -> the saved ranks holding that group: one
    expert-data group each (their ranges split it, or each holds it whole)."""
    out: dict[tuple[int, tuple[str, ...]], list[int]] = {}
    for rank, groups in sorted(meta["experts"].items(), key=lambda kv: int(kv[0])):
        for gi, names in groups.items():
            out.setdefault((int(gi), tuple(names)), []).append(int(rank))
    return out


def _check_dense(meta: dict, current: dict, source: str) -> tuple[list[int], list[int]]:
    pmap = meta["partition"]
    saved, live = _split(pmap["groups"])[0], _split(current["groups"])[0]
    check_compatible({"groups": [pmap["groups"][i] for i in saved]},
                     {"groups": [current["groups"][i] for i in live]}, source)
    return saved, live


def expert_sources(meta: dict, current: dict, live: dict[int, list[str]], rank: int, source: str) -> list[int]:
    """The saved ranks whose ZeRO shards this rank reads to take its dense ranges and its experts.

    Raises:
        CheckpointError: the dense param groups differ from the model's, or a global expert this
            rank holds now is in no saved group.
    """
    pmap = meta["partition"]
    saved_dense, live_dense = _check_dense(meta, current, source)
    everyone = sorted(int(r) for r in pmap["groups"][saved_dense[0]]["ranges"]) if saved_dense else []
    need: set[int] = set()
    for s, g in zip(saved_dense, (current["groups"][i] for i in live_dense), strict=True):
        if g["end"] > g["start"]:
            need |= _cover(pmap["groups"][s]["ranges"], g["start"], g["end"], everyone, rank, f"param group {s}")
    wanted = {n for names in live.values() for n in names}
    found: set[str] = set()
    for (gi, names), ranks in _holders(meta).items():
        if wanted & set(names) and not found >= set(names):
            need |= _cover(pmap["groups"][gi]["ranges"], 0, pmap["groups"][gi]["numel"], ranks, rank,
                           f"expert param group {gi}")
            found |= set(names)
    if missing := sorted(wanted - found):
        raise CheckpointError(f"expert parameters {missing[:3]} are in no saved shard (the checkpoint "
                              "has another number of experts?)", source)
    return sorted(need) or [min(int(r) for r in meta["experts"])]


def assemble_experts(read: Callable[[int], dict], ranks: list[int], meta: dict, current: dict,
                     live: dict[int, list[str]]) -> dict:
    """The live strategy state (each group's [start, end)) from the saved shards of ``ranks``
    (``read(rank)``: that rank's strategy state dict): dense groups cut as ``reshard.assemble``,
    expert groups put together by global name.

    Raises:
        CheckpointError: a parameter is missing or has another shape in the checkpoint.
    """
    shards = {r: read(r) for r in ranks}
    saved_dense, live_dense = _split(meta["partition"]["groups"])[0], _split(current["groups"])[0]
    out: list[dict | None] = [None] * len(current["groups"])
    if live_dense:
        dense = assemble([{**sd, "groups": [sd["groups"][i] for i in saved_dense]} for sd in shards.values()],
                         [(current["groups"][i]["start"], current["groups"][i]["end"]) for i in live_dense])
        for i, g in zip(live_dense, dense["groups"], strict=True):
            out[i] = g
    where: dict[str, tuple[dict, int, tuple]] = {}
    for (gi, names), holders in _holders(meta).items():
        have = [shards[r] for r in holders if r in shards]
        if not have or any(n in where for n in names):
            continue
        whole = assemble([{**sd, "groups": [sd["groups"][gi]]} for sd in have],
                         [(0, int(meta["partition"]["groups"][gi]["numel"]))])["groups"][0]
        offset = 0
        for name, shape in zip(names, row_shapes(list(names), whole["shapes"]), strict=True):
            where[name] = (whole, offset, tuple(shape))
            offset += int(torch.Size(shape).numel())
    for gi, names in live.items():
        mine = current["groups"][gi]
        got = group_by_name(gi, {**mine, "names": names, "shapes": row_shapes(names, mine["shapes"])}, where)
        hparams = {**got["hparams"], **({"name": mine["hparams"]["name"]} if "name" in mine["hparams"] else {})}
        out[gi] = {**got, "names": list(mine["names"]), "shapes": [tuple(x) for x in mine["shapes"]],
                   "hparams": hparams, "reduce_group": mine["reduce_group"]}
    return {"stage": current["stage"], "world_size": current["world_size"], "rank": current["rank"],
            "groups": out}


def whole_experts(read: Callable[[int], dict], meta: dict) -> dict[str, torch.Tensor]:
    """Every global expert's fp32 master (global name -> tensor of its shape), from the shards of
    one expert-data group per expert rank (``read(rank)``: that rank's strategy state)."""
    pmap, out = meta["partition"], {}
    for (gi, names), ranks in _holders(meta).items():
        g = pmap["groups"][gi]
        have = [read(r) for r in sorted(_cover(g["ranges"], 0, g["numel"], ranks, ranks[0], f"expert param group {gi}"))]
        whole = assemble([{**sd, "groups": [sd["groups"][gi]]} for sd in have], [(0, int(g["numel"]))])["groups"][0]
        offset = 0
        for name, shape in zip(names, row_shapes(list(names), whole["shapes"]), strict=True):
            n = int(torch.Size(shape).numel())
            out[name] = whole["master"][offset:offset + n].view(tuple(shape)).clone()
            offset += n
    return _stack_rows(out)
