"""The checkpoint directory: manifests, atomic publication, ``latest``, verification, retention.

Owns the layout of ``save_dir`` and every rule that makes it crash-consistent::

    save_dir/latest               the newest published tag (plain text, like DeepSpeed)
    save_dir/<tag>/manifest.json  what the tag holds (+ a CRC of the manifest itself)
    save_dir/<tag>/<files>        written by ``format.write_object``
    save_dir/.tmp-<tag>/          a tag being written; never read by the loader
    save_dir/.owner-<tag> ...     a save's other files (``publish``); never read

A tag is written into ``.tmp-<tag>``, every file fsynced, then the manifest (listing each file's
size and checksum) is written and fsynced, the directory is fsynced and renamed into place (an atomic
exchange when the tag already exists), the parent is fsynced, and only then ``latest`` is replaced
(temp file + ``os.replace`` + fsync). A process killed at any instant therefore leaves every
published tag intact and ``latest`` naming a complete one. The manifest doubles as the commit
record: a directory without a valid manifest is not a checkpoint.

The leader's steps (publication, rolling back a failed save, removing what killed saves left)
are ``publish``'s; this module reads, verifies and retains.

This module knows nothing about engines or ranks beyond file records; ``save_load.py`` decides
what goes into the files.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from dslaunch.errors import CheckpointArgumentError, CheckpointError, quote, shorten
from dslaunch.safe_write import atomic_path
from dslaunch.textfile import read_text

# ``format`` (the file format) imports torch, which reading ``latest`` and manifests does not need:
# imported where a file is read or written, so ``dslaunch zero-to-fp32`` checks its arguments
# against the directory (a missing tag, no checkpoint) before seconds of torch imports.
if TYPE_CHECKING:
    from dslaunch.runtime.checkpoint.format import FileDigest

__all__ = ["MANIFEST", "LATEST", "FileRecord", "Manifest", "CheckpointStore", "validate_tag",
           "write_atomic", "fsync_dir", "first_loadable", "summary"]

T = TypeVar("T")

MANIFEST = "manifest.json"
MANIFEST_MAX_BYTES = 256 * 2**20
"""A manifest lists every file with its checksum and the model's parameter names and shapes: a
few MiB for the largest models; more is no manifest this library wrote."""
LATEST = "latest"
_FORMAT = "dslaunch-checkpoint"
_FORMAT_VERSION = 2  # 2: a file's checksum may be "crc32c" (1: zlib "crc32" only)
_READABLE_VERSIONS = (1, 2)
_RESERVED = (".tmp-", ".trash-", ".old-", ".owner-", ".latest.tmp")
_NAME_MAX = 255  # bytes in one directory name (Linux): a longer tag can name no directory


@dataclass(frozen=True)
class FileRecord:
    """One file of a tag: who wrote it, its size and checksum (``algorithm``: crc32c or crc32)."""

    name: str
    rank: int
    size: int
    checksum: int
    algorithm: str = "crc32"

    @property
    def digest(self) -> FileDigest:
        from dslaunch.runtime.checkpoint.format import FileDigest

        return FileDigest(self.size, self.checksum, self.algorithm)

    def to_json(self) -> dict:
        return {"rank": self.rank, "size": self.size, self.algorithm: self.checksum}

    @classmethod
    def from_json(cls, name: str, entry: dict) -> FileRecord:
        algorithm = "crc32c" if "crc32c" in entry else "crc32"
        return cls(name, int(entry["rank"]), int(entry["size"]), int(entry[algorithm]), algorithm)


@dataclass(frozen=True)
class Manifest:
    """What a tag holds. ``meta`` is the caller's (world size, ZeRO stage, partition map...)."""

    tag: str
    created: float
    files: dict[str, FileRecord]
    meta: dict[str, Any] = field(default_factory=dict)
    library_version: str = ""

    def to_json(self) -> str:
        body = {"format": _FORMAT, "format_version": _FORMAT_VERSION, "tag": self.tag,
                "created": self.created, "library_version": self.library_version,
                "files": {n: r.to_json() for n, r in sorted(self.files.items())},
                "meta": self.meta}
        text = json.dumps(body, sort_keys=True)
        return json.dumps({"body": body, "crc32": zlib.crc32(text.encode())}, indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str, path: Path) -> Manifest:
        try:
            outer = json.loads(text)
            body = outer["body"]
            if zlib.crc32(json.dumps(body, sort_keys=True).encode()) != outer["crc32"]:
                raise CheckpointError("manifest checksum mismatch: the manifest is corrupt", str(path))
            if body.get("format") != _FORMAT or body.get("format_version") not in _READABLE_VERSIONS:
                raise CheckpointError(f"unsupported manifest format {body.get('format')!r} version "
                                      f"{body.get('format_version')!r}", str(path))
            files = {n: FileRecord.from_json(n, r) for n, r in body["files"].items()}
            return cls(tag=str(body["tag"]), created=float(body["created"]), files=files,
                       meta=dict(body["meta"]), library_version=str(body["library_version"]))
        except CheckpointError:
            raise
        except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as exc:
            # RecursionError: JSON nested deeper than the parser's stack
            raise CheckpointError(f"manifest is unreadable ({type(exc).__name__}: {shorten(str(exc), 200)})",
                                  str(path)) from exc


