"""``engine.save_checkpoint`` / ``load_checkpoint`` / ``save_16bit_model``: what goes into a tag.

Owns the contents of a checkpoint (what each rank reads of it on load: ``load_plan``); the engine's methods delegate here with the
engine's ``parts.CheckpointParts`` (module, ZeRO strategy, training state: each saves itself with
``state_dict``); this module only names the files, adds RNG states and client state, and hands
the result to the storage layer (``store`` via ``writer``; per-engine
machinery in ``checkpointer``). A tag holds::

    module.dsl            module.state_dict() (model dtype) minus the params the optimizer holds,
                          from global rank 0 (those params are stored once: as fp32 masters)
    zero_rank_NNNNN.dsl   strategy.state_dict() of rank N (stage 0: rank 0 only; all ranks have it)
    rank_NNNNN.dsl        the training part (as "engine"), RNG states (python, numpy, torch), client_state
    manifest.json         world size, stage, partition map, dtypes/shapes, sizes, CRC32C checksums, version

An engine with model parallelism (a pipeline, an mpu) names its files by topology coordinates
instead (``model_parallel``), one file per layer of a ``PipelineModule``.

Loading at the saving layout reads each rank's own files; at another world size or stage each
rank reads the saved shards its new range overlaps and ``reshard.assemble`` cuts them
to that range. The model-dtype weights of trained params are restored as the cast of their fp32
masters (``strategy.load_state_dict`` does it), which is exactly what they were when saved.
With ``checkpoint.use_node_local_storage`` each node's first rank also writes the module file
and every rank its ZeRO shard, so a node never needs another node's disk (loading
then requires the saving layout).

Limitations: async saves run collectives on a private gloo group from a background thread: call
``wait_for_checkpoint(engine)`` (or any save/load) before ``destroy_process_group``.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path
from typing import Any

import torch

import dslaunch
from dslaunch.errors import CheckpointArgumentError, CheckpointError, TagMismatchError, name_ranks
from dslaunch.runtime.checkpoint.checkpointer import (
    MODULE_FILE,
    Checkpointer,
    rank_file,
    rng_state,
    set_rng_state,
    zero_file,
)
from dslaunch.runtime.checkpoint.experts import (
    every_untrained,
    expert_record,
    live_experts,
    own_untrained,
)
from dslaunch.runtime.checkpoint.load_plan import collective_read
from dslaunch.runtime.checkpoint.model_parallel import (
    describe,
    module_keys,
    part_record,
    tag_meta,
)
from dslaunch.runtime.checkpoint.parts import CheckpointParts
from dslaunch.runtime.checkpoint.reshard import (
    partition_map,
)
from dslaunch.runtime.checkpoint.store import (
    CheckpointStore,
    Manifest,
    first_loadable,
    save_dir_problem,
    tag_problem,
    validate_tag,
    write_atomic,
)
from dslaunch.runtime.checkpoint.universal_autoep import record as autoep_record
from dslaunch.runtime.checkpoint.writer import TagWrite, write_tag
from dslaunch.runtime.moe.autoep_folded import folding_metadata
from dslaunch.runtime.moe.autoep_state import (
    local_layout,
    local_state_dict,
    unconverted_state_dict,
    whole_untrained,
)
from dslaunch.runtime.zero.full_state import load_module_state_dict, module_state_dict, shared_params

__all__ = ["save_checkpoint", "load_checkpoint", "save_16bit_model", "wait_for_checkpoint"]

log = logging.getLogger("dslaunch.checkpoint")


def wait_for_checkpoint(engine: Any) -> None:
    """Block until a pending async save is durable; raise its error if it failed.

    collective: call on all ranks (before destroying the process group).
    """
    engine.wait_for_checkpoint()


# ---- save ---------------------------------------------------------------------------------------
def _agreed_tag(ck: Checkpointer, save_dir: Any, tag: str, policy: str) -> str:
    """The one tag every rank saves under, rank 0's, once every rank's ``save_dir`` and tag are
    known good. "Fail" refuses tags that differ, "Warn" says so, "Ignore" is silent; none lets ranks
    write one checkpoint into several directories (a save is collective; DeepSpeed's "Ignore" would,
    and that checkpoint could not be loaded).

    One all-gather, always: a rank that refused its arguments alone left the others waiting in
    the save's first collective forever (``save_dir=""``). Every rank raises the same error.

    Raises:
        CheckpointArgumentError: a rank's ``save_dir`` or tag is unusable (a ``ValueError``).
        TagMismatchError: the tags differ under ``tag_validation`` Fail (an ``AssertionError``).
    """
    problem = save_dir_problem(save_dir) or tag_problem(tag)
    gathered = ck.comm.all_gather_object((problem, tag))
    if bad := [r for r, (p, _) in enumerate(gathered) if p]:
        where = "" if len(bad) == len(gathered) else f" (on {name_ranks(bad)})"
        raise CheckpointArgumentError(f"save_checkpoint: {gathered[bad[0]][0]}{where}")
    tags = [t for _, t in gathered]
    if len(set(tags)) == 1:
        return tag
    msg = f"checkpoint tags differ across ranks: {dict(enumerate(tags))}"
    if policy == "Fail":
        raise TagMismatchError(msg + " (checkpoint.tag_validation is Fail)")
    if policy == "Warn" and ck.comm.rank == 0:
        log.warning("%s; every rank saves under rank 0's tag %r", msg, tags[0])
    return tags[0]


def save_checkpoint(parts: CheckpointParts, save_dir: str | os.PathLike, tag: Any = None,
                    client_state: dict | None = None, save_latest: bool = True,
                    exclude_frozen_parameters: bool = False) -> bool:
    """Save module weights, ZeRO state, engine state, RNG and ``client_state`` under ``tag``.

    Args:
        tag: directory name inside ``save_dir``; default ``global_step{global_steps}``.
        save_latest: make ``save_dir/latest`` name this tag once it is complete.
    Returns:
        True (as DeepSpeed). With ``checkpoint.async_save`` the files are written in the
        background; the next save/load (or ``wait_for_checkpoint``) reports a failure.
    Raises:
        CheckpointArgumentError: an empty or unusable ``save_dir``, or an invalid tag, on any
            rank (every rank raises it; a ``ValueError`` as in DeepSpeed).
        TagMismatchError: tags differ with tag_validation Fail (an ``AssertionError``).
        CheckpointError: a rank failed to
            write or the tag could not be published: what the save created is removed and
            ``latest`` still names the previous tag (the message says what is on disk).

    collective: call on all ranks.
    """
    if parts.config.format == "deepspeed":  # DeepSpeed's own layout: its load_checkpoint reads it
        from dslaunch.runtime.checkpoint.deepspeed_write import deepspeed_job

        parts.io.writer.wait()
        job, big = deepspeed_job(parts, save_dir, _tag_for(parts, save_dir, tag), client_state, save_latest,
                                 exclude_frozen_parameters), ""  # an async save copies every file first
    else:
        job, big = tag_job(parts, save_dir, tag, client_state, save_latest, exclude_frozen_parameters)
    if parts.config.async_save:  # the ZeRO shard is the big file, copied on the writer thread
        save_async(parts.io, parts.optimizer, job, big)
    else:
        write_tag(parts.io.comm, job)
    return True


def _tag_for(parts: CheckpointParts, save_dir: str | os.PathLike, tag: Any) -> str:
    """The tag every rank saves under (``global_step<N>`` by default). collective."""
    given = str(tag) if tag is not None else f"global_step{parts.global_steps}"
    return _agreed_tag(parts.io, save_dir, given, parts.config.tag_validation)


def tag_job(parts: CheckpointParts, save_dir: str | os.PathLike, tag: Any, client_state: dict | None,
            save_latest: bool, exclude_frozen_parameters: bool, agreed: bool = False,
            partition: dict | None = None) -> tuple[TagWrite, str]:
    """What this rank writes into one tag (after the previous async save finished), and the name
    of its big file (the ZeRO shard) that an async save copies on the writer thread.

    ``agreed``: every rank computed the same ``tag``; ``partition``: the map of an earlier save of
    this engine (its layout never changes). collective: call on all ranks (it agrees on the tag
    and gathers the partition map, unless told both).
    """
    ck = parts.io
    ck.writer.wait()
    cfg = parts.config
    tag = validate_tag(str(tag)) if agreed else _tag_for(parts, save_dir, tag)
    rank, zero, place = ck.comm.rank, parts.zero, parts.placement
    if place is not None and cfg.use_node_local_storage:
        raise CheckpointError(f"checkpoint.use_node_local_storage is not supported with model parallelism "
                              f"({describe(place.shape)}): save to a shared file system")
    module_writer = rank == 0 or (cfg.use_node_local_storage and ck.node_leader)
    files: dict[str, Any] = {}
    zero_sd = zero.state_dict()
    experts = [g["reduce_group"] for g in zero_sd["groups"] if "reduce_group" in g]
    if experts and place is not None and place.layers is not None:
        raise CheckpointError(f"saving expert parameters ({experts[0]}) with pipeline parallelism "
                              f"({describe(place.shape)}) is not supported yet: save without a pipeline")
    # every rank's experts differ: each rank keeps its own shard file, at stage 0 too
    zero_writer = zero.partitioned or rank == 0 or cfg.use_node_local_storage or bool(experts)
    in_groups = {n: list(s) for g in zero_sd["groups"] for n, s in zip(g["names"], g["shapes"], strict=True)}
    # stage 3: partitioned params the optimizer does not hold (frozen ones, or all of them in an
    # engine without an optimizer) are gathered whole here, one module at a time
    module_sd = module_state_dict(parts.module, exclude_frozen_parameters, skip=frozenset(in_groups))
    # each rank's experts differ: the module file takes every rank's frozen ones (and buffers)
    module_sd = whole_untrained(parts.module, module_sd, set(in_groups))  # AutoEP: whole fused weights
    module_sd, untrained, frozen_experts = every_untrained(ck.comm, parts.module, module_sd, set(in_groups))
    module_meta = {k: {"dtype": str(v.dtype).removeprefix("torch."), "shape": in_groups.get(k, list(v.shape)),
                       "in": "zero" if k in in_groups else "module"}
                   for k, v in module_sd.items() if torch.is_tensor(v)}
    frozen = [n for n, p in parts.module.named_parameters() if not p.requires_grad] + frozen_experts
    if place is not None:  # each rank's part, named by its coordinates
        # each rank's experts differ: every rank keeps its own shard file, at stage 0 too
        own, record = part_record(place, zero_sd, _layout(zero_sd), module_sd, set(in_groups),
                                  zero.partitioned or bool(experts))
        files.update(own)
        if experts:  # which global experts this rank's file holds: a load checks it holds the same
            record["experts"] = {str(gi): names for gi, names in live_experts(parts.module, zero_sd).items()}
    else:
        if module_writer:  # trained params live once, as fp32 masters in the ZeRO shards
            files[MODULE_FILE] = {"module": type(module_sd)((k, v) for k, v in module_sd.items()
                                                             if k not in in_groups)}
        if zero_writer:
            files[zero_file(rank)] = zero_sd
    files[rank_file(rank)] = {"engine": parts.training.state_dict(), "rng": rng_state(),
                               "client_state": client_state if client_state is not None else {}}
    meta = {"world_size": ck.comm.world_size, "zero_stage": zero.stage,
            "global_steps": parts.global_steps, "torch_version": torch.__version__,
            "node_local_storage": cfg.use_node_local_storage,
            "exclude_frozen_parameters": exclude_frozen_parameters,
            # lets zero-to-fp32 tell frozen params from buffers (exclude_frozen_parameters there)
            "frozen_parameters": frozen, "module_keys": list(module_sd), "module": module_meta,
            # zero-to-fp32 gives a tied parameter's every name its one fp32 master
            "shared_params": shared_params(parts.module),
            "untrained_experts": untrained,  # global names: a load takes those it holds (own_untrained)
            "folding": folding_metadata(parts.module),
            "autoep": autoep_record(parts.module)}  # what ds-to-universal needs of AutoEP blocks  # AutoEP folded with AutoTP: loads only at the same
    if place is not None:
        records = ck.comm.all_gather_object({**record, "frozen": frozen, "module": module_meta})
        meta.update(model_parallel=tag_meta(place, records),
                    module_keys=module_keys(records, place.layers is not None),
                    frozen_parameters=sorted({n for r in records for n in r["frozen"]}),
                    module={k: v for r in records for k, v in r["module"].items()})
    elif partition is not None:  # gathered by an earlier save
        meta["partition"] = partition
    else:
        layouts = ck.comm.all_gather_object(
            _layout(zero_sd) if zero_writer and not (cfg.use_node_local_storage and not zero.partitioned
                                                       and rank != 0) else None)
        meta["partition"] = partition_map([x for x in layouts if x is not None])
        if experts and (record := expert_record(ck.comm, parts.module, zero_sd)) is not None:
            meta["experts"] = record  # which global experts each rank holds: a load may place them anew
    job = TagWrite(CheckpointStore(save_dir, durable=cfg.fsync), tag, files, meta,
                   leader=ck.node_leader if cfg.use_node_local_storage else rank == 0,
                   save_latest=save_latest, keep_last=cfg.keep_last or 0,
                   library_version=dslaunch.__version__)
    return job, zero_file(rank) if place is None else (record["zero"] or {}).get("file", "")


def save_async(ck: Checkpointer, optimizer: Any, job: TagWrite, big: str, direct: bool = False) -> None:
    """Copy the small state now and the ZeRO shard on the writer thread, then write.

    Only the optimizer step changes the ZeRO state (master weights, moments), so the shard is
    copied while the next forward/backward runs and the next ``optimizer.step()`` waits for the
    copy to finish: the training loop only stalls if the copy outlasts forward + backward.

    ``direct``: the store is host memory (a tmpfs): the live shard is written straight into its
    file (that is the copy); the next ``optimizer.step()`` waits for that write only.
    """
    files = dict(job.files)
    live = files.pop(big, None)
    files = ck.small_snapshot.take(files)
    if optimizer is not None:  # an engine without an optimizer never changes its state
        ck.gate(optimizer)
    ck.snapshot_done.clear()

    def run() -> None:
        try:
            if direct:  # the shard first: the step waits for it alone
                own = {big: live, **files} if live is not None else files
                write_tag(ck.comm, dataclasses.replace(job, files=own, written=ck.snapshot_done.set))
                return
            if live is not None:
                files[big] = ck.snapshot.take(live)
        finally:
            ck.snapshot_done.set()
        write_tag(ck.comm, dataclasses.replace(job, files=files))

    ck.writer.submit(run)


def _layout(zero_sd: dict) -> dict:
    """A shard's state dict without its tensors (enough for the partition map)."""
    return {"stage": zero_sd["stage"], "world_size": zero_sd["world_size"], "rank": zero_sd["rank"],
            "groups": [{k: g[k] for k in ("names", "shapes", "numel", "start", "end", "reduce_group") if k in g}
                       for g in zero_sd["groups"]]}


