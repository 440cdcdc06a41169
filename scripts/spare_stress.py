"""Stress the warm-spare restart path: many SIGKILL restarts of a 2-rank gloo job on one node.

Each run is started the way the local runner starts one (an in-process ``Agent`` that adopts
orphans, handed the job's ``SparePool``, which is refilled after the start), without the restart
backoff, so that many restarts fit in minutes. In every run but the last, rank 1 SIGKILLs itself
after a random pause (0-``--max-pause`` s: the next run's spares are then still importing torch
or already waiting), and rank 0 fails on the lost peer. Every ``--kill-spare-every``-th run a
waiting spare is SIGKILLed just before the run starts (a spare that dies while idle).

Checked per run, and counted:

- hangs: the run did not end within ``--run-timeout`` s (its workers are then killed);
- broken pipes: hand-off reports naming a broken pipe (the agent's "started fresh" line);
- fallbacks: restarted ranks that ran in a fresh interpreter although their spare was alive (a
  run where a spare was killed on purpose may have one, and says so in its own column);
- wrong: a rank whose printed identity is not its own: its ``RANK`` is not its gloo rank, its pid
  is not the one the agent started for that rank, two ranks of a run name the same spare, or a
  spare (its token, from its command line) is used twice over the whole stress.

Exit code 0 when every count but the expected fallbacks is 0. ``--hogs N`` keeps N busy-looping
processes running meanwhile (the machine under load).

Usage: ``python scripts/spare_stress.py [--restarts 50] [--hogs 2] [--json out.json]``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from dslaunch.launcher.agent.node import Agent
from dslaunch.launcher.agent.spare import SparePool
from dslaunch.launcher.spec import NodeSpec, WorkerSpec
from dslaunch.launcher.workerenv import node_env, worker_env
from dslaunch.utils.ports import free_port

JOB = """
import datetime, os, signal, sys, time
warm = "torch" in sys.modules  # imported before this script started: a spare
import torch
import torch.distributed as dist
run, pause = int(sys.argv[1]), float(sys.argv[2])
cmd = open("/proc/self/cmdline", "rb").read().split(b"\\0")
at = cmd.index(b"dslaunch.launcher.agent.spare") if b"dslaunch.launcher.agent.spare" in cmd else -1
spare = "-" if at < 0 else (cmd[at + 3] if len(cmd) > at + 4 else str(os.getpid()).encode()).decode()
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
rank = dist.get_rank()
print(f"STRESS run={run} rank={rank} env_rank={os.environ['RANK']} pid={os.getpid()} warm={warm} "
      f"spare={spare}", flush=True)
t = torch.ones(1)
dist.all_reduce(t)
assert t.item() == dist.get_world_size()
if pause >= 0 and rank == 1:
    time.sleep(pause)
    os.kill(os.getpid(), signal.SIGKILL)