def fsync_dir(path: Path, durable: bool = True) -> None:
    if not durable:
        return
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, write: Callable[[Path], Any], durable: bool = True,
                 tmp: Path | None = None) -> None:
    """``write(tmp)`` beside ``path``, fsync it, rename it over ``path``, fsync the directory:
    a crash leaves the old file or the new one, never half of one (``durable=False``: no fsync).
    A failure before the rename removes ``tmp`` (default ``.<name>.<random>.tmp``) and leaves
    ``path`` as it was. By ``safe_write``'s rule (``atomic_path``): ``tmp`` is created
    exclusively in a directory no other user controls, and a link at ``path`` is replaced.

    Raises:
        UnsafePath: the directory is another user's or writable by all (names it).
    """
    with atomic_path(path, tmp.name if tmp is not None else None, durable=durable) as fresh:
        write(fresh)


def validate_tag(tag: str) -> str:
    """A tag must be one plain directory name; raises CheckpointArgumentError otherwise."""
    if (problem := tag_problem(tag)) is not None:
        raise CheckpointArgumentError(problem)
    return tag


def tag_problem(tag: str) -> str | None:
    """Why ``tag`` is no plain directory name (one line), or None when it is one."""
    if (not tag or "/" in tag or "\\" in tag or "\0" in tag or tag in (".", "..", LATEST)
            or tag.startswith(_RESERVED) or tag != tag.strip() or len(tag.encode(errors="replace")) > _NAME_MAX):
        return (f"invalid checkpoint tag {quote(tag)}: use one directory name (at most {_NAME_MAX} bytes) "
                f"without '/', not '{LATEST}' and not starting with {', '.join(_RESERVED)}")
    return None


def save_dir_problem(save_dir: object) -> str | None:
    """Why ``save_dir`` cannot be saved into (one line), or None: it must be a non-empty path
    (str or os.PathLike) that is a directory or does not exist yet."""
    if save_dir is None or not isinstance(save_dir, (str, os.PathLike)):
        return f"save_dir must be a directory path, got {type(save_dir).__name__}"
    path = os.fspath(save_dir)
    if isinstance(path, bytes):
        path = path.decode(errors="replace")
    if not path:
        return "save_dir is empty; give the directory to save into"
    if "\0" in path:
        return f"save_dir {quote(path)} holds a NUL character"
    if os.path.exists(path) and not os.path.isdir(path):
        return f"save_dir {quote(path)} is not a directory"
    return None


