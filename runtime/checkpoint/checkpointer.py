"""Per-engine checkpoint machinery and the file names inside a tag.

Owns the ``Checkpointer`` each engine makes at its first save or load (the private gloo group
checkpoint collectives run on, the async writer, the host-memory snapshots and the gate that
makes the optimizer step wait for a snapshot copy), which rank leads each node, the names of
the files in a tag, and the RNG states saved per rank.
"""

from __future__ import annotations

import os
import random
import socket
import threading
import time
from typing import Any

import numpy as np
import torch

from dslaunch.runtime.checkpoint.writer import AsyncWriter, Comm, GroupComm, LocalComm, Snapshot

__all__ = ["MODULE_FILE", "zero_file", "rank_file", "Checkpointer", "rng_state",
           "set_rng_state"]

MODULE_FILE = "module.dsl"


def zero_file(rank: int) -> str:
    return f"zero_rank_{rank:05d}.dsl"


def rank_file(rank: int) -> str:
    return f"rank_{rank:05d}.dsl"


class Checkpointer:
    """Per-engine checkpoint machinery: the private comm group, the async writer, the snapshot."""

    def __init__(self) -> None:
        import torch.distributed as dist

        self.comm: Comm = GroupComm() if dist.is_available() and dist.is_initialized() else LocalComm()
        self.writer = AsyncWriter()
        self.snapshot, self.small_snapshot = Snapshot(), Snapshot()
        # Set while no async snapshot is being copied; the optimizer step waits for it.
        self.snapshot_done = threading.Event()
        self.snapshot_done.set()
        self._gated: set[int] = set()
        self.gate_wait_s = 0.0  # time optimizer steps spent waiting for snapshots (for benchmarks)
        node = os.environ.get("NODE_RANK") or socket.gethostname()
        nodes = self.comm.all_gather_object(node)
        self.node_leader = nodes.index(node) == self.comm.rank

    def gate(self, optimizer: Any) -> None:
        """Make ``optimizer.step()`` wait until the pending snapshot copy is complete."""
        if id(optimizer) not in self._gated:
            optimizer.register_step_pre_hook(lambda *_: self._wait_snapshot())
            self._gated.add(id(optimizer))

    def _wait_snapshot(self) -> None:
        if not self.snapshot_done.is_set():
            t0 = time.perf_counter()
            self.snapshot_done.wait()
            self.gate_wait_s += time.perf_counter() - t0


def rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"].clone())
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
