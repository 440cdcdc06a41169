"""In-memory peer checkpoints: snapshots in host RAM that a restarted run resumes from.

Owns the ``memory_checkpoint`` block's behaviour: every ``interval`` optimizer steps each rank's
checkpoint parts (the files of a dslaunch tag: its ZeRO shard, counters, scheduler, RNG, data
position, and each host's module file) are written into a store on a tmpfs of its host
(``<dir>/dslaunch-<uid>-<job>/<hostname>/``) and, with ``replicas: 1``, into the store of the next
host too (rank r's peer: the same local rank on the next host, round robin). A restarted run's
``initialize()`` resumes from the newest complete snapshot the surviving hosts hold between them
when it is not older than the newest storage checkpoint (``resume``).

Why a tmpfs and not a store process: a tmpfs is host memory the kernel keeps for as long as the
host is up, whatever happens to the processes that wrote it; a killed rank, a killed node agent
(remote agents are new processes at every run) and the launcher itself can all die without taking
a snapshot with them, and no process has to hand its contents over. Writing it is a memory copy.

A snapshot is a tag written by the checkpoint save protocol (``writer.write_tag``) with node-local
leaders, no fsync and ``keep_last`` 2, asynchronously (``save_load.save_async`` with ``direct``):
the step waits only for the copy of the small state to host memory; the ZeRO shard is written
straight into its file in the store (one copy, to host memory) while the next forward/backward
runs, and the next optimizer step waits for that write only. The replica exchange (point to point
on the checkpoint's private gloo group: each file sent from its mapped pages in the store, received
straight into the pages of its copy) and the publication run on the writer thread after it. The
tag is named from the step and the partition map is gathered at the first snapshot only, so a
snapshot starts with no collective on the training thread. A tag is published on a host
only after every rank wrote its files and every replica arrived (the protocol's all-gather), so a
snapshot a host died in the middle of stays a ``.tmp-`` directory and is never read.

Memory: each host holds two snapshots, the newest complete one and the one before it; a new
snapshot's files take over the pages of the older one's (``CheckpointStore.reuse_from``: each file
moved into the new tag and overwritten in place, each replica received into its old copy's pages),
so a snapshot neither allocates, zeroes nor frees memory (about half its CPU on a tmpfs). The older
snapshot stays loadable until its first file is taken; one with a file taken is no longer complete
and is never chosen. At most two snapshots' pages, as before (the newest complete and the one being
written), but held between snapshots too.

Resume (collective): every rank lists the complete tags of its host's store and which of their
files it holds; the newest tag whose files the live hosts hold between them is chosen; a rank
whose host lacks a file it needs (a shrunk world, or its own host's copy lost) receives it from a
rank on a host that has it, into its own host's store; then the tag loads through
``load_checkpoint``, which reshards to the current world size.

Limitations: not with model parallelism (pipeline, tensor parallel, an mpu); the store lives as
long as the host is up: the launcher removes its own host's store when the job ends, other hosts'
stores stay until removed (``rm -r <dir>/dslaunch-<uid>-*``) or the host reboots.
"""

from __future__ import annotations

import dataclasses
import logging
import mmap
import os
import socket
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dslaunch.errors import CheckpointError
from dslaunch.runtime.checkpoint.checkpointer import MODULE_FILE, rank_file, zero_file
from dslaunch.runtime.checkpoint.format import file_bytes
from dslaunch.runtime.checkpoint.load_plan import zero_sources
from dslaunch.runtime.checkpoint.parts import CheckpointParts
from dslaunch.runtime.checkpoint.save_load import save_async, tag_job
from dslaunch.runtime.checkpoint.store import MANIFEST, CheckpointStore, FileRecord, Manifest
from dslaunch.runtime.config.memory_checkpoint import MemoryCheckpointConfig
from dslaunch.runtime.heartbeat import reporter
from dslaunch.safe_write import create_reusing, explain, make_dirs, write_file
from dslaunch.utils.restart import JOB_ID

__all__ = ["TAG_PREFIX", "Resumed", "MemoryCheckpoint", "attach", "job_store", "host_store", "peers",
           "choose", "storage_step"]