class CheckpointStore:
    """One ``save_dir``: write tags atomically, find and verify them, apply retention.

    Writing is split so several ranks can share it: every rank calls ``write`` for its own files
    into ``tmp_dir``, which the leader's ``publish.LeaderSave`` creates and publishes.
    """

    def __init__(self, root: str | os.PathLike, durable: bool = True, reuse_from: Path | None = None):
        """``durable=False`` skips every fsync (``checkpoint.fsync: false``): the order of the
        steps, and so the safety against a killed process, stays; a power loss may tear the
        newest tag, which loading then detects by its checksums. ``reuse_from``: a directory (an
        older tag) whose file of the same name each ``write`` takes over and overwrites, reusing
        its pages (memory snapshots on a tmpfs); a new file where it has none."""
        self.root = Path(root)
        self.durable = durable
        self.reuse_from = reuse_from

    # ---- writing -------------------------------------------------------------------------
    def tmp_dir(self, tag: str) -> Path:
        return self.root / f".tmp-{tag}"

    def write(self, tag: str, name: str, obj: Any, rank: int = 0) -> FileRecord:
        """Any rank: write one file of ``tag`` (fsynced) and return its record."""
        from dslaunch.runtime.checkpoint import format

        reuse = self.reuse_from / name if self.reuse_from is not None else None
        digest = format.write_object(self.tmp_dir(tag) / name, obj, self.durable, reuse)
        return FileRecord(name, rank, digest.size, digest.checksum, digest.algorithm)

    def discard(self, path: Path) -> None:
        """Delete a directory of ``save_dir``, renamed to ``.trash-*`` first so a crash mid-delete
        never leaves a half-deleted directory under a name the loader reads."""
        trash = self.root / f".trash-{uuid.uuid4().hex[:12]}"
        os.rename(path, trash)
        shutil.rmtree(trash, ignore_errors=True)

    # ---- reading -------------------------------------------------------------------------
    def read_latest(self) -> tuple[str | None, str]:
        """The tag ``latest`` names and "" , or (None, why not)."""
        path = self.root / LATEST
        try:
            if not path.is_file():
                return None, f"{path} does not exist"
            with open(path, "rb") as f:
                raw = f.read(4 * _NAME_MAX)  # a tag is one directory name: no need to read more
            tag = raw.decode().strip()
            validate_tag(tag)
        except OSError as exc:
            return None, f"{path} is unreadable ({exc.strerror or exc})"
        except (UnicodeDecodeError, CheckpointError):
            return None, f"{path} is corrupt (does not hold a valid tag name)"
        return tag, ""

    def manifest(self, tag: str) -> Manifest:
        """The manifest of ``tag``; raises CheckpointError naming what is missing or corrupt."""
        validate_tag(tag)  # also keeps a tag like '../..' inside the save_dir
        tag_dir = self.root / tag
        path = tag_dir / MANIFEST
        try:
            if not tag_dir.is_dir():
                raise CheckpointError(f"no checkpoint tag {quote(tag)} here{self._known_tags_hint()}",
                                      str(tag_dir))
            if not path.exists():
                raise CheckpointError("manifest is missing: this is not a complete dslaunch checkpoint",
                                      str(path))
            text = read_text(path, MANIFEST_MAX_BYTES, lambda message, line: CheckpointError(
                f"manifest is unreadable ({message.removeprefix('cannot read: ')}"
                f"{f', line {line}' if line else ''})", str(path)))
        except (OSError, UnicodeDecodeError) as exc:
            why = exc.strerror if isinstance(exc, OSError) and exc.strerror else shorten(str(exc), 200)
            raise CheckpointError(f"manifest is unreadable ({why})", str(path)) from exc
        return Manifest.from_json(text, path)

    def read(self, tag: str, name: str, manifest: Manifest) -> Any:
        """Read and verify one file of ``tag`` (size + checksum from the manifest)."""
        rec = manifest.files.get(name)
        if rec is None:
            raise CheckpointError(f"the manifest of tag {tag!r} lists no file {name!r}",
                                  str(self.root / tag / MANIFEST))
        from dslaunch.runtime.checkpoint import format

        return format.read_object(self.root / tag / name, rec.digest)

    def tags(self) -> list[Manifest]:
        """Published tags with a readable manifest, newest first (files not verified)."""
        found = []
        try:
            if not self.root.is_dir():
                return found
            entries = [e for e in self.root.iterdir() if e.is_dir() and not e.name.startswith(_RESERVED)]
        except OSError as exc:
            raise CheckpointError(f"cannot list the directory ({exc.strerror or exc})", str(self.root)) from exc
        for entry in entries:
            try:
                found.append(self.manifest(entry.name))
            except CheckpointError:
                continue
        return sorted(found, key=lambda m: (m.created, m.tag), reverse=True)

    def candidates(self) -> tuple[list[str], list[str]]:
        """Tags to try when the caller named none: ``latest`` first, then newest first.

        Returns:
            (tags, notes): notes say why ``latest`` was not usable, for the fallback message.
        """
        latest, why = self.read_latest()
        notes = [why] if why else []
        ordered = [m.tag for m in self.tags()]
        if latest is not None:
            if latest in ordered:
                ordered.remove(latest)
            ordered.insert(0, latest)
        return ordered, notes

    def _known_tags_hint(self) -> str:
        tags = [m.tag for m in self.tags()][:5]
        return f" (tags found: {', '.join(tags)})" if tags else ""

    # ---- retention -----------------------------------------------------------------------
    def retain(self, keep_last: int, protect: set[str]) -> list[str]:
        """Delete all but the newest ``keep_last`` tags, never ``protect`` or ``latest``'s tag.

        Only directories with a valid manifest are considered (nothing else in ``save_dir`` is
        ever deleted). A doomed tag is first renamed to ``.trash-*`` so a crash mid-delete never
        leaves a half-deleted directory that looks like a checkpoint. Returns the deleted tags.
        """
        latest, _ = self.read_latest()
        keep = set(protect) | ({latest} if latest else set())
        tags = [m.tag for m in self.tags()]
        keep |= set(tags[:keep_last])
        removed = []
        for tag in tags:
            if tag in keep:
                continue
            self.discard(self.root / tag)
            removed.append(tag)
        return removed


def first_loadable(tags: list[str], load: Callable[[str], T]) -> tuple[str, T, list[str]] | None:
    """Try ``load(tag)`` for each tag in order; the first that does not raise CheckpointError wins.

    Returns:
        (tag, what load returned, one line per skipped tag saying why), or None when ``tags`` is
        empty.
    Raises:
        CheckpointError listing every tag's problem when none loads: a directory full of broken
        checkpoints is an error, never a silent fresh start.
    """
    skipped: list[str] = []
    for tag in tags:
        try:
            return tag, load(tag), skipped
        except CheckpointError as exc:
            skipped.append(f"tag {tag!r}: {exc}")
    if skipped:
        raise CheckpointError("no loadable checkpoint: " + summary(skipped))
    return None


def summary(problems: list[str], shown: int = 3) -> str:
    """The first ``shown`` problems and how many more: a directory of 10,000 broken tags is one line."""
    more = f"; and {len(problems) - shown} more" if len(problems) > shown else ""
    return "; ".join(problems[:shown]) + more
