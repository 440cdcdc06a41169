"""Fault recovery: a rank SIGKILLed or SIGSTOPped mid-run, under dslaunch --max_restarts and its peers.

One 2-rank gloo job (plain torch.distributed, so every launcher runs the same script): each step
is an all_reduce and a short sleep; rank 0 records its step every few steps (the "checkpoint")
and a restarted run starts from it. In the first run rank 1 faults itself at a fixed step, after
writing the time. Faults:

- ``kill``: SIGKILL (the rank dies: every launcher sees an exit);
- ``none``: no fault (the uninterrupted wall time the others are compared with);
- ``hang``: SIGSTOP (the rank is alive but makes no progress). dslaunch runs with
  ``--hang_timeout 8`` (the script reports its step with ``dslaunch.heartbeat``, a no-op under the
  peers); the peers can only notice when the survivor's collective times out (gloo timeout
  ``HANG_GLOO_TIMEOUT_S``, the script's ``init_process_group(timeout=...)``).

Measured per trial:

- stop: fault -> the last worker of the first run is gone (psutil, polled every 5 ms);
- resume: fault -> the restarted run's first finished step (written by rank 0);
- blamed: the rank(s) the launcher's report names as failed (the faulted one is rank 1);
- success: the job exits 0 and its last step is the last one;
- wall: the launcher's start to its exit; "extra" in the table = a fault's median wall time minus
  the same launcher's median without a fault (what the fault cost the job).

Launchers: ``dslaunch --max_restarts 1`` (restarted workers start in its warm spares;
``dslaunch-cold`` adds ``--no_warm_spares``), ``torchrun --max-restarts 1`` (``--standalone``), and
DeepSpeed's ``deepspeed`` launcher when it imports (no restarts: stop time only). Then a restart
loop of ``--loop`` trials per restarting launcher counts the successes (faults taken in turn from
``--loop-faults``).

Writes ``results/faults.json`` and ``results/faults.md`` (or to ``--out``).

Usage: ``python scripts/bench/faults.py [--trials 5] [--faults none,kill,hang] [--loop 50]
[--loop-faults kill,hang] [--peer-loop 20] [--systems dslaunch,torchrun,deepspeed] [--out DIR]
[--append]`` (``--append`` adds to the results already in ``--out``: a long set in several calls).
"""

from __future__ import annotations

import argparse
import json
import os
import re
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
KILL_GLOO_TIMEOUT_S = 60
HANG_GLOO_TIMEOUT_S = 30  # the peers' only way to see a hang; DeepSpeed's default is 30 min
HANG_TIMEOUT_S = 8  # dslaunch --hang_timeout (issue 25's setting)
FAULT_SIGNAL = {"kill": "SIGKILL", "hang": "SIGSTOP", "none": "SIGCONT"}  # none: never sent
# How each launcher's report names the failed rank. torchrun: its "Root Cause" entry. DeepSpeed:
# its "<cmd> exits with return code" line, whose cmd is the last rank it started, whatever failed.
BLAME = {"dslaunch": r"rank (\d+) on \S+ (?:hung|was killed|exited|died|raised)",
         "torchrun": r"Root Cause \(first observed failure\):\s*\[\d+\]:\s*time\s*:[^\n]*\n\s*host\s*:[^\n]*"
                     r"\n\s*rank\s*:\s*(\d+)",
         "deepspeed": r"--local_rank=(\d+)'[^\]\n]*\][^\n]*exits with return code"}

SCRIPT = """
import datetime, json, os, signal, sys, time
import torch
import torch.distributed as dist
args = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]  # dslaunch and deepspeed add it
steps, kill_at, work, sig, timeout = int(args[0]), int(args[1]), args[2], args[3], float(args[4])
restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
try:
    from dslaunch import heartbeat  # a no-op outside dslaunch
except ImportError:
    heartbeat = lambda step: None
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout))
rank = dist.get_rank()
ckpt = os.path.join(work, "step.json")
start = json.load(open(ckpt))["step"] if os.path.exists(ckpt) else 0
x = torch.ones(1024)
for step in range(start + 1, steps + 1):
    dist.all_reduce(x)
    heartbeat(step)
    if rank == 0 and restart > 0 and step == start + 1:
        open(os.path.join(work, "resumed"), "w").write(repr(time.time()))
        open(os.path.join(work, "resumed_world"), "w").write(str(dist.get_world_size()))
    if rank == 0 and step % 5 == 0:
        open(ckpt + ".tmp", "w").write(json.dumps({"step": step}))
        os.replace(ckpt + ".tmp", ckpt)
    if rank == 1 and restart == 0 and step == kill_at:
        open(os.path.join(work, "killed"), "w").write(repr(time.time()))
        os.kill(os.getpid(), getattr(signal, sig))
    time.sleep(0.05)
if rank == 0:
    open(os.path.join(work, "done"), "w").write(str(step))
dist.destroy_process_group()
"""