log = logging.getLogger("dslaunch.checkpoint")

TAG_PREFIX = "memory_step"
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)  # a replica's pages mapped at once, not one fault per page


def job_store(cfg: MemoryCheckpointConfig, job: str) -> Path:
    """The directory of one job's memory stores (one per host below it)."""
    return Path(cfg.dir) / f"dslaunch-{os.getuid()}-{job}"


def host_store(cfg: MemoryCheckpointConfig, job: str, host: str | None = None) -> Path:
    return job_store(cfg, job) / (host or socket.gethostname())


def peers(hosts: list[str]) -> list[int | None]:
    """Where each rank's replica goes: the rank with the same local index on the next host
    (round robin, modulo that host's ranks); None on a single host. ``hosts[r]``: rank r's host."""
    order = list(dict.fromkeys(hosts))
    if len(order) < 2:
        return [None] * len(hosts)
    ranks = {h: [r for r, x in enumerate(hosts) if x == h] for h in order}
    out: list[int | None] = []
    for r, h in enumerate(hosts):
        nxt = ranks[order[(order.index(h) + 1) % len(order)]]
        out.append(nxt[ranks[h].index(r) % len(nxt)])
    return out


@dataclass(frozen=True)
class Resumed:
    """Where a restarted run's state came from."""

    source: str
    """``memory`` (every rank read files its own host's ranks saved) or ``peer memory`` (some rank
    read a replica another host pushed, or a file fetched from another host)."""
    step: int
    tag: str
    storage_step: int | None
    """The newest storage checkpoint's step (None: none, or no ``--resume_from``)."""


# ---- snapshot -----------------------------------------------------------------------------------
class PeerReplica:
    """The writer-thread hook that copies this rank's files to its peer and receives the files of
    the ranks whose peer it is (``TagWrite.replicate``). Every rank sends and receives at once
    (isend/irecv), so a ring of any length never waits on itself. A file is sent from its pages
    in the store (mapped, not read back) and received straight into the pages of its copy."""

    def __init__(self, comm: Any, store: CheckpointStore, tag: str, peer_of: list[int | None]):
        self.comm, self.store, self.tag, self.peer_of = comm, store, tag, peer_of  # store.reuse_from: old copies

    def __call__(self, own: list[FileRecord]) -> list[FileRecord]:
        import torch.distributed as dist

        me = self.comm.rank
        every = self.comm.all_gather_object(own)
        senders = [r for r, p in enumerate(self.peer_of) if p == me and r != me]
        tmp = self.store.tmp_dir(self.tag)
        reqs, bufs = [], []
        if self.peer_of[me] is not None:
            for rec in sendable(own):
                data = file_bytes(tmp / rec.name, rec.size)
                reqs.append(dist.isend(data, self.peer_of[me], group=self.comm.group))
                bufs.append(data)  # alive until sent
        mine = {rec.name for rec in own}
        got, problem = [], None
        for r in senders:
            for rec in sendable(every[r]):
                reuse = self.store.reuse_from / rec.name if self.store.reuse_from is not None else None
                buf, err = (_scratch(rec.size), None) if rec.name in mine else _receive_into(tmp, rec.name, rec.size,
                                                                                              reuse)
                problem = problem or err
                reqs.append(dist.irecv(buf, r, group=self.comm.group))
                got.append((rec, buf))
        for req in reqs:
            req.wait()
        # only after every transfer: a rank failing to write never leaves its sender waiting
        if problem:
            raise CheckpointError(f"memory snapshot {self.tag!r}: cannot hold a peer's replica: {problem}")
        return [rec for rec, _ in got if rec.name not in mine]


def sendable(records: list[FileRecord]) -> list[FileRecord]:
    """The files a replica carries: every host's leader writes its own module file."""
    return [rec for rec in records if rec.name != MODULE_FILE]


def _scratch(size: int) -> torch.Tensor:
    return torch.empty(size, dtype=torch.uint8)


