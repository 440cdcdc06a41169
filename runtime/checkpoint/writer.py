"""Writing one tag from many ranks, synchronously or on a background thread.

Owns the save protocol (``write_tag``), the communicator it runs on (``Comm``: a gloo group or a
single process), the host-memory snapshot that lets training continue during an async save
(``Snapshot``), and the background writer (``AsyncWriter``).

Protocol (collective): leaders clear leftovers of killed saves and create ``.tmp-<tag>`` -> every
rank writes and fsyncs its files -> records and errors are all-gathered -> leaders write the
manifest, move the tag into place and update ``latest`` -> outcomes all-gathered -> leaders
commit (drop the tag's previous version, apply retention), or, if any leader failed, all undo.
Every rank learns of any rank's failure and raises the same ``CheckpointError``, after the
leaders removed what the save created; its message ends with what is on disk then (``latest``
and the tag). There is one leader (global rank 0) on a shared file system, or one per node with
node-local storage.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from dslaunch.errors import CheckpointError, DslaunchError, name_ranks
from dslaunch.runtime.checkpoint.format import Encoded
from dslaunch.runtime.checkpoint.leftovers import SAVE_TIMEOUT_S
from dslaunch.runtime.checkpoint.publish import LeaderSave
from dslaunch.runtime.checkpoint.store import CheckpointStore, FileRecord, Manifest
from dslaunch.runtime.heartbeat import waiting
from dslaunch.runtime.parallel.groups import dedicated_world_group

__all__ = ["Comm", "LocalComm", "GroupComm", "TagWrite", "write_tag", "Snapshot", "AsyncWriter"]

log = logging.getLogger("dslaunch.checkpoint")


class Comm(Protocol):
    """The few collectives the checkpoint protocol needs."""

    rank: int
    world_size: int

    def all_gather_object(self, obj: Any) -> list[Any]: ...


class LocalComm:
    """A world of one process (no torch.distributed needed)."""

    rank, world_size = 0, 1

    def all_gather_object(self, obj: Any) -> list[Any]:
        return [obj]


class GroupComm:
    """Collectives on a dedicated gloo group, so a background save never interleaves its
    collectives with the training loop's on the default group."""

    def __init__(self, timeout_s: float = SAVE_TIMEOUT_S):
        import torch.distributed as dist

        self._dist = dist
        self.group = dedicated_world_group("gloo", timeout_s)  # collective: every rank
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()

    def all_gather_object(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self.world_size
        with waiting("checkpoint all_gather"):  # its barrier; marked only on the main thread
            self._dist.all_gather_object(out, obj, group=self.group)
        return out


@dataclass(frozen=True)
class TagWrite:
    """Everything one rank contributes to one tag."""

    store: CheckpointStore
    tag: str
    files: dict[str, Any]  # file name -> object written by this rank
    meta: dict[str, Any]  # manifest metadata (leaders only need it)
    leader: bool  # creates the tmp dir and publishes (rank 0, or each node's first rank)
    save_latest: bool = True
    keep_last: int = 0
    library_version: str = ""
    replicate: Callable[[list[FileRecord]], list[FileRecord]] | None = None
    """Called with this rank's written records before they are gathered: writes copies of other
    ranks' files into this rank's tmp dir and returns their records (``memory.PeerReplica``)."""
    written: Callable[[], None] | None = None
    """Called once this rank's own files are written (before ``replicate``): an async save's
    optimizer step may go on from then (``save_load.save_async``'s ``direct``)."""


def _attempt(fn: Callable[[], Any]) -> tuple[Any, str | None]:
    try:
        return fn(), None
    except DslaunchError as exc:  # its message is complete
        return None, str(exc)
    except Exception as exc:  # reported to every rank
        return None, f"{type(exc).__name__}: {exc}"


def _per_rank(items: list[str | None], limit: int = 3, clip: int = 400) -> str:
    """``rank 1: text; ranks 2, 3: text`` for the non-empty items, bounded in size."""
    groups: dict[str, list[int]] = {}
    for rank, text in enumerate(items):
        if text:
            groups.setdefault(text, []).append(rank)
    shown = [f"{name_ranks(ranks)}: {text if len(text) <= clip else text[:clip] + '...'}"
             for text, ranks in list(groups.items())[:limit]]
    more = len(groups) - limit
    return "; ".join(shown) + (f"; and {more} more" if more > 0 else "")


def _fail_if_any(comm: Comm, leader: LeaderSave | None, errors: list[str | None], step: str,
                 tag: str) -> None:
    """Collective: if any rank failed, leaders roll back and every rank raises the same error."""
    if not any(errors):
        return
    states = comm.all_gather_object(leader.roll_back() if leader is not None else None)
    where = [s for s in states if s]
    state = where[0] if len(set(where)) == 1 else _per_rank(states)  # one leader, or one per node
    raise CheckpointError(f"checkpoint save of tag {tag!r} failed while {step}: {_per_rank(errors)}. "
                          f"On disk: {state}.")


def write_tag(comm: Comm, job: TagWrite) -> Manifest | None:
    """Write ``job.files`` of every rank into ``job.tag`` and publish it atomically.

    collective: call on all ranks of ``comm``.

    Returns:
        The published manifest on leaders, None elsewhere.
    Raises:
        CheckpointError on every rank if any rank failed (disk full, permissions...): what the
            save created is removed first, and the message says what is on disk.
    """
    leader = LeaderSave(job.store, job.tag) if job.leader else None
    try:
        return _write_tag(comm, job, leader)
    except CheckpointError:
        raise
    except BaseException:
        # A collective failed (a peer died) or the thread was interrupted: a tag that every
        # leader has installed stays, anything before that is removed.
        if leader is not None:
            if leader.installed:
                _commit(leader, 0)
            else:
                leader.roll_back()
        raise


def _commit(leader: LeaderSave, keep_last: int) -> None:
    _, err = _attempt(lambda: leader.commit(keep_last))
    if err:  # the save itself is complete: a failed retention only leaves older tags
        log.warning("checkpoint tag %r is saved and complete, but deleting older tags "
                    "(keep_last=%d) failed: %s", leader.tag, keep_last, err)


def _write_tag(comm: Comm, job: TagWrite, leader: LeaderSave | None) -> Manifest | None:
    store, tag = job.store, job.tag
    err = _attempt(leader.begin)[1] if leader is not None else None
    _fail_if_any(comm, leader, comm.all_gather_object(err), f"creating {store.tmp_dir(tag)}", tag)

    def write_all() -> list[FileRecord]:
        own = [store.write(tag, name, obj, comm.rank) for name, obj in job.files.items()]
        if job.written is not None:
            job.written()
        return own + job.replicate(own) if job.replicate is not None else own

    records, err = _attempt(write_all)
    gathered = comm.all_gather_object((records, err))
    _fail_if_any(comm, leader, [e for _, e in gathered], "writing files", tag)
    all_records = [rec for recs, _ in gathered for rec in recs]
    if leader is not None:
        err = _attempt(lambda: leader.install(all_records, job.meta, job.save_latest,
                                              job.library_version))[1]
    # Every leader must have installed the tag before any commits: otherwise all roll back.
    _fail_if_any(comm, leader, comm.all_gather_object(err), "publishing it", tag)
    if leader is None:
        return None
    _commit(leader, job.keep_last)
    return leader.manifest


class Snapshot:
    """Copies a state tree to host memory, reusing the buffers of the previous copy.

    Only tensors are copied into pooled buffers (matched by position, dtype and shape): the first
    async save allocates, later ones just ``copy_``. Other leaves are deep-copied.
    """

    def __init__(self) -> None:
        self._pool: list[torch.Tensor] = []

    def take(self, obj: Any) -> Any:
        import copy

        fresh: list[torch.Tensor] = []

        def walk(x: Any) -> Any:
            if isinstance(x, torch.Tensor):
                i = len(fresh)
                buf = self._pool[i] if i < len(self._pool) else None
                src = x.detach()
                if buf is None or buf.dtype != src.dtype or buf.shape != src.shape:
                    buf = torch.empty_like(src, device="cpu", memory_format=torch.contiguous_format)
                buf.copy_(src)
                fresh.append(buf)
                return buf
            if isinstance(x, dict):
                items = {k: walk(v) for k, v in x.items()}
                return type(x)(items) if type(x) in (dict, OrderedDict) else items
            if isinstance(x, (list, tuple)) and type(x) in (list, tuple):
                return type(x)(walk(v) for v in x)
            if isinstance(x, Encoded):  # serialized later, from the copy
                return Encoded(walk(x.obj), x.encode)
            return copy.deepcopy(x)

        out = walk(obj)
        self._pool = fresh
        return out


class AsyncWriter:
    """Runs one save at a time on a background thread.

    ``submit`` first waits for the previous save; an error from a background save is raised by
    the next ``submit`` or ``wait`` (so it is never silently lost).
    """

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def submit(self, fn: Callable[[], Any]) -> None:
        self.wait()

        def run() -> None:
            try:
                fn()
            except BaseException as exc:  # surfaced on the next call
                self._error = exc

        self._thread = threading.Thread(target=run, name="dslaunch-ckpt-writer", daemon=False)
        self._thread.start()

    def wait(self) -> None:
        """Block until the pending save is done; raise its error, if any."""
        if self._thread is not None:
            with waiting("checkpoint save in the background"):  # it waits for the peers' writers
                self._thread.join()
            self._thread = None
        if self._error is not None:
            err, self._error = self._error, None
            if isinstance(err, CheckpointError):
                raise err
            raise CheckpointError(f"the previous asynchronous checkpoint save failed: "
                                  f"{type(err).__name__}: {err}") from err
