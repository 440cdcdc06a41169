#!/usr/bin/env python3
"""In-memory peer checkpoints: recovery from a lost host, memory vs storage, and the step-time
cost of the background snapshots, on the SSH test cluster (2 hosts x 2 ranks, gloo, CPU).

The job is ``memory_checkpoint_worker.py`` (ZeRO-1, AdamW): an MLP of ``--layers`` x Linear(H, H),
the worst case (little compute per byte of state), or a GPT-2-small-shaped transformer (124M).

- overhead: the same job without and with ``memory_checkpoint`` (every 5 steps, one replica);
  the mean and median step time of rank 0 over steps 3..N (a snapshot step counts with its share);
- gpt: the transformer (``--batch`` sequences of ``--seq`` tokens per rank) in one run whose blocks
  of 5 steps alternate snapshots on and off (an "on" block takes one snapshot and waits for it to
  finish: the block holds its whole cost); the overhead is the median over adjacent on/off pairs of
  the ratio of their wall times, and, as a bound that the machine's load cannot blur, the extra
  process CPU of an "on" block (all threads, mean over ranks) over the CPU of an "off" block;
- recovery: snapshots (or storage checkpoints, into a directory on disk) every 5 steps; when rank 0
  has finished step 12 every process of the second host is stopped and killed (and, for memory, its
  store removed: its RAM is gone); the elastic restart runs on the first host's 2 ranks. Measured:
  from the kill to the restarted run's first finished step (``recovery_s``), the restarted run's
  ``initialize()`` including the resume (``init_s``), the step resumed from and the steps lost.
  A storage checkpoint just written is still in the page cache: its read is a memory read too,
  so the difference is what the storage path costs beyond that (fsync'd write on save, checksums).

Writes ``results/memory_checkpoint_bench.{json,md}``. Needs root (the cluster); run it under
``flock /tmp/dslaunch-bench.lock flock /tmp/dslaunch-cluster.lock``.

Usage: ``python scripts/bench/memory_checkpoint_bench.py [--hidden 2048 --layers 30] [--steps 20]
[--pairs 2 --seq 512 --batch 1] [--only overhead|gpt|recovery]``.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
PY = sys.executable
WORKER = HERE / "memory_checkpoint_worker.py"
sys.path.insert(0, str(ROOT / "scripts" / "cluster"))
sys.path.insert(0, str(HERE))
import cluster as cluster_mod  # noqa: E402  (a script directory, not a package)
from host_faults import _host_processes, _signal_all  # noqa: E402

KILL_AFTER, EVERY = 12, 5
STEP = re.compile(r"step=(\d+) end=([\d.]+) dt=([\d.]+)(?: block=([\d.]+))?")
COPY = re.compile(r"shard_copy_s=([\d.]+)")
INIT = re.compile(r"init_s=([\d.]+) resumed_at=(\d+) world=(\d+)")
BLOCK = re.compile(r"block=(\d+) on=([01]) wall=([\d.]+) cpu=([\d.]+)")


class Job:
    def __init__(self, info: dict, state: Path, work: Path, model: list[str]) -> None:
        self.info, self.state, self.work, self.model = info, state, work, model
        self.first, self.second = (h["name"] for h in info["hosts"][:2])
        self.port = 29900

    def launch(self, name: str, steps: int, *extra: str, resume: str | None = None) -> subprocess.Popen:
        self.port += 1
        hostfile = self.work / "hostfile"
        hostfile.write_text(f"{self.first} slots=2\n{self.second} slots=2\n")
        cmd = [PY, "-m", "dslaunch.launcher.cli", "--hostfile", str(hostfile), "--launcher_args",
               f"-F {self.info['ssh_config']}", "--master_port", str(self.port), "--max_restarts", "1",
               "--elastic_training", "--min_elastic_nodes", "1", "--log_dir", str(self.work / f"logs_{name}"),
               *(["--resume_from", resume] if resume else []), str(WORKER), "--steps", str(steps), *self.model, *extra]
        return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=open(self.work / f"{name}.err", "w"),  # noqa: SIM115
                                text=True, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"},
                                start_new_session=True)

    def kill_second(self, memory_dir: str | None) -> float:
        sshd = int((self.state / self.second / "sshd.pid").read_text().split()[0])
        t = time.time()
        _signal_all(_host_processes(self.second, sshd), signal.SIGSTOP, signal.SIGKILL)
        if memory_dir is not None:  # its RAM is gone with it
            for store in glob.glob(os.path.join(memory_dir, "dslaunch-*", self.second)):
                shutil.rmtree(store)
        return t


def _lines(proc: subprocess.Popen, on_line=None, timeout: float = 1500) -> list[str]:
    out, deadline = [], time.monotonic() + timeout
    for line in proc.stdout:
        out.append(line)
        if on_line is not None:
            on_line(line)
        if time.monotonic() > deadline:
            os.killpg(proc.pid, signal.SIGKILL)
            break
    proc.wait()
    return out


def overhead(job: Job, steps: int, memory_dir: str) -> dict:
    result = {}
    for name, extra in (("none", ()), ("memory", ("--memory_every", str(EVERY), "--memory_dir", memory_dir))):
        proc = job.launch(f"overhead_{name}", steps, *extra)
        lines = _lines(proc)
        if proc.returncode:
            print(f"overhead run {name!r} failed ({proc.returncode}):", "".join(lines[-20:]),
                  (job.work / f"overhead_{name}.err").read_text()[-3000:], sep="\n", file=sys.stderr)
        rows = [m for line in lines if (m := STEP.search(line)) and int(m[1]) >= 3]
        dts = [float(m[3]) for m in rows]
        result[name] = {"exit_code": proc.returncode, "steps": len(dts),
                        "mean_step_s": round(statistics.mean(dts), 4) if dts else None,
                        "median_step_s": round(statistics.median(dts), 4) if dts else None}
        copy = [float(m[1]) for line in lines if (m := COPY.search(line))]
        if name == "memory" and rows:
            # a snapshot's blocking: starting it (its step) and the next optimizer step's wait for its copy
            per = [float(m[4] or 0) + (float(rows[i + 1][4] or 0) if i + 1 < len(rows) else 0.0)
                   for i, m in enumerate(rows) if int(m[1]) % EVERY == 0]
            result[name].update(snapshots=len(per), block_mean_s=round(statistics.mean(per), 4) if per else None,
                                block_max_s=round(max(per), 4) if per else None,
                                shard_copy_s=round(copy[0], 4) if copy else None)
    a, b = result["none"]["mean_step_s"], result["memory"]["mean_step_s"]
    result["overhead_mean_pct"] = round(100 * (b / a - 1), 2) if a and b else None
    a, b = result["none"]["median_step_s"], result["memory"]["median_step_s"]
    result["overhead_median_pct"] = round(100 * (b / a - 1), 2) if a and b else None
    return result


def interleaved(job: Job, pairs: int, seq: int, batch: int, memory_dir: str) -> dict:
    """The GPT job with snapshots on and off in alternating blocks (see the module docstring)."""
    proc = job.launch("gpt", 0, "--model", "gpt", "--seq", str(seq), "--batch", str(batch), "--pairs", str(pairs),
                      "--memory_every", str(EVERY), "--memory_dir", memory_dir)
    lines = _lines(proc)
    if proc.returncode:
        print(f"gpt run failed ({proc.returncode}):", "".join(lines[-20:]),
              (job.work / "gpt.err").read_text()[-3000:], sep="\n", file=sys.stderr)
    blocks = [(bool(int(m[2])), float(m[3]), float(m[4])) for line in lines if (m := BLOCK.search(line))]
    on = [b for b in blocks if b[0]]
    off = [b for b in blocks if not b[0]]
    ratios = [a[1] / b[1] for a, b in zip(on, off, strict=False)]  # the i-th of each: an adjacent pair
    extra = [a[2] - b[2] for a, b in zip(on, off, strict=False)]
    out = {"exit_code": proc.returncode, "seq": seq, "batch_per_rank": batch, "pairs": len(ratios),
           "blocks": [{"on": o, "wall_s": w, "cpu_s": c} for o, w, c in blocks]}
    if ratios:
        cpu_off = statistics.median(b[2] for b in off)
        out.update(block_wall_off_s=round(statistics.median(b[1] for b in off), 3),
                   block_wall_on_s=round(statistics.median(b[1] for b in on), 3),
                   overhead_pct=round(100 * (statistics.median(ratios) - 1), 2),
                   snapshot_cpu_s=round(statistics.median(extra), 3), block_cpu_off_s=round(cpu_off, 3),
                   cpu_bound_pct=round(100 * statistics.median(extra) / cpu_off, 2))
    return out


def recovery(job: Job, steps: int, source: str, memory_dir: str) -> dict:
    ckpt = str(job.work / "ckpt")
    extra = (("--memory_every", str(EVERY), "--memory_dir", memory_dir) if source == "memory"
             else ("--save_every", str(EVERY), "--ckpt", ckpt))
    proc = job.launch(f"recovery_{source}", steps, *extra, resume=ckpt)
    killed: list[float] = []

    def on_line(line: str) -> None:
        m = STEP.search(line)
        if m and int(m[1]) == KILL_AFTER and not killed:
            killed.append(job.kill_second(memory_dir if source == "memory" else None))

    lines = _lines(proc, on_line)
    text = "".join(lines)
    inits = INIT.findall(text)
    after = text.split("init_s=")[-1] if len(inits) > 1 else ""
    first = STEP.search(after)
    restarted = inits[1] if len(inits) > 1 else None
    said = re.search(r"dslaunch: resumed from ([a-z ]+) at step", text)
    return {"exit_code": proc.returncode, "killed_after_step": KILL_AFTER,
            "resumed_at": int(restarted[1]) if restarted else None, "world_after": int(restarted[2]) if restarted else None,
            "source": said[1] if said else ("storage" if restarted else None),
            "steps_lost": KILL_AFTER - int(restarted[1]) if restarted else None,
            "init_s": float(restarted[0]) if restarted else None,
            "recovery_s": round(float(first[2]) - killed[0], 3) if first and killed else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--pairs", type=int, default=2, help="GPT: on/off block pairs (5 steps a block)")
    ap.add_argument("--seq", type=int, default=512, help="GPT: tokens per sequence")
    ap.add_argument("--batch", type=int, default=1, help="GPT: sequences per rank and step")
    ap.add_argument("--only", choices=("overhead", "gpt", "recovery"), help="run one part (default: all)")
    args = ap.parse_args()
    state = cluster_mod.state_dir_default()
    info = cluster_mod.up(3, state)
    params = args.layers * (args.hidden * args.hidden + args.hidden)
    with tempfile.TemporaryDirectory(prefix="memckpt-bench-") as tmp, \
            tempfile.TemporaryDirectory(prefix="memckpt-bench-", dir="/dev/shm") as shm:
        work = Path(tmp)
        os.chmod(work, 0o755)
        job = Job(info, state, work, ["--hidden", str(args.hidden), "--layers", str(args.layers)])
        t0 = time.time()
        load_start = os.getloadavg()[0]
        results = {}
        if args.only in (None, "overhead"):
            results["overhead"] = overhead(job, args.steps, shm)
        if args.only in (None, "gpt"):
            results["gpt"] = interleaved(job, args.pairs, args.seq, args.batch, shm)
        if args.only in (None, "recovery"):
            results["recovery"] = {s: recovery(job, args.steps, s, shm) for s in ("memory", "storage")}
    load = os.getloadavg()
    out = {"params": params, "hosts": 2, "ranks_per_host": 2, "zero_stage": 1, "snapshot_every": EVERY,
           "machine": f"{platform.node()}, {os.cpu_count()} cores, load average {load_start:.1f} at the start, "
                      f"{load[0]:.1f} at the end",
           "duration_s": round(time.time() - t0, 1), **results}
    results_dir = HERE / "results"
    (results_dir / "memory_checkpoint_bench.json").write_text(json.dumps(out, indent=2) + "\n")
    (results_dir / "memory_checkpoint_bench.md").write_text(_table(out))
    print(_table(out))


def _table(r: dict) -> str:
    rows = [f"# memory_checkpoint_bench: 2 hosts x 2 ranks, ZeRO-1, snapshot every {r['snapshot_every']} steps "
            f"({r['machine']})", ""]
    if (o := r.get("overhead")) is not None:
        m = o["memory"]
        rows += [f"MLP, {r['params'] / 1e6:.0f}M parameters, one sample per rank and step:", "",
                 "| snapshots | mean step (s) | median step (s) |", "| --- | --- | --- |",
                 f"| none | {o['none']['mean_step_s']} | {o['none']['median_step_s']} |",
                 f"| memory, 1 replica | {m['mean_step_s']} | {m['median_step_s']} |",
                 f"| overhead | {o['overhead_mean_pct']}% | {o['overhead_median_pct']}% |", "",
                 f"Training thread blocked per snapshot (rank 0, {m.get('snapshots')} snapshots): mean "
                 f"{m.get('block_mean_s')} s, max {m.get('block_max_s')} s; one copy of its ZeRO shard into ready "
                 f"host buffers: {m.get('shard_copy_s')} s.", ""]
    if (g := r.get("gpt")) is not None and "overhead_pct" in g:
        rows += [f"GPT-2-small shape (124M parameters), {g['batch_per_rank']} x {g['seq']} tokens per rank and step, "
                 f"{g['pairs']} pairs of 5-step blocks:", "",
                 "| snapshots | block of 5 steps (s, median) | process CPU per rank (s, median) |", "| --- | --- | --- |",
                 f"| none | {g['block_wall_off_s']} | {g['block_cpu_off_s']} |",
                 f"| memory, 1 replica (one snapshot) | {g['block_wall_on_s']} | "
                 f"{round(g['block_cpu_off_s'] + g['snapshot_cpu_s'], 3)} |",
                 f"| overhead | {g['overhead_pct']}% (median of paired ratios) | {g['cpu_bound_pct']}% "
                 f"({g['snapshot_cpu_s']} s per snapshot) |", ""]
    if (rec := r.get("recovery")) is not None:
        rows += [f"Recovery (the MLP, {r['params'] / 1e6:.0f}M parameters):", "",
                 "| restore from | resumed at | steps lost | world after | restarted initialize() (s) | "
                 "kill -> first step (s) |", "| --- | --- | --- | --- | --- | --- |"]
        rows += [f"| {k} ({v['source']}) | {v['resumed_at']} | {v['steps_lost']} | {v['world_after']} | "
                 f"{v['init_s']} | {v['recovery_s']} |" for k, v in rec.items()]
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    main()