# ---- load ---------------------------------------------------------------------------------------
def _candidates(ck: Checkpointer, store: CheckpointStore, tag: Any) -> tuple[list[str], list[str]]:
    if tag is not None:
        return [str(tag)], []
    # rank 0 decides the order, so every rank tries the same tags (node-local disks may differ).
    return ck.comm.all_gather_object(store.candidates() if ck.comm.rank == 0 else None)[0]


def _master_from_module(module: torch.nn.Module, current: dict) -> list[torch.Tensor]:
    params = dict(module.named_parameters())
    out = []
    for g in current["groups"]:
        flat = torch.cat([params[n].detach().float().reshape(-1) for n in g["names"]])
        out.append(flat[g["start"]:g["end"]])
    return out


def with_masters(current: dict, masters: list[torch.Tensor]) -> dict:
    """The live strategy state with only the fp32 master weights replaced."""
    return {**current, "groups": [{**g, "master": m} for g, m in zip(current["groups"], masters,
                                                                      strict=True)]}


def load_module_weights(module: torch.nn.Module, sd: dict, strict: bool, meta: dict, held: set[str],
                 source: str) -> None:
    """Load buffers and untrained params; ``held`` names the params restored from fp32 masters.

    Partitioned params not held (stage 3: frozen ones, or every param of an engine without an
    optimizer) take their whole saved values into their shards.
    """
    params = dict(module.named_parameters(remove_duplicate=False))
    held_ids = {id(params[n]) for n in held if n in params}
    # every name of a held param (a tied one has several) comes from the masters
    held = set(held) | {n for n, p in params.items() if id(p) in held_ids}
    if meta.get("untrained_experts"):  # deepspeed.moe's frozen experts and buffers, every rank's
        sd = own_untrained(module, sd, meta["untrained_experts"])
    sd = {k: v for k, v in local_state_dict(module, sd).items() if k not in held}  # AutoEP: this rank's rows
    missing, unexpected = load_module_state_dict(module, sd, False, module.load_state_dict)
    excused = set(held)
    if meta.get("exclude_frozen_parameters"):
        excused |= {n for n, p in module.named_parameters() if not p.requires_grad}
    missing = [k for k in missing if k not in excused]
    if strict and (missing or unexpected):
        raise CheckpointError(f"module weights do not match the model: missing {missing[:5]}, "
                              f"unexpected {unexpected[:5]} (load_module_strict=False to load "
                              "what matches)", source)