def _receive_into(folder: Path, name: str, size: int, reuse: Path | None = None) -> tuple[torch.Tensor, str | None]:
    """A new file of ``size`` bytes in ``folder``, mapped, to receive a copy straight into (``reuse``:
    an old file taken over for it, its pages reused, when it can be); or a scratch buffer (its
    sender must not wait forever) and why the file cannot be made."""
    try:
        fd, _ = create_reusing(folder, name, reuse, 0o600, readable=True)
        try:
            if size == 0:
                return _scratch(0), None
            os.ftruncate(fd, size)  # an old copy: its length, now this one's (new: a no-op)
            os.posix_fallocate(fd, 0, size)  # a full tmpfs fails here, not with SIGBUS mid-receive
            mapped = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | _POPULATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
    except OSError as err:
        return _scratch(size), explain(err, folder / name)
    return torch.frombuffer(mapped, dtype=torch.uint8), None


class MemoryCheckpoint:
    """One engine's memory snapshots: when to take them, where they go, and the resume.

    collective: built on every rank (it gathers the ranks' hosts).
    """

    def __init__(self, cfg: MemoryCheckpointConfig, parts: CheckpointParts, job: str):
        self.cfg = cfg
        self.host = socket.gethostname()
        self.store = CheckpointStore(host_store(cfg, job, self.host), durable=False)
        problem = None
        try:
            make_dirs(self.store.root.parent, mode=0o700)  # the job's snapshots are its user's alone
        except OSError as err:
            problem = f"memory_checkpoint.dir {cfg.dir!r} cannot hold the snapshots: {explain(err, cfg.dir)}"
        said = parts.io.comm.all_gather_object((self.host, problem))  # every rank raises, none waits
        if bad := [p for _, p in said if p]:
            raise CheckpointError(bad[0])
        self.hosts: list[str] = [h for h, _ in said]
        self.peer_of = peers(self.hosts) if cfg.replicas else [None] * len(self.hosts)
        self.leader = self.hosts.index(self.host) == parts.io.comm.rank  # reports its host's store
        self._pending: int | None = None  # the step of the snapshot being written
        self._older: int | None = None  # the step of the snapshot before it, whose pages the next one takes
        self._partition: dict | None = None  # the partition map: gathered at the first snapshot only
        if parts.placement is not None:
            raise CheckpointError("memory_checkpoint is not supported with model parallelism (pipeline, tensor "
                                  "parallel or an mpu) yet: remove the memory_checkpoint block")

    def due(self, global_steps: int) -> bool:
        return global_steps > 0 and global_steps % self.cfg.interval == 0

    def snapshot(self, parts: CheckpointParts) -> None:
        """Start a snapshot of this step: copies the small state now, the rest in the background.

        collective: call on all ranks.
        """
        parts = dataclasses.replace(parts, config=dataclasses.replace(
            parts.config, async_save=True, fsync=False, keep_last=2, use_node_local_storage=True,
            tag_validation="Ignore"))
        # every rank names the tag alike and the layout never changes: no collective here after the first
        job, big = tag_job(parts, self.store.root, f"{TAG_PREFIX}{parts.global_steps}", None, True, False,
                           agreed=True, partition=self._partition)
        self._partition = job.meta.get("partition")
        older = self.store.root / f"{TAG_PREFIX}{self._older}" if self._older is not None else None
        job = dataclasses.replace(job, meta={**job.meta, "hosts": self.hosts},  # tells replicas from own files
                                  store=CheckpointStore(job.store.root, durable=False, reuse_from=older))
        if any(p is not None for p in self.peer_of):
            job = dataclasses.replace(job, replicate=PeerReplica(parts.io.comm, job.store, job.tag, self.peer_of))
        save_async(parts.io, parts.optimizer, job, big, direct=True)
        # tag_job waited for the previous snapshot: it is complete now
        complete, self._pending = self._pending, parts.global_steps
        self._older = complete
        hb = reporter()
        if self.leader and hb is not None:
            hb.set_memory_checkpoint({"host": self.host, "step": complete, "bytes": self.held_bytes(),
                                      "store": str(self.store.root.parent)})

    def held_bytes(self) -> int:
        """Bytes this host's store holds (complete snapshots and the one being written)."""
        total = 0
        for folder, _, files in os.walk(self.store.root):
            total += sum(os.lstat(os.path.join(folder, f)).st_size for f in files)
        return total

    # ---- resume ---------------------------------------------------------------------------------
    def resume(self, parts: CheckpointParts, storage_dir: str | None,
               load: Callable[[str, str], Any]) -> Resumed | None:
        """Load the newest complete memory snapshot when it is not older than the newest storage
        checkpoint in ``storage_dir``; ``load(dir, tag)`` loads a tag (the engine's
        ``load_checkpoint``). Returns None when memory has nothing to offer (the caller then
        resumes from storage).

        collective: call on all ranks.
        """
        comm = parts.io.comm
        parts.io.writer.wait()
        inventory = comm.all_gather_object((self.host, _inventory(self.store)))
        chosen = choose(inventory)
        from_storage = comm.all_gather_object(storage_step(storage_dir) if comm.rank == 0 else None)[0]
        if chosen is None or (from_storage is not None and chosen[1] < from_storage):
            return None
        tag, step = chosen
        holders = [r for r, (h, tags) in enumerate(inventory) if tag in tags and MANIFEST in tags[tag][1]]
        text = comm.all_gather_object(_manifest_text(self.store, tag) if comm.rank == holders[0] else None)
        manifest = Manifest.from_json(text[holders[0]], self.store.root / tag / MANIFEST)
        try:  # every rank raises the same error (agreed, or a collective read)
            fetched = self._fetch(parts, tag, manifest, text[holders[0]], inventory)
            load(str(self.store.root), tag)
        except CheckpointError as err:
            if from_storage is None:
                raise
            if comm.rank == 0:  # storage overwrites whatever this load had put in place
                log.warning("memory snapshot %s cannot be loaded (%s); resuming from storage instead", tag, err)
            return None
        saved_on = manifest.meta.get("hosts") or []
        replica = any(saved_on[manifest.files[name].rank] != self.host for name in _needed(manifest, parts, comm.rank)
                      if name != MODULE_FILE and manifest.files[name].rank < len(saved_on))
        peer = fetched or any(comm.all_gather_object(replica))
        resumed = Resumed("peer memory" if peer else "memory", step, tag, from_storage)
        self._pending = step  # complete: the next snapshot reports it
        if comm.rank == 0:
            newest = f"step {from_storage}" if from_storage is not None else "none"
            print(f"dslaunch: resumed from {resumed.source} at step {step} (snapshot {tag}; newest storage "
                  f"checkpoint: {newest})", flush=True)
            hb = reporter()
            if hb is not None:
                hb.set_memory_checkpoint({"restored": {"source": resumed.source, "step": step,
                                                       "storage_step": from_storage}})
        return resumed

    def report_storage_resume(self, rank: int, step: int) -> None:
        """Memory had nothing newer: say that the restarted run resumed from storage."""
        hb = reporter()
        if rank == 0:
            print(f"dslaunch: resumed from storage at step {step} (no complete memory snapshot as new)", flush=True)
            if hb is not None:
                hb.set_memory_checkpoint({"restored": {"source": "storage", "step": step, "storage_step": step}})

    def _fetch(self, parts: CheckpointParts, tag: str, manifest: Manifest, text: str,
               inventory: list[tuple[str, dict]]) -> bool:
        """Bring every file this rank needs into its host's store; True if any came from another
        host (anywhere in the world: every rank says the same)."""
        import torch.distributed as dist

        comm = parts.io.comm
        needed = _needed(manifest, parts, comm.rank)
        held = {h: set(tags[tag][1]) if tag in tags else set() for h, tags in inventory}
        missing = sorted(needed - held[self.host])
        wants = comm.all_gather_object(missing)
        plan = []  # (receiver, provider, name), in one order on every rank
        for r, names in enumerate(wants):
            for name in names:
                if any(x == (r, name) or (self.hosts[x[0]] == self.hosts[r] and x[2] == name) for x in plan):
                    continue  # a rank of the same host fetches it
                providers = [p for p, host in enumerate(self.hosts) if name in held.get(host, set())]
                if not providers:
                    raise CheckpointError(f"memory snapshot {tag!r}: no live host holds {name}", str(self.store.root))
                plan.append((r, providers[0], name))
        folder = self.store.root / tag
        if any(receiver == comm.rank for receiver, _, _ in plan):
            make_dirs(folder)  # this host may have lost its copy (or never had one)
        if MANIFEST not in held[self.host] and self.leader:
            make_dirs(folder)
            write_file(folder, MANIFEST, text, replace=False)
        problem = None
        for receiver, provider, name in plan:
            if provider == comm.rank:
                dist.send(file_bytes(folder / name, manifest.files[name].size), receiver, group=comm.group)
            elif receiver == comm.rank:
                buf, err = _receive_into(folder, name, manifest.files[name].size)
                dist.recv(buf, provider, group=comm.group)  # also on error: its provider never waits
                if err:
                    problem = problem or f"memory snapshot {tag!r}: cannot write {err}"
        # every fetched file is in place before anyone reads; a failed write fails every rank
        if errors := [p for p in comm.all_gather_object(problem) if p]:
            raise CheckpointError(errors[0])
        return bool(plan)


