"""Helpers the checkpoint tests share."""

from __future__ import annotations

from dslaunch.runtime.checkpoint.store import CheckpointStore, Manifest


def verify(store: CheckpointStore, tag: str) -> Manifest:
    """Read every file of ``tag`` as a load would (manifest, sizes, checksums); raise on the first
    bad one. The product never needs this: a load reads, and so checks, exactly what it uses."""
    manifest = store.manifest(tag)
    for name in sorted(manifest.files):
        store.read(tag, name, manifest)
    return manifest
