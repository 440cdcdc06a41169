"""Fault recovery: a rank SIGKILLed mid-run, under dslaunch --max_restarts and its peers.

One 2-rank gloo job (plain torch.distributed, so every launcher runs the same script): each step
is an all_reduce and a short sleep; rank 0 records its step every few steps (the "checkpoint")
and a restarted run starts from it. In the first run rank 1 SIGKILLs itself at a fixed step,
after writing the time. Measured per trial:

- stop: kill -> the last worker of the first run is gone (psutil, polled every 5 ms);
- resume: kill -> the restarted run's first finished step (written by rank 0);
- success: the job exits 0 and its last step is the last one.

Launchers: ``dslaunch --max_restarts 1``, ``torchrun --max-restarts 1`` (``--standalone``), and
DeepSpeed's ``deepspeed`` launcher when it imports (no restarts: stop time only). Then a restart
loop of ``--loop`` trials per restarting launcher counts the successes.

Writes ``results/faults.json`` and ``results/faults.md`` (or to ``--out``).

Usage: ``python scripts/bench/faults.py [--trials 5] [--loop 50] [--peer-loop 20]
[--systems dslaunch,torchrun,deepspeed] [--out DIR]``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import psutil

HERE = Path(__file__).resolve().parent
BIN = Path(sys.executable).parent
TAG_VAR = "FAULTS_BENCH_TAG"
JOB_TIMEOUT_S = 120
LOOP_TIMEOUT_S = 60  # a loop job takes ~10 s here; past this its restart hangs

SCRIPT = """
import datetime, json, os, signal, sys, time
import torch
import torch.distributed as dist
args = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]  # dslaunch and deepspeed add it
steps, kill_at, work = int(args[0]), int(args[1]), args[2]
restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
rank = dist.get_rank()
ckpt = os.path.join(work, "step.json")
start = json.load(open(ckpt))["step"] if os.path.exists(ckpt) else 0
x = torch.ones(1024)
for step in range(start + 1, steps + 1):
    dist.all_reduce(x)
    if rank == 0 and restart > 0 and step == start + 1:
        open(os.path.join(work, "resumed"), "w").write(repr(time.time()))
    if rank == 0 and step % 5 == 0:
        open(ckpt + ".tmp", "w").write(json.dumps({"step": step}))
        os.replace(ckpt + ".tmp", ckpt)
    if rank == 1 and restart == 0 and step == kill_at:
        open(os.path.join(work, "killed"), "w").write(repr(time.time()))
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(0.05)
if rank == 0:
    open(os.path.join(work, "done"), "w").write(str(step))