dist.barrier()
dist.destroy_process_group()
"""
LINE = re.compile(r"STRESS run=(\d+) rank=(\d+) env_rank=(\d+) pid=(\d+) warm=(\w+) spare=(\S+)")


def _node(job: str, run: int, pause: float) -> NodeSpec:
    port = free_port()
    workers = tuple(WorkerSpec(r, r, (sys.executable, "-u", job, str(run), f"{pause:.2f}"), worker_env(r, r))
                    for r in range(2))
    env = {**node_env("127.0.0.1", port, 2, 0, 1, (0, 1), False), "OMP_NUM_THREADS": "1"}
    return NodeSpec(0, "localhost", workers, env=env, grace=2.0)


def one_run(pool: SparePool, job: str, run: int, pause: float, timeout: float, kill_spare: bool) -> dict:
    """One run as the local runner starts it; its facts (see the module docstring)."""
    killed = None
    if kill_spare and (waiting := sorted(pool.pids())):
        killed = waiting[0]
        os.kill(killed, signal.SIGKILL)
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        agent = Agent(_node(job, run, pause), stdout_fd=out.fileno(), stderr_fd=err.fileno(),
                      adopt_orphans=True, spares=pool)
        started = time.monotonic()
        agent.start()
        pids = dict(zip((0, 1), agent.pids, strict=True))
        pool.fill(2)
        result = agent.wait(timeout)
        hung = result is None
        if hung:
            agent.stop(signal.SIGKILL)
            agent.wait(10)
        took = time.monotonic() - started
        out.seek(0)
        err.seek(0)
        text, errors = out.read().decode(errors="replace"), err.read().decode(errors="replace")
    seen = {int(m[2]): m for m in LINE.finditer(text)}
    wrong = [f"rank {r}: RANK={m[3]} pid={m[4]} (agent: {pids.get(r)})" for r, m in seen.items()
             if int(m[3]) != r or int(m[4]) != pids.get(r)]
    spares = [m[6] for m in seen.values() if m[6] != "-"]
    if len(set(spares)) != len(spares):
        wrong.append(f"one spare ran two ranks: {spares}")
    fresh = [r for r, m in seen.items() if m[5] != "True"] if run else []
    return {"run": run, "pause": pause, "s": round(took, 2), "hung": hung, "ranks": sorted(seen),
            "fresh": fresh, "spares": spares, "wrong": wrong, "spare_killed": killed,
            "broken_pipe": errors.count("Broken pipe") + errors.count("BrokenPipe"),
            "reports": [line for line in errors.splitlines() if line.startswith("dslaunch:")],
            "tail": errors[-800:] if hung or wrong else ""}


def summarize(runs: list[dict]) -> dict:
    """The counts the stress is judged by (all but ``expected_fallbacks`` must be 0)."""
    tokens = [t for r in runs for t in r["spares"]]
    restarted = [r for r in runs if r["run"]]
    return {
        "restarts": len(restarted),
        "hangs": sum(r["hung"] for r in runs),
        "broken_pipes": sum(r["broken_pipe"] for r in runs),
        "fallbacks": sum(len(r["fresh"]) for r in restarted if r["spare_killed"] is None),
        "expected_fallbacks": sum(len(r["fresh"]) for r in restarted if r["spare_killed"] is not None),
        "missing_ranks": sum(r["ranks"] != [0, 1] for r in runs if not r["hung"]),
        "wrong": sum(len(r["wrong"]) for r in runs) + len(tokens) - len(set(tokens)),
        "warm_ranks": sum(2 - len(r["fresh"]) for r in restarted),
        "median_run_s": sorted(r["s"] for r in runs)[len(runs) // 2] if runs else None,
    }


def _write(path: Path, runs: list[dict], hogs: int) -> dict:
    counts = {**summarize(runs), "load_avg": round(os.getloadavg()[0], 2), "hogs": hogs}
    path.write_text(json.dumps({"counts": counts, "runs": runs}, indent=1) + "\n")
    return counts


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--restarts", type=int, default=50)
    parser.add_argument("--max-pause", type=float, default=2.0, help="rank 1 dies 0 to this many s in")
    parser.add_argument("--kill-spare-every", type=int, default=10, help="0: never kill a waiting spare")
    parser.add_argument("--run-timeout", type=float, default=90.0)
    parser.add_argument("--hogs", type=int, default=0, help="busy-looping processes meanwhile")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    rng = random.Random(args.seed)
    hogs = [subprocess.Popen([sys.executable, "-c", "while 1: pass"]) for _ in range(args.hogs)]
    pool = SparePool(os.environ)
    runs: list[dict] = []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            job = os.path.join(tmp, "job.py")
            Path(job).write_text(JOB)
            for run in range(args.restarts + 1):
                pause = -1.0 if run == args.restarts else round(rng.uniform(0, args.max_pause), 2)
                kill = bool(args.kill_spare_every) and run > 0 and run % args.kill_spare_every == 0
                runs.append(one_run(pool, job, run, pause, args.run_timeout, kill))
                r = runs[-1]
                print(f"run {run}: {r['s']} s fresh={r['fresh']} spare_killed={r['spare_killed']} "
                      f"hung={r['hung']} wrong={r['wrong']} reports={r['reports']}{r['tail']}", flush=True)
                if args.json:  # after every run: a stress stopped early still reports
                    _write(args.json, runs, args.hogs)
    finally:
        pool.close()
        for hog in hogs:
            hog.kill()
            hog.wait()
    counts = _write(args.json, runs, args.hogs) if args.json else summarize(runs)
    print(json.dumps(counts), flush=True)
    bad = ("hangs", "broken_pipes", "fallbacks", "missing_ranks", "wrong")
    return 0 if all(counts[k] == 0 for k in bad) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
