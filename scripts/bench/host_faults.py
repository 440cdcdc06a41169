#!/usr/bin/env python3
"""Faults across hosts on the SSH test cluster: a remote rank killed, a host lost, a link cut.

The job of ``faults.py`` (plain torch.distributed, gloo, a step is an all_reduce and a 50 ms
sleep; rank 0 records its step every 5 steps and a restarted run starts from it), one rank on
each of two cluster hosts (``scripts/cluster/cluster.py``). When rank 0 has recorded step 20, the
bench faults the second host:

- ``rank_kill``: SIGKILL of that host's worker (a rank dies on another host);
- ``host_kill``: SIGSTOP then SIGKILL of every process that host's sshd started (the host is gone);
- ``link_cut``: its cable is taken down (``ip link set <host>v down``; up again after the trial).

Measured per trial (seconds from the fault):

- stop: every worker of the first run on the surviving host is gone (the job noticed and acted);
- detect: dslaunch's ``failure`` event ``detected_t`` (its event log; peers have none);
- resume: the restarted run's first finished step (written by rank 0);
- world: the restarted run's world size; success: the job exits 0 having run every step.

Launchers: ``dslaunch --max_restarts 1 --elastic_training --min_elastic_nodes 1 --hang_timeout 5``
(its SSH runner), and torchrun's elastic mode started over ssh on each host (``--nnodes 1:2
--rdzv-backend c10d --max-restarts 1``), which is what a torchrun user has for lost nodes. The
script's gloo timeout is 60 s. DeepSpeed's launcher has no restart or elastic path over pdsh
(its elastic agent needs torchrun's rendezvous), so it is not run here.

Writes ``results/host_faults.{json,md}``. Needs root (the cluster); run it alone on the machine
(``flock /tmp/dslaunch-cluster.lock``: the SSH tests share the cluster).

Usage: ``python scripts/bench/host_faults.py [--trials 3] [--faults rank_kill,host_kill,link_cut]
[--systems dslaunch,torchrun]``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import psutil

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
PY = sys.executable
sys.path.insert(0, str(ROOT / "scripts" / "cluster"))
import cluster as cluster_mod  # noqa: E402  (a script directory, not a package)
import faults  # noqa: E402  (the job script and its readers)

STEPS, FAULT_AT = 200, 20
GLOO_TIMEOUT_S = 60
JOB_TIMEOUT_S = 180


def _workers(script: str, netns: str | None = None, first_run_only: bool = True) -> list[psutil.Process]:
    """The job's worker processes (not launchers, agents or ssh), optionally only in one host."""
    in_ns = None
    if netns is not None:
        out = subprocess.run(["ip", "netns", "pids", netns], capture_output=True, text=True).stdout
        in_ns = {int(p) for p in out.split()}
    found = []
    for p in psutil.process_iter(["pid"]):
        try:
            argv = p.cmdline()
            if script not in argv or any("torch.distributed.run" in a or "dslaunch" in a for a in argv):
                continue
            if argv[0].endswith(("ssh", "bash", "sh")) or p.status() == psutil.STATUS_ZOMBIE:
                continue
            if in_ns is not None and p.pid not in in_ns:
                continue
            if first_run_only and p.environ().get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
                continue
            found.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def _kill_everything_of(script: str) -> None:
    for p in psutil.process_iter(["pid"]):
        try:
            if any(script in a for a in p.cmdline()):
                p.kill()
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue


def _host_processes(host: str, sshd_pid: int) -> list[int]:
    """Everything the host's sshd started (the job's side of the host), not other daemons there
    (the SLURM test bed runs a slurmd in the same namespace)."""
    out = subprocess.run(["ip", "netns", "pids", host], capture_output=True, text=True).stdout
    in_ns = {int(p) for p in out.split()}
    try:
        children = psutil.Process(sshd_pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []
    return [p.pid for p in children if p.pid in in_ns]


def _signal_all(pids: list[int], *signals: int) -> None:
    for sig in signals:
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass


class Bench:
    def __init__(self, info: dict, state: Path) -> None:
        self.info, self.state = info, state
        self.first, self.second = (h["name"] for h in info["hosts"][:2])
        self.master_addr = info["hosts"][0]["addr"]
        self.port = 29800

    def _next_port(self) -> str:
        self.port += 1  # a fresh port per trial: no TIME_WAIT surprises
        return str(self.port)

    def _args(self, script: Path, work: Path) -> list[str]:
        return [str(script), str(STEPS), "-1", str(work), "SIGKILL", str(GLOO_TIMEOUT_S)]

    def start(self, system: str, script: Path, work: Path) -> list[subprocess.Popen]:
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        out = open(work / "launcher.err", "w")  # noqa: SIM115  (closed with the trial's directory)
        if system == "dslaunch":
            hostfile = work / "hostfile"
            hostfile.write_text(f"{self.first} slots=1\n{self.second} slots=1\n")
            cmd = [PY, "-m", "dslaunch.launcher.cli", "--hostfile", str(hostfile), "--launcher_args",
                   f"-F {self.info['ssh_config']}", "--master_port", self._next_port(), "--max_restarts", "1",
                   "--elastic_training", "--min_elastic_nodes", "1", "--hang_timeout", "5",
                   "--log_dir", str(work / "logs"), *self._args(script, work)]
            return [subprocess.Popen(cmd, env=env, cwd=work, stdout=subprocess.DEVNULL, stderr=out,
                                     start_new_session=True)]
        endpoint = f"{self.master_addr}:{self._next_port()}"
        remote = ["env", "OMP_NUM_THREADS=1", "GLOO_SOCKET_IFNAME=eth0", PY, "-m", "torch.distributed.run",
                  "--nnodes", "1:2", "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint",
                  endpoint, "--rdzv-id", work.name, "--max-restarts", "1", *self._args(script, work)]
        return [subprocess.Popen(["ssh", "-F", self.info["ssh_config"], host, *remote], env=env, cwd=work,
                                 stdout=subprocess.DEVNULL, stderr=out, stdin=subprocess.DEVNULL,
                                 start_new_session=True)
                for host in (self.first, self.second)]

    def fault(self, kind: str, script: str) -> Callable[[], None]:
        """Apply the fault to the second host; returns what undoes it (after the trial)."""
        if kind == "rank_kill":
            _signal_all([p.pid for p in _workers(script, self.second)], signal.SIGKILL)
            return lambda: None
        if kind == "host_kill":
            sshd = int((self.state / self.second / "sshd.pid").read_text().split()[0])
            _signal_all(_host_processes(self.second, sshd), signal.SIGSTOP, signal.SIGKILL)
            return lambda: None
        cluster_mod.set_link(self.second, False)
        return lambda: cluster_mod.set_link(self.second, True)

    def trial(self, system: str, kind: str) -> dict:
        with tempfile.TemporaryDirectory(prefix="hostfaults-") as tmp:
            work = Path(tmp)
            os.chmod(work, 0o755)
            script = work / "job.py"
            script.write_text(faults.SCRIPT)
            procs = self.start(system, script, work)
            deadline = time.monotonic() + JOB_TIMEOUT_S
            undo, fault_t, stopped = None, None, None
            try:
                while time.monotonic() < deadline and any(p.poll() is None for p in procs):
                    if fault_t is None and _recorded_step(work) >= FAULT_AT and _workers(str(script), self.second):
                        fault_t = time.time()
                        undo = self.fault(kind, str(script))
                    elif fault_t is not None and stopped is None and not _workers(str(script), self.first):
                        stopped = time.time()
                    elif stopped is not None and procs[0].poll() is not None:
                        break
                    time.sleep(0.005)
                codes = [_wait(procs[0], deadline)] + [p.poll() for p in procs[1:]]
            finally:
                if undo is not None:
                    undo()
                _kill_everything_of(str(script))
                for p in procs:
                    if p.poll() is None:
                        os.killpg(p.pid, signal.SIGKILL)
            resumed = faults._read_time(work / "resumed")
            done = (work / "done").read_text() if (work / "done").exists() else None
            detected = _detected_t(work / "logs")
            err = (work / "launcher.err").read_text(errors="replace")
            world = (work / "resumed_world").read_text() if (work / "resumed_world").exists() else None
        return {"system": system, "fault": kind, "exit_code": codes[0], "success": codes[0] == 0 and done == str(STEPS),
                "stop_s": _since(stopped, fault_t), "detect_s": _since(detected, fault_t),
                "resume_s": _since(resumed, fault_t), "world_after": world,
                "tail": "" if codes[0] == 0 else err[-int(os.environ.get("HOST_FAULTS_TAIL", "1500")):]}


def _recorded_step(work: Path) -> int:
    try:
        return json.loads((work / "step.json").read_text())["step"]
    except (OSError, ValueError, KeyError):
        return -1


def _wait(proc: subprocess.Popen, deadline: float) -> int | str:
    try:
        return proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        return "timeout"


def _since(t: float | None, fault_t: float | None) -> float | None:
    return round(t - fault_t, 3) if t is not None and fault_t is not None else None


def _detected_t(log_dir: Path) -> float | None:
    for events in log_dir.glob("**/events.jsonl"):
        for line in events.read_text().splitlines():
            event = json.loads(line)
            if event.get("kind") == "failure":
                return event.get("detected_t")
    return None


def _markdown(rows: list[dict]) -> str:
    lines = ["## Faults across hosts (`scripts/bench/host_faults.py`)\n",
             "SSH test cluster (network-namespace hosts), one rank on each of two hosts, gloo, the job of "
             "`faults.py` (200 steps); when rank 0 has recorded step 20 the second host is faulted: its "
             "rank SIGKILLed (rank_kill), every process of it killed (host_kill), or its link cut "
             "(link_cut). stop = fault to the surviving host's workers gone; detect = dslaunch's failure "
             "event; resume = fault to the restarted run's first step; world = its world size. dslaunch: "
             "`--max_restarts 1 --elastic_training --min_elastic_nodes 1`; torchrun: elastic "
             f"(`--nnodes 1:2 --rdzv-backend c10d --max-restarts 1`). gloo timeout {GLOO_TIMEOUT_S} s.\n",
             "| launcher | fault | trials | stop s (median) | detect s (median) | resume s (median) | world after "
             "| finished |", "| --- | --- | ---: | ---: | ---: | ---: | --- | ---: |"]
    for system, kind in dict.fromkeys((r["system"], r["fault"]) for r in rows):
        rs = [r for r in rows if r["system"] == system and r["fault"] == kind]
        worlds = ", ".join(dict.fromkeys(str(r["world_after"]) for r in rs))
        lines.append(f"| {system} | {kind} | {len(rs)} | {faults._median([r['stop_s'] for r in rs])} | "
                     f"{faults._median([r['detect_s'] for r in rs])} | {faults._median([r['resume_s'] for r in rs])} "
                     f"| {worlds} | {sum(r['success'] for r in rs)} of {len(rs)} |")
    lines.append("\nTargets: a rank's death stops the job in < 1 s across hosts; a lost host (killed or cut "
                 "off) is detected in < 10 s.\n")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--faults", default="rank_kill,host_kill,link_cut")
    parser.add_argument("--systems", default="dslaunch,torchrun")
    parser.add_argument("--out", type=Path, default=HERE / "results")
    args = parser.parse_args(argv)
    state = cluster_mod.state_dir_default()
    bench = Bench(cluster_mod.up(3, state), state)
    rows: list[dict] = []
    for i in range(args.trials):  # interleaved: load drifts hit every launcher alike
        for kind in args.faults.split(","):
            for system in args.systems.split(","):
                rows.append(bench.trial(system, kind))
                print(f"{i + 1}/{args.trials} {json.dumps(rows[-1])[:400]}", flush=True)
                args.out.mkdir(parents=True, exist_ok=True)
                (args.out / "host_faults.json").write_text(json.dumps(rows, indent=1) + "\n")
                (args.out / "host_faults.md").write_text(_markdown(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