dist.destroy_process_group()
"""


def _command(system: str, script: Path, steps: int, kill_at: int, work: Path) -> list[str]:
    args = [str(script), str(steps), str(kill_at), str(work)]
    if system == "dslaunch":
        return [str(BIN / "dslaunch"), "--num_gpus", "2", "--max_restarts", "1", *args]
    if system == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                "--max-restarts", "1", *args]
    return [str(BIN / "deepspeed"), "--num_gpus", "2", *args]  # no restarts: stop time only


def _first_run_workers(tag: str, script: str) -> list[psutil.Process]:
    found = []
    for p in psutil.process_iter(["pid"]):
        try:
            env = p.environ()
            if env.get(TAG_VAR) == tag and env.get("TORCHELASTIC_RESTART_COUNT", "0") == "0" \
                    and script in " ".join(p.cmdline()) and "RANK" in env and p.status() != psutil.STATUS_ZOMBIE:
                found.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def _read_time(path: Path) -> float | None:
    try:
        return float(path.read_text())
    except (OSError, ValueError):
        return None


def trial(system: str, steps: int = 40, kill_at: int = 20, measure: bool = True,
          timeout: float = JOB_TIMEOUT_S) -> dict:
    """One faulted job; ``measure`` polls for the stop time (the restart loop skips it). A job past
    ``timeout`` (a restart that hangs) is killed with its whole process group and fails."""
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        script = work / "job.py"
        script.write_text(SCRIPT)
        tag = uuid.uuid4().hex
        env = {**os.environ, TAG_VAR: tag, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
        proc = subprocess.Popen(_command(system, script, steps, kill_at, work), env=env, cwd=tmp,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)
        stopped = None
        deadline = time.monotonic() + timeout
        while measure and stopped is None and proc.poll() is None and time.monotonic() < deadline:
            if (work / "killed").exists() and not _first_run_workers(tag, str(script)):
                stopped = time.time()
            time.sleep(0.005)
        try:
            _, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            code = proc.returncode
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the launcher and the workers it left
            _, err = proc.communicate()
            code = "timeout"
        killed, resumed = _read_time(work / "killed"), _read_time(work / "resumed")
        done = (work / "done").read_text() if (work / "done").exists() else None
    return {"system": system, "exit_code": code, "success": code == 0 and done == str(steps),
            "stop_s": round(stopped - killed, 3) if stopped and killed else None,
            "resume_s": round(resumed - killed, 3) if resumed and killed else None,
            "tail": "" if code == 0 else (err or "")[-1500:]}


def _has(system: str) -> bool:
    if system == "deepspeed":
        return subprocess.run([sys.executable, "-c", "import deepspeed"], capture_output=True,
                              env={**os.environ, "DS_ACCELERATOR": "cpu"}).returncode == 0
    return True


def _median(values: list) -> str:
    got = [v for v in values if v is not None]
    return f"{statistics.median(got):.2f}" if got else "n/a"


def _markdown(timed: list[dict], loop: list[dict]) -> str:
    lines = ["## Fault recovery: a rank SIGKILLed mid-run (`scripts/bench/faults.py`)\n",
             "2 ranks, gloo, the same plain torch.distributed script under each launcher; rank 1 kills "
             "itself at step 20 of 40 in the first run; a restarted run resumes from the step rank 0 "
             "recorded last. stop = kill to the last worker of that run gone; resume = kill to the "
             "restarted run's first finished step. DeepSpeed's launcher has no restarts.\n",
             "| launcher | trials | stop s (median) | resume s (median) | finished |",
             "| --- | ---: | ---: | ---: | ---: |"]
    for system in dict.fromkeys(r["system"] for r in timed):
        rs = [r for r in timed if r["system"] == system]
        lines.append(f"| {system} | {len(rs)} | {_median([r['stop_s'] for r in rs])} | "
                     f"{_median([r['resume_s'] for r in rs])} | {sum(r['success'] for r in rs)} of {len(rs)} |")
    if loop:
        lines += ["", "Restart loop: the same fault, `--max_restarts 1` / `--max-restarts 1`, counting jobs "
                      "that finish every step (a job past 60 s is killed and counts as failed).\n",
                  "| launcher | trials | finished | failed runs' exit codes |", "| --- | ---: | ---: | --- |"]
        for system in dict.fromkeys(r["system"] for r in loop):
            rs = [r for r in loop if r["system"] == system]
            codes = ", ".join(str(r["exit_code"]) for r in rs if not r["success"]) or "-"
            lines.append(f"| {system} | {len(rs)} | {sum(r['success'] for r in rs)} of {len(rs)} | {codes} |")
    lines.append("\nTargets: job stopped < 0.5 s after the kill; first step after resume within 15 s; "
                 "restarts succeed 50 of 50.\n")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trials", type=int, default=5, help="timed trials per launcher")
    parser.add_argument("--loop", type=int, default=50, help="restart-loop trials of dslaunch")
    parser.add_argument("--peer-loop", type=int, default=20,
                        help="restart-loop trials of each restarting peer (its runs take longer here)")
    parser.add_argument("--systems", default="dslaunch,torchrun,deepspeed")
    parser.add_argument("--out", type=Path, default=HERE / "results")
    args = parser.parse_args(argv)
    systems = [s for s in args.systems.split(",") if _has(s) or print(f"{s}: not installed, skipped",
                                                                      file=sys.stderr)]
    timed, loop = [], []
    for i in range(args.trials):  # interleaved, so load changes hit every launcher alike
        for system in systems:
            timed.append(trial(system))
            print(f"timed {i + 1}/{args.trials} {timed[-1]}", flush=True)
            _write(args.out, timed, loop)  # after every trial: a run stopped early still reports
    counts = {s: args.loop if s == "dslaunch" else args.peer_loop for s in systems if s != "deepspeed"}
    for i in range(max(counts.values(), default=0)):  # interleaved while both still run
        for system in (s for s, n in counts.items() if i < n):
            loop.append(trial(system, steps=12, kill_at=7, measure=False, timeout=LOOP_TIMEOUT_S))
            print(f"loop {i + 1}/{counts[system]} {system} success={loop[-1]['success']}", flush=True)
            _write(args.out, timed, loop)
    return 0


def _write(out: Path, timed: list[dict], loop: list[dict]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "faults.json").write_text(json.dumps({"timed": timed, "loop": loop}, indent=1) + "\n")
    (out / "faults.md").write_text(_markdown(timed, loop))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
