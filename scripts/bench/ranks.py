"""Shared by the benches that start their own ranks (``engine_bench``, ``zero3_bench``): a world
of worker processes running the bench script itself with torch.distributed's environment
contract, and the one ``RESULT`` line through which rank 0 reports every rank's values.

Not a bench (``run_all`` runs ``*_bench.py`` only); imported from the bench's own directory.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from dslaunch.utils.ports import free_port

__all__ = ["report", "run_ranks"]

_TAG = "RESULT "


def report(values: dict) -> None:
    """Worker side (collective): rank 0 prints every rank's ``values``; the group is destroyed."""
    import torch.distributed as dist

    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, values)
    if dist.get_rank() == 0:
        print(_TAG + json.dumps(out), flush=True)
    dist.destroy_process_group()


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