def _needed(manifest: Manifest, parts: CheckpointParts, rank: int) -> set[str]:
    """The files of ``manifest``'s tag this rank reads when it loads it now."""
    world = manifest.meta["world_size"]
    current = parts.zero.state_dict()
    return ({MODULE_FILE, rank_file(rank if rank < world else 0)}
            | {zero_file(r) for r in zero_sources(manifest, current, rank)})


def _manifest_text(store: CheckpointStore, tag: str) -> str:
    return (store.root / tag / MANIFEST).read_text()


def _inventory(store: CheckpointStore) -> dict[str, tuple[int, list[str], list[str]]]:
    """This host's complete memory snapshots: tag -> (step, files present at their size, files of
    the tag)."""
    out: dict[str, tuple[int, list[str], list[str]]] = {}
    try:
        manifests = store.tags()
    except CheckpointError:
        return out
    for m in manifests:
        if not m.tag.startswith(TAG_PREFIX):
            continue
        present = [MANIFEST] + [name for name, rec in m.files.items() if _size(store.root / m.tag / name) == rec.size]
        out[m.tag] = (int(m.meta.get("global_steps", -1)), present, sorted(m.files))
    return out


def _size(path: Path) -> int | None:
    try:
        return path.stat().st_size
    except OSError:
        return None