def load_checkpoint(parts: CheckpointParts, load_dir: str | os.PathLike, tag: Any = None,
                    load_module_strict: bool = True, load_optimizer_states: bool = True,
                    load_lr_scheduler_states: bool = True, load_module_only: bool = False
                    ) -> tuple[str | None, dict | None]:
    """Load a checkpoint saved at any world size and ZeRO stage into an engine's ``parts``: one of
    dslaunch's, or one real DeepSpeed wrote (``deepspeed_load``: its ``latest`` and tag folder).

    Args:
        tag: the tag to load; None: the one ``latest`` names, or else the newest valid tag
            (a warning says which and why).
        load_module_only: module weights (and the fp32 masters) only; no optimizer, engine
            counters, scheduler or RNG.
    Returns:
        ``(tag directory, client_state)``, or ``(None, None)`` with a warning when ``load_dir``
        holds no checkpoint.
    Raises:
        CheckpointError: the named tag (or, with tag=None, every tag) is missing, truncated or
            corrupt (the message names the file), or does not fit the model.

    collective: call on all ranks.
    """
    ck = parts.io
    ck.writer.wait()
    # deepspeed_load builds on this module's loading steps, hence the import here
    from dslaunch.runtime.checkpoint.deepspeed_load import find_deepspeed_tag, load_deepspeed

    flags = {"load_module_strict": load_module_strict, "load_optimizer_states": load_optimizer_states,
             "load_lr_scheduler_states": load_lr_scheduler_states, "load_module_only": load_module_only}
    if parts.config.load_universal:  # DeepSpeed's universal layout, the tag from latest_universal
        from dslaunch.runtime.checkpoint.universal import read_universal, universal_tag

        return load_deepspeed(parts, universal_tag(load_dir, tag), reader=read_universal, **flags)
    folder = find_deepspeed_tag(ck, load_dir, tag)
    if folder is not None:
        return load_deepspeed(parts, folder, **flags)
    store = CheckpointStore(load_dir)
    tags, notes = _candidates(ck, store, tag)
    if not tags:
        if ck.comm.rank == 0:
            log.warning("no checkpoint to load in %s (%s); starting from scratch", load_dir,
                        "; ".join(notes) or "no tags")
        return None, None
    current = parts.zero.state_dict()
    with local_layout(parts.module):
        keys = set(parts.module.state_dict())
    live = live_experts(parts.module, current)
    found = first_loadable(tags, lambda t: collective_read(ck, store, t, current, parts.placement, keys, live))
    assert found is not None
    tag, got, skipped = found
    manifest: Manifest = got["manifest"]
    source = str(store.root / tag)
    if (notes or skipped) and ck.comm.rank == 0:
        log.warning("checkpoint: %s; loaded tag %r, the newest valid one", "; ".join(notes + skipped), tag)
    meta = manifest.meta
    if meta.get("folding") != folding_metadata(parts.module):
        raise CheckpointError(f"saved with AutoEP folding {meta.get('folding')}, this engine has "
                              f"{folding_metadata(parts.module)}: a folded tag (AutoEP beside AutoTP) loads only at "
                              "the same tensor, expert and data sizes", source)
    if got["incompatible"] is None:
        held = {n for g in current["groups"] for n in g["names"]}
        load_module_weights(parts.module, got["module"], load_module_strict, meta, held, source)
        saved_masters = [g["master"] for g in got["zero"]["groups"]]
    else:
        if load_module_strict:
            raise got["incompatible"]
        params = dict(parts.module.named_parameters())
        weights = {k: v.to(params[k].dtype) for k, v in got["fp32"].items() if k in params}
        load_module_weights(parts.module, {**got["module"], **weights}, False, meta, set(), source)
        log.warning("checkpoint %s: optimizer state does not fit this model; loaded module "
                    "weights only (load_module_strict=False)", source)
        load_module_only, saved_masters = True, _master_from_module(parts.module, current)
    if load_module_only or not load_optimizer_states:
        parts.zero.load_state_dict(with_masters(current, saved_masters))
    else:
        parts.zero.load_state_dict(got["zero"])
    state = got["rank"]
    if not load_module_only:
        training = dict(state["engine"])
        if not load_lr_scheduler_states:
            training["lr_scheduler"] = None
        if not load_optimizer_states:  # the loss scale and the exchange's error feedback go with
            training["loss_scaler"] = parts.training.state_dict()["loss_scaler"]  # the optimizer state
            training["grad_exchange"] = None
        parts.training.load_state_dict(training)
        if got["rank_src"] == ck.comm.rank:
            set_rng_state(state["rng"])
    if ck.comm.rank == 0:
        log.info("loaded checkpoint %s (saved at world size %d, ZeRO stage %d; now %d, stage %d)",
                 source, meta["world_size"], meta["zero_stage"], ck.comm.world_size, parts.zero.stage)
    return source, state["client_state"]


