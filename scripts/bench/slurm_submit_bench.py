#!/usr/bin/env python3
"""Submit to first training step on SLURM: ``dslaunch sbatch`` vs a hand-written sbatch + srun + torchrun.

The same job both ways on the test SLURM (``scripts/cluster/slurm.py``, brought up here if needed):
2 nodes x 2 ranks of ``tests/launcher/bin/ckpt_train.py`` (ZeRO-1, a small MLP; it prints
``rank0 step=1`` after its first optimizer step). Time = from starting the submit command to that
line appearing in the job's output file (polled every 20 ms), so it includes sbatch, scheduling,
the batch script, starting the ranks on both nodes, rendezvous, ``initialize`` and one step.

- dslaunch: ``dslaunch sbatch --nodes 2 --num_gpus 2 --gpus_per_node 0 --output F ckpt_train.py ...``;
- hand-written: the usual recipe, ``#SBATCH --nodes=2 --ntasks-per-node=1``, the first node of
  ``scontrol show hostnames`` as the rendezvous host, ``srun torchrun --nnodes 2 --nproc-per-node 2
  --rdzv-backend c10d --rdzv-endpoint <head>:29400 --rdzv-id $SLURM_JOB_ID ckpt_train.py ...``.

Runs alternate (dslaunch, hand-written, repeat), each after the previous job has left the queue;
medians are reported. Writes scripts/bench/results/slurm_submit_bench.{json,md}. Needs root.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "scripts" / "bench" / "results"
TRAIN = ROOT / "tests" / "launcher" / "bin" / "ckpt_train.py"
PY = sys.executable
sys.path.insert(0, str(ROOT / "scripts" / "cluster"))
import slurm as slurm_mod  # noqa: E402  (a script directory, not a package)

FIRST_STEP = re.compile(r"rank0 step=1(?!\d)")  # torchrun's ranks share a file: lines may run together


def _train_args(work: Path) -> list[str]:
    return [str(TRAIN), "--steps", "3", "--save_every", "1000", "--ckpt", str(work / "ckpt"),
            "--out", str(work / "w.pt"), "--sleep", "0.01"]


def _handwritten(work: Path, out: Path) -> str:
    torchrun = Path(PY).parent / "torchrun"
    return "\n".join([
        "#!/bin/bash", "#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=1", "#SBATCH --cpus-per-task=2",
        f"#SBATCH --output={out}", "export OMP_NUM_THREADS=1",
        'head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        f"srun {torchrun} --nnodes 2 --nproc-per-node 2 --rdzv-backend c10d --rdzv-endpoint $head:29400 "
        f"--rdzv-id $SLURM_JOB_ID {' '.join(_train_args(work))}", ""])


def _wait_first_step(out: Path, start: float, timeout: float = 180) -> float:
    while time.perf_counter() - start < timeout:
        if out.exists() and FIRST_STEP.search(out.read_text(errors="replace")):
            return time.perf_counter() - start
        time.sleep(0.02)
    raise SystemExit(f"bench: no first step in {out} within {timeout:g}s:\n{out.read_text()[-2000:] if out.exists() else ''}")


def _wait_gone(job: str, env: dict[str, str], timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state = subprocess.run(["squeue", "-h", "-j", job, "-o", "%T"], capture_output=True, text=True, env=env).stdout
        if not state.strip():
            return
        time.sleep(0.2)
    raise SystemExit(f"bench: job {job} still queued after {timeout:g}s")


def _submit(cmd: list[str], env: dict[str, str], cwd: Path, script: str | None = None) -> str:
    proc = subprocess.run(cmd, input=script, capture_output=True, text=True, env=env, cwd=cwd, timeout=60)
    m = re.search(r"(\d+)", proc.stdout)
    if proc.returncode != 0 or m is None:
        raise SystemExit(f"bench: {cmd[:3]} failed: {proc.stdout} {proc.stderr}")
    return m[1]


def _one(kind: str, work: Path, env: dict[str, str], n: int) -> float:
    out = work / f"{kind}-{n}.out"
    start = time.perf_counter()
    if kind == "dslaunch":
        job = _submit([PY, "-m", "dslaunch.launcher.cli", "sbatch", "--nodes", "2", "--num_gpus", "2",
                       "--gpus_per_node", "0", "--output", str(out), *_train_args(work)], env, work)
    else:
        job = _submit(["sbatch", "--parsable"], env, work, _handwritten(work, out))
    elapsed = _wait_first_step(out, start)
    _wait_gone(job, env)
    return elapsed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    if os.geteuid() != 0:
        raise SystemExit("bench: needs root for the test SLURM")
    state = slurm_mod.state_dir_default()
    st = slurm_mod.status(state)
    was_up = st["slurmctld"] and len(st["nodes"]) >= 3
    info = slurm_mod.up(3, state)
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("SLURM_")},
           "SLURM_CONF": info["slurm_conf"], "OMP_NUM_THREADS": "1"}
    times: dict[str, list[float]] = {"dslaunch": [], "handwritten": []}
    try:
        with tempfile.TemporaryDirectory(prefix="dsl-slurm-bench-") as tmp:
            for n in range(args.repeats):
                for kind in times:
                    times[kind].append(_one(kind, Path(tmp), env, n))
                print(f"repeat {n + 1}: " + ", ".join(f"{k} {v[-1]:.2f}s" for k, v in times.items()), flush=True)
    finally:
        if not was_up:
            slurm_mod.down(state)
    med = {k: statistics.median(v) for k, v in times.items()}
    RESULTS.mkdir(parents=True, exist_ok=True)
    report = {"benchmark": "slurm_submit_bench", "repeats": args.repeats, "seconds": times, "median": med,
              "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
              "loadavg_at_end": os.getloadavg()}
    (RESULTS / "slurm_submit_bench.json").write_text(json.dumps(report, indent=2) + "\n")
    md = "\n".join([
        f"### SLURM: submit to first training step, 2 nodes x 2 ranks (median of {args.repeats}; seconds)", "",
        "| dslaunch sbatch | sbatch + srun + torchrun (hand-written) | dslaunch / hand-written "
        "| best of each: dslaunch / hand-written |",
        "| --- | --- | --- | --- |",
        f"| {med['dslaunch']:.2f} | {med['handwritten']:.2f} | {med['dslaunch'] / med['handwritten']:.2f}x "
        f"| {min(times['dslaunch']):.2f} / {min(times['handwritten']):.2f} |", "",
        "From the submit command to `rank0 step=1` in the job's output file, on the namespace test SLURM "
        "(`scripts/cluster/slurm.py`: one slurmd per host, `sched_interval=2`). Shared 2-core machine: noisy; "
        f"load average at the end: {', '.join(f'{x:.1f}' for x in os.getloadavg())}.", ""])
    (RESULTS / "slurm_submit_bench.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
