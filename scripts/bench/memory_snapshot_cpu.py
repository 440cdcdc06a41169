#!/usr/bin/env python3
"""CPU cost of in-memory peer snapshots, per rank and snapshot: 4 ranks on this machine as 2 "hosts"
x 2 ranks (hostnames patched, so every rank has a replica peer; gloo over loopback), ZeRO-1 +
AdamW on an MLP of ``LAYERS`` x Linear(H, H), a snapshot every 5 steps. Runs without and with
snapshots twice, alternating; prints each run's mean/median step time, the training thread's time
in ``snapshot()`` and in gate waits (per rank), rank 0's writer-thread CPU and CPU by thread name,
and the extra process CPU per rank per snapshot (mean of the two pairs). CPU seconds, unlike wall
time, stay comparable on a loaded machine.

Usage (repository root): ``OMP_NUM_THREADS=1 python scripts/bench/memory_snapshot_cpu.py 1536 12 15``
(H, LAYERS, STEPS).
"""

from __future__ import annotations

import os
import socket
import statistics
import sys
import tempfile
import time
from typing import Any

import torch

sys.path.insert(0, os.getcwd())
from tests.distributed import run_world  # noqa: E402  (the repository's test helpers)

EVERY = 5


def _thread_cpu() -> dict[str, float]:
    """CPU seconds of this process's live threads, summed by thread name."""
    out: dict[str, float] = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/self/task/{tid}/comm") as f:
                name = f.read().strip()
        except OSError:
            continue
        out[name] = round(out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK"), 2)
    return out


def _writer_cpu(acc: dict[str, float]) -> None:
    """Count the CPU time of every background save's thread into ``acc``."""
    from dslaunch.runtime.checkpoint import writer

    submit = writer.AsyncWriter.submit

    def counted(self: Any, fn: Any) -> None:
        def run() -> None:
            t = time.thread_time()
            try:
                fn()
            finally:
                acc["writer_thread"] = acc.get("writer_thread", 0.0) + time.thread_time() - t

        submit(self, run)

    writer.AsyncWriter.submit = counted


def job(rank: int, world: int, root: str, hidden: int, layers: int, steps: int, memory: bool) -> tuple:
    import dslaunch
    from dslaunch.runtime.checkpoint.memory import MemoryCheckpoint
    from dslaunch.runtime.config.memory_checkpoint import MemoryCheckpointConfig

    torch.set_num_threads(1)
    socket.gethostname = lambda: f"host{rank // 2}"
    acc: dict[str, float] = {}
    _writer_cpu(acc)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(hidden, hidden) for _ in range(layers)])
    engine, *_ = dslaunch.initialize(model=model, model_parameters=model.parameters(), config={
        "train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 1}, "steps_per_print": 10**6,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}})
    spent = [0.0]
    if memory:
        mem = MemoryCheckpoint(MemoryCheckpointConfig(enabled=True, interval=EVERY, dir=root),
                               engine.checkpoint_parts(), "job")
        snapshot = mem.snapshot

        def timed(parts: Any) -> None:
            t = time.perf_counter()
            snapshot(parts)
            spent[0] += time.perf_counter() - t

        mem.snapshot = timed
        engine.memory_checkpoint = mem
    dts = []
    cpu0 = time.process_time()
    for _ in range(steps):
        t = time.perf_counter()
        engine.backward(engine(torch.randn(1, hidden)).pow(2).mean())
        engine.step()
        dts.append(time.perf_counter() - t)
    gate = engine.checkpoint_parts().io.gate_wait_s if memory else 0.0
    engine.wait_for_checkpoint()
    if rank == 0:
        print(f"memory={memory} rank0 writer={ {k: round(v, 3) for k, v in acc.items()} } threads={_thread_cpu()}",
              flush=True)
    return dts, spent[0], gate, time.process_time() - cpu0


def main() -> None:
    hidden, layers, steps = (int(a) for a in sys.argv[1:4])
    cpus: dict[bool, list[float]] = {}
    for memory in (False, True, False, True):
        with tempfile.TemporaryDirectory(dir="/dev/shm") as d:
            res = run_world(job, 4, d, hidden, layers, steps, memory, timeout=900)
        dts = res[0][0][3:]
        cpus.setdefault(memory, []).append(statistics.mean(r[3] for r in res))
        print(f"memory={memory} mean={statistics.mean(dts):.3f} median={statistics.median(dts):.3f} "
              f"snapshot_call_s={[round(r[1], 3) for r in res]} gate_s={[round(r[2], 3) for r in res]} "
              f"load={os.getloadavg()[0]:.1f} cpu_per_rank={cpus[memory][-1]:.2f}", flush=True)
    extra = (statistics.mean(cpus[True]) - statistics.mean(cpus[False])) / (steps // EVERY)
    print(f"extra CPU per rank per snapshot: {extra:.3f} s", flush=True)


if __name__ == "__main__":
    main()