def _command(system: str, fault: str, script: Path, steps: int, kill_at: int, work: Path) -> list[str]:
    timeout = HANG_GLOO_TIMEOUT_S if fault == "hang" else KILL_GLOO_TIMEOUT_S
    kill_at = steps + 1 if fault == "none" else kill_at
    args = [str(script), str(steps), str(kill_at), str(work), FAULT_SIGNAL[fault], str(timeout)]
    if system.startswith("dslaunch"):
        hang = ["--hang_timeout", str(HANG_TIMEOUT_S)] if fault == "hang" else []
        cold = ["--no_warm_spares"] if system == "dslaunch-cold" else []
        return [str(BIN / "dslaunch"), "--num_gpus", "2", "--max_restarts", "1", *hang, *cold,
                "--log_dir", str(work / "logs"), *args]
    if system == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                "--max-restarts", "1", *args]
    return [str(BIN / "deepspeed"), "--num_gpus", "2", *args]  # no restarts: stop time only


def _workers(tag: str, script: str, first_run_only: bool = True) -> list[psutil.Process]:
    found = []
    for p in psutil.process_iter(["pid"]):
        try:
            env = p.environ()
            if env.get(TAG_VAR) == tag and (not first_run_only or env.get("TORCHELASTIC_RESTART_COUNT", "0") == "0") \
                    and script in " ".join(p.cmdline()) and "RANK" in env and p.status() != psutil.STATUS_ZOMBIE:
                found.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def _kill_leftovers(tag: str, script: str) -> int:
    """SIGKILL what a launcher left behind (a SIGSTOPped rank ignores SIGTERM until continued)."""
    left = _workers(tag, script, first_run_only=False)
    for p in left:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    return len(left)


def _read_time(path: Path) -> float | None:
    try:
        return float(path.read_text())
    except (OSError, ValueError):
        return None


def _blamed(system: str, err: str) -> list[int]:
    found = [next(g for g in m.groups() if g) for m in re.finditer(BLAME[system.split("-")[0]], err)]
    return sorted({int(r) for r in found})


