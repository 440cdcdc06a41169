"""What each rank reads of a tag for ``load_checkpoint``: its own shard at the saving layout, the
saved shards its new range overlaps at another one (``reshard``), experts by global name when the
expert-parallel layout changed (``experts``), or a model-parallel engine's parts (``model_parallel``).

Every rank reads its part; a rank that fails makes every rank raise the same error
(``collective_read``), so no rank goes on alone.
"""

from __future__ import annotations

from typing import Any

from dslaunch.errors import CheckpointError
from dslaunch.runtime.checkpoint.checkpointer import MODULE_FILE, Checkpointer, rank_file, zero_file
from dslaunch.runtime.checkpoint.experts import assemble_experts, expert_sources, unchanged
from dslaunch.runtime.checkpoint.model_parallel import Placement, read_parts
from dslaunch.runtime.checkpoint.reshard import (
    assemble,
    check_compatible,
    check_meta,
    expert_groups,
    fp32_params,
    needed_ranks,
)
from dslaunch.runtime.checkpoint.store import MANIFEST, CheckpointStore, Manifest

__all__ = ["collective_read", "read_plan", "zero_sources", "targets"]


def targets(current: dict) -> list[tuple[int, int]]:
    return [(int(g["start"]), int(g["end"])) for g in current["groups"]]


def zero_sources(manifest: Manifest, current: dict, rank: int) -> list[int]:
    """Saved ranks whose ZeRO shards this rank must read."""
    meta = manifest.meta
    pmap = meta["partition"]
    same_layout = meta["world_size"] == current["world_size"] and pmap["stage"] == current["stage"]
    if same_layout and zero_file(rank) in manifest.files:
        return [rank]  # the fast path: this rank's own shard, nothing to cut
    refuse_experts(pmap, f"{zero_file(rank)} is missing" if same_layout else
                    f"now world size {current['world_size']}, ZeRO stage {current['stage']}", manifest.meta)
    return needed_ranks(pmap, targets(current))


def refuse_experts(pmap: dict, now: str, meta: dict) -> None:
    """Expert shards load only where they were saved: another layout would mix experts."""
    experts = expert_groups(pmap)
    if experts:
        raise CheckpointError(f"the checkpoint holds expert parameters ({experts[0]}) saved at world size "
                              f"{meta['world_size']}, ZeRO stage {pmap['stage']}; each rank loads only its own "
                              f"shard file at that layout ({now})")


def read_plan(store: CheckpointStore, tag: str, rank: int, current: dict, place: Placement | None,
               live_keys: set[str], live: dict[int, list[str]]) -> dict:
    """Read and verify every file this rank needs from ``tag`` (raises CheckpointError).

    A checkpoint of a different model is not an error here (that would make the loader fall
    back to an older tag): it is reported as ``incompatible`` and the ZeRO shards are skipped.
    """
    manifest = store.manifest(tag)
    check_meta(manifest.meta, str(store.root / tag / MANIFEST))
    src = rank if rank < manifest.meta["world_size"] else 0
    head = {"manifest": manifest, "rank": store.read(tag, rank_file(src), manifest), "rank_src": src}
    if place is not None or "model_parallel" in manifest.meta:
        return {**head, **read_parts(store, tag, manifest, current, place, live_keys, str(store.root / tag), live)}
    out: dict[str, Any] = {**head, "module": store.read(tag, MODULE_FILE, manifest)["module"], "incompatible": None}
    pmap, meta = manifest.meta["partition"], manifest.meta
    if "experts" in meta and not unchanged(meta, current, live, rank):  # experts move: by global name
        ranks = expert_sources(meta, current, live, rank, str(store.root / tag))
        out["zero"] = assemble_experts(lambda r: store.read(tag, zero_file(r), manifest), ranks, meta, current, live)
        return out
    try:
        check_compatible(pmap, current, str(store.root / tag))
    except CheckpointError as exc:  # keep what can be matched by name: the fp32 weights
        refuse_experts(pmap, "this model's param groups differ", manifest.meta)
        out["incompatible"] = exc
        full = [(0, int(g["numel"])) for g in pmap["groups"]]
        shards = [store.read(tag, zero_file(r), manifest) for r in needed_ranks(pmap, full)]
        out["fp32"] = fp32_params(assemble(shards, full))
        return out
    shards = [store.read(tag, zero_file(r), manifest) for r in zero_sources(manifest, current, rank)]
    out["zero"] = assemble(shards, targets(current))
    return out


def collective_read(ck: Checkpointer, store: CheckpointStore, tag: str, current: dict,
                     place: Placement | None, live_keys: set[str], live: dict[int, list[str]]) -> dict:
    """Every rank reads its part; if any rank fails, all raise the same error."""
    got, err = None, None
    try:
        got = read_plan(store, tag, ck.comm.rank, current, place, live_keys, live)
    except CheckpointError as exc:
        err = str(exc)
    errors = [f"rank {r}: {e}" if ck.comm.world_size > 1 else e
              for r, e in enumerate(ck.comm.all_gather_object(err)) if e]
    if errors:
        raise CheckpointError("; ".join(errors))
    return got