def choose(inventory: list[tuple[str, dict]]) -> tuple[str, int] | None:
    """The newest snapshot (tag, step) whose files the hosts in ``inventory`` hold between them.

    ``inventory``: per rank, (host, {tag: (step, files held, files of the tag)}).
    """
    union: dict[str, set[str]] = {}
    wanted: dict[str, tuple[int, set[str]]] = {}
    for _, tags in inventory:
        for tag, (step, held, every) in tags.items():
            union.setdefault(tag, set()).update(held)
            wanted[tag] = (step, set(every))
    complete = [(step, tag) for tag, (step, every) in wanted.items() if every <= union[tag]]
    if not complete:
        return None
    step, tag = max(complete)
    return tag, step


def storage_step(storage_dir: str | None) -> int | None:
    """The step of the newest published checkpoint in ``storage_dir`` (None: none)."""
    if not storage_dir:
        return None
    try:
        tags = CheckpointStore(storage_dir).tags()
    except CheckpointError:
        return None
    steps = [int(m.meta["global_steps"]) for m in tags if isinstance(m.meta.get("global_steps"), int)]
    return max(steps) if steps else None


def attach(engine: Any, cfg: MemoryCheckpointConfig) -> MemoryCheckpoint | None:
    """Give ``engine`` its memory snapshots (None, with a note on rank 0, outside the launcher:
    a job id names the stores that outlive the run). collective: call on all ranks."""
    job = os.environ.get(JOB_ID)
    if not job:
        if engine.global_rank == 0:
            print(f"dslaunch: note: memory_checkpoint is off: it needs the dslaunch launcher ({JOB_ID} is not "
                  "set), whose restarts it serves", flush=True)
        return None
    engine.memory_checkpoint = MemoryCheckpoint(cfg, engine.checkpoint_parts(), job)
    return engine.memory_checkpoint
