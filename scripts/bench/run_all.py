"""Run every benchmark in scripts/bench/ and assemble BENCHMARKS.md from their result tables.

Each benchmark is a standalone script that writes ``results/<name>.json`` (raw numbers) and
``results/<name>.md`` (a table with ratios against the peer measured in the same run). This
script only runs them one after another (never in parallel: they share two cores) and
concatenates the tables, so BENCHMARKS.md always shows the figures of the last run. What a
person writes about a table (a reading, an earlier run) goes in ``results/notes/<name>.md``, put
after that table: a rerun rewrites the table but never the notes, so re-read them after one.

Usage: ``python scripts/bench/run_all.py [--assemble-only] [name ...]`` (default: every
``*_bench.py``; ``--assemble-only`` rebuilds BENCHMARKS.md from the existing results).
"""

from __future__ import annotations

import datetime as dt
import platform
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
NOTES = RESULTS / "notes"
OUT = HERE.parent.parent / "BENCHMARKS.md"
# Tables in the order a user meets the product: launch, train, checkpoint.
ORDER = ["launch_bench", "ssh_launch_bench", "slurm_submit_bench", "engine_bench", "zero3_bench", "zero3_bench_bf16",
         "pipeline_bench", "prefetch_bench", "activation_ckpt_bench", "nvme_bench", "estimate_bench", "heartbeat_bench", "flops_profiler_bench",
         "monitor_bench", "optimizer_bench", "cpu_kernels_bench", "gpu_check", "gpu_kernels_bench", "ckpt_bench",
         "inference_bench",
         "faults", "host_faults", "exit_stress", "pipeline_hang_check"]


def _benches(names: list[str]) -> list[Path]:
    found = sorted(HERE.glob("*_bench.py"))
    if not names:
        return found
    return [p for p in found if p.stem in names or p.stem.removesuffix("_bench") in names]


def _run(bench: Path) -> bool:
    print(f"== {bench.name}", flush=True)
    return subprocess.run([sys.executable, str(bench)], cwd=HERE.parent.parent).returncode == 0


def _assemble() -> None:
    import torch  # only for the version line

    parts = [
        "# Benchmarks\n",
        "Produced by `make bench` (`scripts/bench/run_all.py`); raw numbers in "
        "`scripts/bench/results/*.json`. Every ratio compares against a peer measured in the same "
        "run on the same machine.\n",
        f"Machine: {platform.machine()}, {_cores()} cores, Python {platform.python_version()}, "
        f"torch {torch.__version__}. Assembled {dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M} UTC.\n",
    ]
    tables = sorted(RESULTS.glob("*.md"), key=lambda p: (ORDER.index(p.stem) if p.stem in ORDER else len(ORDER), p.stem))
    for md in tables:
        parts.append(md.read_text().strip() + "\n")
        if (notes := NOTES / md.name).exists():
            parts.append(notes.read_text().strip() + "\n")
    OUT.write_text("\n".join(parts))
    print(f"wrote {OUT}")


def _cores() -> int:
    import os

    return len(os.sched_getaffinity(0))


def main(argv: list[str]) -> int:
    if "--assemble-only" in argv:
        _assemble()
        return 0
    failed = [b.name for b in _benches(argv) if not _run(b)]
    _assemble()
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
