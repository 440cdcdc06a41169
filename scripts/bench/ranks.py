"""Shared by the benches that start their own ranks (``engine_bench``, ``zero3_bench``): a world
of worker processes running the bench script itself with torch.distributed's environment
contract, and the one ``RESULT`` line through which rank 0 reports every rank's values.

Not a bench (``run_all`` runs ``*_bench.py`` only); imported from the bench's own directory.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

from dslaunch.utils.ports import free_port

__all__ = ["report", "run_ranks", "slowest", "ratio_stats", "ratio_text", "timed_steps"]

_TAG = "RESULT "


def report(values: dict) -> None:
    """Worker side (collective): rank 0 prints every rank's ``values``; the group is destroyed."""
    import torch.distributed as dist

    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, values)
    if dist.get_rank() == 0:
        print(_TAG + json.dumps(out), flush=True)
    dist.destroy_process_group()


def timed_steps(engine: Any, batch: Callable[[], Any], warmup: int, steps: int,
                at_warmup: Callable[[], None] = lambda: None) -> tuple[list[float], list[float]]:
    """Train ``engine`` for ``warmup + steps`` steps on ``batch()``; ``at_warmup`` runs before the first
    timed step (reset counters there). Returns the timed steps' seconds and every step's loss."""
    times, losses = [], []
    for step in range(warmup + steps):
        if step == warmup:
            at_warmup()
        inputs = batch()
        start = time.perf_counter()
        loss = engine(inputs)
        engine.backward(loss)
        engine.step()
        if step >= warmup:
            times.append(time.perf_counter() - start)
        losses.append(float(loss))
    return times, losses


def run_ranks(script: str, argv: list[str], world: int, timeout: float, python: str = sys.executable,
              extra_env: dict[str, str] | None = None) -> tuple[list[dict] | None, str]:
    """Run ``script --worker *argv`` as ranks 0..world-1 on this host (gloo, one thread each), with
    ``python`` (another venv's, for a peer) and ``extra_env`` added to the environment.

    Returns:
        (each rank's reported values, "") or (None, why: a timeout or the end of rank 0's stderr).
    """
    port = free_port()
    procs = []
    for r in range(world):
        env = {**os.environ, "RANK": str(r), "WORLD_SIZE": str(world), "LOCAL_RANK": str(r),
               "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", **(extra_env or {})}
        procs.append(subprocess.Popen([python, script, "--worker", *argv], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    try:
        outs = [p.communicate(timeout=timeout) for p in procs]
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        return None, f"timed out after {timeout:.0f} s"
    for line in outs[0][0].splitlines():
        if line.startswith(_TAG):
            return json.loads(line[len(_TAG):]), ""
    return None, f"worker exited {procs[0].returncode}: {(outs[0][1] or outs[-1][1])[-3000:]}"


def slowest(res: list[dict], config: str) -> list[float]:
    """Per step, the slowest rank's time of ``config`` in one round (each rank reported a list)."""
    return [max(steps) for steps in zip(*(r[config] for r in res), strict=True)]


def ratio_stats(rounds: list[list[dict]], this: str, peer: str) -> dict:
    """``peer`` step time / ``this`` step time (> 1: ``this`` is faster), from rounds in which both
    took turns step by step: each round's ratio of medians, and the quartiles of the per-step
    ratios (step i of both ran back to back, under the same load) over all rounds."""
    per_round, paired = [], []
    for res in rounds:
        a, b = slowest(res, this), slowest(res, peer)
        per_round.append(statistics.median(b) / statistics.median(a))
        paired += [y / x for x, y in zip(a, b, strict=True)]
    q = statistics.quantiles(paired, n=4) if len(paired) > 1 else paired * 3
    return {"rounds": per_round, "q1": q[0], "median": q[1], "q3": q[2],
            "rounds_at_or_above_1": sum(r >= 1.0 for r in per_round)}


def ratio_text(s: dict) -> str:
    """``ratio_stats`` in a table cell: rounds, then the per-step median [q1-q3]."""
    rounds = " ".join(f"{r:.2f}" for r in s["rounds"])
    return f"{rounds} (steps {s['median']:.2f} [{s['q1']:.2f}-{s['q3']:.2f}])"
