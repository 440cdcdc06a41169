"""Launch overhead: time from command start until 2 ranks passed a barrier and every process exited.

Measured in one run, interleaved round-robin so machine load drifts hit every contender alike:

- ``dslaunch --num_gpus 2 scripts/examples/allreduce.py``
- ``torchrun --nproc-per-node 2 scripts/examples/allreduce.py``
- ``deepspeed --num_gpus 2 scripts/examples/allreduce.py`` (CPU, gloo)
- the floor: two parallel ``python -c 'import torch'`` (what any launcher must at least pay)

All with OMP_NUM_THREADS=1 and a fresh free port per run. Writes ``results/launch_bench.json``
and ``results/launch_bench.md`` (medians, ratios). Timings on a shared 2-core machine are noisy.

Usage: ``python scripts/bench/launch_bench.py [--repeats 5]``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from dslaunch.utils.ports import free_port

ROOT = Path(__file__).resolve().parents[2]
RESULTS = Path(__file__).resolve().parent / "results"
BIN = Path(sys.executable).parent
SCRIPT = str(ROOT / "scripts" / "examples" / "allreduce.py")
TARGET = 1.3  # dslaunch at most 1.3x the floor
FLOOR = "floor (2x import torch)"
BARE = "2x python -c pass"
LEAN = "dslaunch, 2 torch-free workers"

def _commands() -> dict[str, list[list[str]] | None]:
    """name -> a function of the port giving the command(s) to run in parallel; None if missing."""
    py = sys.executable
    cmds = {
        FLOOR: lambda p: [[py, "-c", "import torch"]] * 2,
        "dslaunch": lambda p: [[str(BIN / "dslaunch"), "--num_gpus", "2", "--master_port", str(p), SCRIPT]],
        "torchrun": lambda p: [[str(BIN / "torchrun"), "--nproc-per-node", "2", "--master-port", str(p), SCRIPT]],
        "deepspeed": lambda p: [[str(BIN / "deepspeed"), "--num_gpus", "2", "--master_port", str(p), SCRIPT]],
        # the launcher's own cost, without torch in the way
        BARE: lambda p: [[py, "-c", "pass"]] * 2,
        LEAN: lambda p: [[str(BIN / "dslaunch"), "--num_gpus", "2", "--master_port", str(p), "--no_python",
                          "--no_local_rank", py, "-c", "pass"]],
    }
    return {k: (v if shutil.which(v(0)[0][0]) else None) for k, v in cmds.items()}


def _time_once(make) -> float:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    t0 = time.perf_counter()
    procs = [subprocess.Popen(c, env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
             for c in make(free_port())]
    errs = [p.communicate(timeout=120)[1] for p in procs]
    elapsed = time.perf_counter() - t0
    for p, err in zip(procs, errs, strict=True):
        if p.returncode != 0:
            raise RuntimeError(f"{p.args} exited {p.returncode}: {err.decode()[-2000:]}")
    return elapsed


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    cmds = {k: v for k, v in _commands().items() if v is not None}
    missing = [k for k, v in _commands().items() if v is None]
    times: dict[str, list[float]] = {k: [] for k in cmds}
    load_before = os.getloadavg()[0]
    for make in cmds.values():  # warm-up: page cache, .pyc files
        _time_once(make)
    for i in range(args.repeats):
        for name, make in cmds.items():
            times[name].append(_time_once(make))
        print(f"repeat {i + 1}/{args.repeats}: " + ", ".join(f"{k} {v[-1]:.2f}s" for k, v in times.items()),
              flush=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    floor, ours = med[FLOOR], med["dslaunch"]
    report = {
        "what": "seconds from command start until 2 ranks passed a gloo barrier+all_reduce and exited",
        "repeats": args.repeats, "cores": len(os.sched_getaffinity(0)), "times": times, "median": med,
        "dslaunch_over_floor": ours / floor, "target_over_floor": TARGET, "missing": missing,
        "load_average_1min": {"before": load_before, "after": os.getloadavg()[0]},
    }
    load = (load_before, os.getloadavg()[0])
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "launch_bench.json").write_text(json.dumps(report, indent=2) + "\n")
    text = _markdown(med, {k: min(v) for k, v in times.items()}, args.repeats, missing, load)
    (RESULTS / "launch_bench.md").write_text(text)
    print(text)
    return 0


def _markdown(med: dict[str, float], best: dict[str, float], repeats: int, missing: list[str],
              load: tuple[float, float]) -> str:
    floor, ours = med[FLOOR], med["dslaunch"]
    rows = [
        "## Launch: 2 ranks to a gloo barrier and exit (`scripts/bench/launch_bench.py`)\n",
        f"Median of {repeats} interleaved runs, same machine, same moment; OMP_NUM_THREADS=1. "
        f"Shared 2-core machine (1-min load average {load[0]:.1f} before, {load[1]:.1f} after): "
        "timings are noisy, compare ratios.\n",
        "| command | median s | min s | median vs floor | median / dslaunch's |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for name, t in med.items():
        if name not in (BARE, LEAN):
            rows.append(f"| {name} | {t:.2f} | {best[name]:.2f} | {t / floor:.2f}x | {t / ours:.2f}x |")
    verdict = "met" if ours / floor <= TARGET else "NOT met"
    rows.append(f"\nTarget dslaunch <= {TARGET}x floor (medians): {verdict} ({ours / floor:.2f}x).")
    if BARE in med and LEAN in med:
        rows.append(f"Launcher overhead alone: dslaunch with 2 torch-free workers {med[LEAN]:.3f} s vs "
                    f"{med[BARE]:.3f} s for 2 bare interpreters (+{(med[LEAN] - med[BARE]) * 1000:.0f} ms, medians).")
    if missing:
        rows.append(f"Not installed, not measured: {', '.join(missing)}.")
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
