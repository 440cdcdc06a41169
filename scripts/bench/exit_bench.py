"""A job's end: time from the last training step to the launcher's exit, 2 ranks, ZeRO-2 on gloo.

Each rank prints the wall clock after its last step; the launcher's exit is taken when the command
returns. Two variants, interleaved round-robin so load drifts hit both alike:

- ``frozen``: dslaunch's exit (``runtime/shutdown.py``: one collection, files flushed,
  ``gc.freeze``, so the interpreter's finalization does no full collections);
- ``unfrozen``: the same script with ``gc.unfreeze`` registered at exit before ``initialize`` (the
  documented way back to finalization's collections): the behaviour before the change.

Both without triton in the workers (``sys.modules["triton"] = None``, as with torch's CPU wheels),
since with a nanobind extension loaded dslaunch leaves finalization as it is; ``--with-triton``
runs the frozen variant with triton importable as a third row. OMP_NUM_THREADS=1.

Usage: ``python scripts/bench/exit_bench.py [--repeats 5] [--with-triton]``; prints a markdown table.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from dslaunch.utils.ports import free_port

TRAIN = """
import atexit, gc, os, sys, time
if os.environ["EXIT_BENCH_TRITON"] == "0":
    sys.modules["triton"] = None
if os.environ["EXIT_BENCH_VARIANT"] == "unfrozen":
    atexit.register(gc.unfreeze)  # runs after dslaunch's exit handler: finalization collects again
import torch
import dslaunch as deepspeed

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 16))
config = {"train_micro_batch_size_per_gpu": 8, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
          "zero_optimization": {"stage": 2}, "steps_per_print": 1000}
engine, *_ = deepspeed.initialize(model=model, config=config)
for _ in range(5):
    engine.backward(engine(torch.randn(8, 256)).square().mean())
    engine.step()
print(f"LAST_STEP {time.time():.6f}", flush=True)
"""


def one_run(script: Path, variant: str, triton: bool) -> float:
    """Seconds from the later rank's last step to the launcher's exit."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "EXIT_BENCH_VARIANT": variant,
           "EXIT_BENCH_TRITON": "1" if triton else "0"}
    proc = subprocess.run([sys.executable, "-m", "dslaunch.launcher.cli", "--num_gpus", "2", "--master_port",
                           str(free_port()), str(script)], capture_output=True, text=True, env=env, timeout=300)
    end = time.time()
    if proc.returncode != 0:
        raise SystemExit(f"{variant}: exit code {proc.returncode}\n{proc.stderr[-2000:]}")
    last = [float(line.split()[-1]) for line in proc.stdout.splitlines() if "LAST_STEP" in line]
    if len(last) != 2:
        raise SystemExit(f"{variant}: expected 2 LAST_STEP lines\n{proc.stdout[-2000:]}")
    return end - max(last)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--with-triton", action="store_true")
    args = ap.parse_args()
    rows = [("unfrozen", False), ("frozen", False)] + ([("frozen", True)] if args.with_triton else [])
    times: dict[tuple[str, bool], list[float]] = {row: [] for row in rows}
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "train.py"
        script.write_text(TRAIN)
        for _ in range(args.repeats):
            for row in rows:
                times[row].append(one_run(script, *row))
    base = statistics.median(times[rows[0]])
    print(f"load average after: {', '.join(f'{x:.1f}' for x in os.getloadavg())}\n")
    print("| exit | triton | median s | min s | max s | median vs unfrozen |")
    print("| --- | --- | ---: | ---: | ---: | ---: |")
    for (variant, triton), got in times.items():
        print(f"| {variant} | {'yes' if triton else 'no'} | {statistics.median(got):.2f} | {min(got):.2f} | "
              f"{max(got):.2f} | {statistics.median(got) / base:.2f}x |")


if __name__ == "__main__":
    main()