def trial(system: str, fault: str = "kill", steps: int = 40, kill_at: int = 20, measure: bool = True,
          timeout: float = JOB_TIMEOUT_S) -> dict:
    """One faulted job; ``measure`` polls for the stop time (the restart loop skips it). A job past
    ``timeout`` (a restart that hangs) is killed with its whole process group and fails."""
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        script = work / "job.py"
        script.write_text(SCRIPT)
        tag = uuid.uuid4().hex
        env = {**os.environ, TAG_VAR: tag, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
        began = time.monotonic()
        proc = subprocess.Popen(_command(system, fault, script, steps, kill_at, work), env=env, cwd=tmp,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,  # DeepSpeed logs to stdout
                                start_new_session=True)
        stopped = None
        deadline = time.monotonic() + timeout
        while measure and stopped is None and proc.poll() is None and time.monotonic() < deadline:
            if (work / "killed").exists() and not _workers(tag, str(script)):
                stopped = time.time()
            time.sleep(0.005)
        try:
            err, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            code = proc.returncode
            wall = time.monotonic() - began
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the launcher and the workers it left
            err, _ = proc.communicate()
            code, wall = "timeout", None
        leftovers = _kill_leftovers(tag, str(script))
        killed, resumed = _read_time(work / "killed"), _read_time(work / "resumed")
        done = (work / "done").read_text() if (work / "done").exists() else None
    return {"system": system, "fault": fault, "exit_code": code, "blamed": _blamed(system, err or ""),
            "leftover_workers": leftovers, "success": code == 0 and done == str(steps),
            "stop_s": round(stopped - killed, 3) if stopped and killed else None,
            "resume_s": round(resumed - killed, 3) if resumed and killed else None,
            "wall_s": round(wall, 3) if wall is not None else None,
            "tail": "" if code == 0 else (err or "")[-1500:]}


def _has(system: str) -> bool:
    if system == "deepspeed":
        return subprocess.run([sys.executable, "-c", "import deepspeed"], capture_output=True,
                              env={**os.environ, "DS_ACCELERATOR": "cpu"}).returncode == 0
    return True


def _median(values: list) -> str:
    got = [v for v in values if v is not None]
    return f"{statistics.median(got):.2f}" if got else "n/a"


def _extra(walls: list, calm: list) -> str:
    """Median wall time with the fault minus the median without (the fault's cost)."""
    got, base = [w for w in walls if w is not None], [w for w in calm if w is not None]
    return f"{statistics.median(got) - statistics.median(base):.2f}" if got and base else "n/a"


def _markdown(timed: list[dict], loop: list[dict]) -> str:
    lines = ["## Fault recovery: a rank SIGKILLed or SIGSTOPped mid-run (`scripts/bench/faults.py`)\n",
             "2 ranks, gloo, the same plain torch.distributed script under each launcher; rank 1 faults "
             "itself at step 20 of 40 in the first run (kill: SIGKILL; hang: SIGSTOP); a restarted run "
             "resumes from the step rank 0 recorded last. stop = fault to the last worker of that run "
             "gone; resume = fault to the restarted run's first finished step; blamed = the ranks the "
             f"launcher's report names (rank 1 is right). Hang: dslaunch `--hang_timeout {HANG_TIMEOUT_S}`, "
             f"every launcher's script uses a gloo timeout of {HANG_GLOO_TIMEOUT_S} s (DeepSpeed's "
             "default is 30 min). DeepSpeed's launcher has no restarts. blamed `[]`: no failure reported "
             "(the restart finished); DeepSpeed's failure line names the last rank it started, whatever "
             "failed, which is rank 1 here.\n",
             "| launcher | fault | trials | stop s (median) | resume s (median) | wall s (median) | extra s | "
             "blamed | finished |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | --- | ---: |"]
    for system, fault in dict.fromkeys((r["system"], r.get("fault", "kill")) for r in timed):
        rs = [r for r in timed if r["system"] == system and r.get("fault", "kill") == fault]
        blamed = ", ".join(dict.fromkeys(str(r.get("blamed", "?")) for r in rs))
        calm = [r.get("wall_s") for r in timed if r["system"] == system and r.get("fault") == "none"]
        extra = _extra([r.get("wall_s") for r in rs], calm) if fault != "none" else "-"
        lines.append(f"| {system} | {fault} | {len(rs)} | {_median([r['stop_s'] for r in rs])} | "
                     f"{_median([r['resume_s'] for r in rs])} | {_median([r.get('wall_s') for r in rs])} | {extra} | "
                     f"{blamed} | {sum(r['success'] for r in rs)} of {len(rs)} |")
    if loop:
        lines += ["", "Restart loop: faults in turn, `--max_restarts 1` / `--max-restarts 1`, counting jobs "
                      f"that finish every step (a job past {LOOP_TIMEOUT_S} s is killed and counts as failed).\n",
                  "| launcher | fault | trials | finished | failed runs' exit codes |",
                  "| --- | --- | ---: | ---: | --- |"]
        for system, fault in dict.fromkeys((r["system"], r.get("fault", "kill")) for r in loop):
            rs = [r for r in loop if r["system"] == system and r.get("fault", "kill") == fault]
            codes = ", ".join(str(r["exit_code"]) for r in rs if not r["success"]) or "-"
            lines.append(f"| {system} | {fault} | {len(rs)} | {sum(r['success'] for r in rs)} of {len(rs)} | {codes} |")
    lines.append(f"\nTargets: job stopped < 0.5 s after a kill; a hang detected within --hang_timeout + 1 s "
                 f"(here {HANG_TIMEOUT_S + 1} s) with rank 1 named; first step after resume within 15 s of "
                 "the fault; restarts succeed 50 of 50; a SIGKILL restart's extra wall time < 8 s (issue 25).\n")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trials", type=int, default=5, help="timed trials per launcher")
    parser.add_argument("--loop", type=int, default=50, help="restart-loop trials of dslaunch")
    parser.add_argument("--peer-loop", type=int, default=20,
                        help="restart-loop trials of each restarting peer (its runs take longer here)")
    parser.add_argument("--systems", default="dslaunch,torchrun,deepspeed")
    parser.add_argument("--faults", default="none,kill,hang", help="faults of the timed trials")
    parser.add_argument("--loop-faults", default="kill,hang", help="faults of the restart loop, in turn")
    parser.add_argument("--out", type=Path, default=HERE / "results")
    parser.add_argument("--append", action="store_true", help="add to the results already in --out")
    args = parser.parse_args(argv)
    systems = [s for s in args.systems.split(",") if _has(s) or print(f"{s}: not installed, skipped",
                                                                      file=sys.stderr)]
    old = json.loads((args.out / "faults.json").read_text()) if args.append else {}
    timed, loop = old.get("timed", []), old.get("loop", [])
    faults = args.faults.split(",")
    loop_faults = args.loop_faults.split(",")
    for i in range(args.trials):  # interleaved, so load changes hit every launcher alike
        for fault, system in ((f, s) for f in faults for s in systems):
            timed.append(trial(system, fault))
            print(f"timed {i + 1}/{args.trials} {timed[-1]}", flush=True)
            _write(args.out, timed, loop)  # after every trial: a run stopped early still reports
    counts = {s: args.loop if s == "dslaunch" else args.peer_loop for s in systems if s != "deepspeed"}
    for i in range(max(counts.values(), default=0)):  # interleaved while both still run
        for system in (s for s, n in counts.items() if i < n):
            # the peers see a hang only after their gloo timeout (~60 s a run): they loop on kills only
            fault = loop_faults[i % len(loop_faults)] if system == "dslaunch" else "kill"
            loop.append(trial(system, fault, steps=12, kill_at=7, measure=False, timeout=LOOP_TIMEOUT_S))
            print(f"loop {i + 1}/{counts[system]} {system} {fault} success={loop[-1]['success']}", flush=True)
            _write(args.out, timed, loop)
    return 0


def _write(out: Path, timed: list[dict], loop: list[dict]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "faults.json").write_text(json.dumps({"timed": timed, "loop": loop}, indent=1) + "\n")
    (out / "faults.md").write_text(_markdown(timed, loop))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
