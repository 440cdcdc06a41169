#!/usr/bin/env python3
"""Launch time over SSH: dslaunch vs DeepSpeed's pdsh launcher vs the floor, for 1, 2, 3 hosts.

Launch time = from starting the command to every rank having passed a barrier (and an
all_reduce) and exited: the wall time of ``scripts/examples/allreduce.py`` run as one job over
the test cluster (``scripts/cluster/cluster.py``, brought up here if needed).

- dslaunch: ``dslaunch --hostfile H --launcher_args '-F <cluster ssh_config>' allreduce.py``;
- DeepSpeed: ``deepspeed --hostfile H --launcher pdsh --force_multi --no_ssh_check --master_addr
  <first host>`` (Debian pdsh; ``PDSH_SSH_ARGS_APPEND=-F <ssh_config>`` lets its ssh find the
  cluster; ``--force_multi`` so that one host also goes through pdsh instead of running here);
- floor: the same number of ``python -c 'import torch'`` started over plain ``ssh -F`` in
  parallel (what any launcher must at least pay: logins plus one torch import per rank).

Both launchers run from a scratch directory whose ``.deepspeed_env`` sets OMP_NUM_THREADS=1 (both
read it). Runs are interleaved (dslaunch, DeepSpeed, floor, repeat) so machine load drifts affect
all three alike; medians are reported. Timings are noisy on a shared 2-core machine.

Writes scripts/bench/results/ssh_launch_bench.{json,md}. Needs root (the cluster).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "scripts" / "bench" / "results"
ALLREDUCE = ROOT / "scripts" / "examples" / "allreduce.py"
PY = sys.executable
sys.path.insert(0, str(ROOT / "scripts" / "cluster"))
import cluster as cluster_mod  # noqa: E402  (a script directory, not a package)


def _timed(cmd: list[str], cwd: Path, env: dict[str, str], timeout: float = 180) -> float:
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    elapsed = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"bench: {cmd[:3]}... failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
    return elapsed


def _floor(hosts: list[str], ranks: int, ssh_config: str) -> float:
    start = time.perf_counter()
    procs = [subprocess.Popen(["ssh", "-F", ssh_config, h, PY, "-c", "'import torch'"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL)
             for h in hosts for _ in range(ranks)]
    codes = [p.wait(120) for p in procs]
    elapsed = time.perf_counter() - start
    if any(codes):
        raise SystemExit(f"bench: floor ssh failed: {codes}")
    return elapsed


class Bench:
    def __init__(self, info: dict, work: Path, ranks: int) -> None:
        self.info, self.work, self.ranks = info, work, ranks
        self.env = {**os.environ, "OMP_NUM_THREADS": "1",
                    "PDSH_SSH_ARGS_APPEND": f"-F {info['ssh_config']}"}
        self.port = 29700

    def hostfile(self, k: int) -> Path:
        path = self.work / f"hostfile{k}"
        path.write_text("".join(f"{h['name']} slots={self.ranks}\n" for h in self.info["hosts"][:k]))
        return path

    def _next_port(self) -> str:
        self.port += 1  # a fresh port per run: no TIME_WAIT surprises between repeats
        return str(self.port)

    def dslaunch(self, k: int) -> float:
        return _timed([PY, "-m", "dslaunch.launcher.cli", "--hostfile", str(self.hostfile(k)),
                       "--launcher_args", f"-F {self.info['ssh_config']}", "--master_port",
                       self._next_port(), str(ALLREDUCE)], self.work, self.env)

    def deepspeed(self, k: int) -> float:
        deepspeed = str(Path(PY).parent / "deepspeed")
        return _timed([PY, deepspeed, "--hostfile", str(self.hostfile(k)), "--launcher", "pdsh",
                       "--force_multi", "--no_ssh_check", "--master_addr", self.info["hosts"][0]["addr"],
                       "--master_port", self._next_port(), str(ALLREDUCE)], self.work, self.env)

    def floor(self, k: int) -> float:
        return _floor([h["name"] for h in self.info["hosts"][:k]], self.ranks, self.info["ssh_config"])


def _table(rows: list[dict], ranks: int, repeats: int) -> str:
    lines = [
        f"### SSH launch time: {ranks} rank{'s' if ranks > 1 else ''} per host (median of {repeats}; seconds)",
        "",
        "| hosts | ranks | dslaunch | DeepSpeed (pdsh) | floor (ssh + import torch) | dslaunch / floor "
        "| DeepSpeed / dslaunch | best of each: dslaunch / DeepSpeed / floor |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        ds = f"{r['deepspeed']:.2f}" if r["deepspeed"] is not None else "n/a"
        speed = f"{r['deepspeed'] / r['dslaunch']:.2f}x" if r["deepspeed"] is not None else "n/a"
        best = " / ".join(f"{r[k]:.2f}" if r[k] is not None else "n/a"
                          for k in ("dslaunch_min", "deepspeed_min", "floor_min"))
        lines.append(f"| {r['hosts']} | {r['hosts'] * ranks} | {r['dslaunch']:.2f} | {ds} | {r['floor']:.2f} "
                     f"| {r['dslaunch'] / r['floor']:.2f}x | {speed} | {best} |")
    return "\n".join(lines) + "\n"


TARGET = 1.15  # issue 5: dslaunch at most 1.15x the floor (medians)


def _verdict(runs: list[dict]) -> str:
    ratios = [(run["ranks_per_host"], r["hosts"], r["dslaunch"] / r["floor"]) for run in runs for r in run["rows"]]
    over = [f"{h} host{'s' if h > 1 else ''} x {k} rank{'s' if k > 1 else ''} ({x:.2f}x)"
            for k, h, x in ratios if x > TARGET]
    met = len(ratios) - len(over)
    return (f"Target dslaunch <= {TARGET}x floor (medians): met in {met} of {len(ratios)} rows"
            + (f"; over in {', '.join(over)}" if over else "") + ".\n")


def _markdown(runs: list[dict], repeats: int) -> str:
    tables = [_table(run["rows"], run["ranks_per_host"], repeats) for run in runs] + [_verdict(runs)]
    note = ("Command start to all ranks past a barrier + all_reduce and exited, on the network-namespace "
            "test cluster (one sshd per host). Shared 2-core machine: noisy; load average at the end: "
            f"{', '.join(f'{x:.1f}' for x in os.getloadavg())}. With Linux autogroup scheduling, each `ssh` "
            "of the floor is its own session and gets its own CPU share under foreign load; dslaunch "
            "starts every worker in its own session for the same reason (DeepSpeed's ranks share one).\n")
    return "\n".join([*tables, note])


def _measure(bench: Bench, hosts: list[int], repeats: int, have_ds: bool) -> tuple[list[dict], dict]:
    """Interleaved runs (dslaunch, DeepSpeed, floor) per host count; medians and minima."""
    times: dict[int, dict[str, list[float]]] = {k: {"dslaunch": [], "deepspeed": [], "floor": []} for k in hosts}
    for k in hosts:
        for rep in range(repeats):
            times[k]["dslaunch"].append(bench.dslaunch(k))
            if have_ds:
                times[k]["deepspeed"].append(bench.deepspeed(k))
            times[k]["floor"].append(bench.floor(k))
            print(f"ranks/host={bench.ranks} hosts={k} repeat {rep + 1}: " + ", ".join(
                f"{name} {vals[-1]:.2f}s" for name, vals in times[k].items() if vals), flush=True)
    rows = [{"hosts": k, **{name: (statistics.median(v) if v else None) for name, v in t.items()},
             **{f"{name}_min": (min(v) if v else None) for name, v in t.items()}}
            for k, t in times.items()]
    return rows, {str(k): t for k, t in times.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hosts", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--ranks-per-host", type=int, nargs="+", default=[1, 2],
                        help="one table per value (default: 1 2, the issue's two targets)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--no-deepspeed", action="store_true", help="skip the DeepSpeed runs")
    args = parser.parse_args(argv)
    if os.geteuid() != 0:
        raise SystemExit("bench: needs root for the test cluster")
    if cluster_mod.missing_facilities() or not shutil.which("pdsh"):  # `make bench` skips system-deps
        subprocess.run(["bash", str(ROOT / "scripts" / "system_deps.sh")], check=False)
    have_ds = bool(not args.no_deepspeed and shutil.which("pdsh") and (Path(PY).parent / "deepspeed").exists())
    state = cluster_mod.state_dir_default()
    before = cluster_mod.status(state)["sshd"]
    was_up = len(before) >= max(args.hosts) and all(before.values())
    info = cluster_mod.up(max(args.hosts), state)
    runs = []
    try:
        with tempfile.TemporaryDirectory(prefix="dsl-bench-") as tmp:
            work = Path(tmp)
            (work / ".deepspeed_env").write_text("OMP_NUM_THREADS=1\n")
            for ranks in args.ranks_per_host:
                rows, raw = _measure(Bench(info, work, ranks), args.hosts, args.repeats, have_ds)
                runs.append({"ranks_per_host": ranks, "rows": rows, "raw": raw})
    finally:
        if not was_up:
            cluster_mod.down(state)
    RESULTS.mkdir(parents=True, exist_ok=True)
    report = {"benchmark": "ssh_launch_bench", "repeats": args.repeats,
              "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
              "note": "shared 2-core machine; timings are noisy", "loadavg_at_end": os.getloadavg(),
              "runs": runs}
    (RESULTS / "ssh_launch_bench.json").write_text(json.dumps(report, indent=2) + "\n")
    md = _markdown(runs, args.repeats)
    (RESULTS / "ssh_launch_bench.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