# ---- 16-bit export ------------------------------------------------------------------------------
def save_16bit_model(parts: CheckpointParts, save_dir: str | os.PathLike, save_filename: str = "pytorch_model.bin",
                     exclude_frozen_parameters: bool = False, state_dict: dict | None = None) -> bool:
    """Rank 0 writes the module's state dict (model dtype) with ``torch.save``, atomically.

    ``exclude_frozen_parameters`` leaves out parameters with ``requires_grad=False``; ``state_dict``
    (rank 0's) is written instead where the caller put it together (ZeRO-3 with AutoTP's slices).

    collective: call on all ranks.
    """
    ck = parts.io
    ck.writer.wait()
    err = None
    # stage 3: gathered on all ranks; AutoEP's experts put together (the Hugging Face model's layout)
    sd = state_dict if state_dict is not None else \
        unconverted_state_dict(parts.module, module_state_dict(parts.module, exclude_frozen_parameters))
    if ck.comm.rank == 0:
        path = Path(save_dir) / save_filename
        try:
            write_atomic(path, lambda tmp: torch.save(sd, tmp))
        except OSError as exc:
            err = f"cannot write {path}: {exc}"
    errors = [e for e in ck.comm.all_gather_object(err) if e]
    if errors:
        raise CheckpointError(errors[0])
    return True
