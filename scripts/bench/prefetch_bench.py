"""Stage-3 prefetch benchmark: step time with gathers on demand vs prefetched (overlapping compute).

A 2-rank gloo job, fp32 AdamW, an MLP of ``LAYERS`` x Linear(DIM, DIM), every parameter
partitioned (``stage3_param_persistence_threshold: 0``), OMP_NUM_THREADS=1. Configurations
(``zero_optimization``):

- ``on-demand``: ``stage3_prefetch_bucket_size: 0``, ``stage3_max_reuse_distance: 0``: each
  module's gather is issued when it starts and waited for at once (dslaunch before prefetch);
- ``prefetch``: the next 2 layers' gathers in flight while a layer computes, no reuse;
- ``prefetch+reuse``: DeepSpeed's defaults (5e7 elements ahead, reuse within 1e9): backward
  finds the forward's parameters still whole, half the gathers;
- ``prefetch+live``: as ``prefetch``, with ``stage3_max_live_parameters`` at 3 layers.

One process pair holds every configuration (one engine each, the same initial weights); they
take turns step by step, so load from other processes hits all alike. Per configuration: the
median of ``--steps`` steps after ``--warmup`` (the first step records the trace).

Usage: python scripts/bench/prefetch_bench.py [--steps 8] [--warmup 2]
Writes scripts/bench/results/prefetch_bench.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from dslaunch.utils.ports import free_port

HERE = Path(__file__).resolve().parent
DIM, LAYERS, MICRO, WORLD = 1024, 8, 64, 2
CONFIGS = {
    "on-demand": {"stage3_prefetch_bucket_size": 0, "stage3_max_reuse_distance": 0},
    "prefetch": {"stage3_prefetch_bucket_size": 2 * DIM * (DIM + 1), "stage3_max_reuse_distance": 0},
    "prefetch+reuse": {},
    "prefetch+live": {"stage3_prefetch_bucket_size": 2 * DIM * (DIM + 1), "stage3_max_reuse_distance": 0,
                      "stage3_max_live_parameters": 3 * DIM * (DIM + 1)},
}


def _engine(zero: dict):
    import torch

    import dslaunch

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[m for _ in range(LAYERS) for m in (torch.nn.Linear(DIM, DIM), torch.nn.GELU())])
    cfg = {"train_micro_batch_size_per_gpu": MICRO, "steps_per_print": 10**6,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, "overlap_comm": True,
                                 "reduce_bucket_size": 5_000_000, **zero}}
    return dslaunch.initialize(model=model, config=cfg)[0]


def _worker(steps: int, warmup: int) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    engines = {name: _engine(zero) for name, zero in CONFIGS.items()}
    times: dict[str, list[float]] = {name: [] for name in engines}
    x = torch.randn(MICRO, DIM)
    for step in range(warmup + steps):
        names = list(engines)
        names = names[step % len(names):] + names[:step % len(names)]  # rotate the order
        for name in names:
            dist.barrier()
            t0 = time.perf_counter()
            engine = engines[name]
            engine.backward(engine(x).square().mean())
            engine.step()
            if step >= warmup:
                times[name].append(time.perf_counter() - t0)
    if dist.get_rank() == 0:
        print(json.dumps({name: statistics.median(t) * 1e3 for name, t in times.items()}), flush=True)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return _worker(args.steps, args.warmup)
    port = free_port()
    procs = []
    for rank in range(WORLD):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(WORLD),
               "LOCAL_WORLD_SIZE": str(WORLD), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               "OMP_NUM_THREADS": "1"}
        procs.append(subprocess.Popen([sys.executable, __file__, "--worker", "--steps", str(args.steps),
                                       "--warmup", str(args.warmup)], env=env, stdout=subprocess.PIPE, text=True))
    out = [p.communicate()[0] for p in procs]
    if any(p.returncode for p in procs):
        sys.exit("a worker failed")
    ms = json.loads(out[0].strip().splitlines()[-1])
    _write(ms, args)


def _write(ms: dict[str, float], args: argparse.Namespace) -> None:
    base = ms["on-demand"]
    result = {"dim": DIM, "layers": LAYERS, "micro_batch": MICRO, "world": WORLD, "steps": args.steps,
              "load": os.getloadavg(), "step_ms": ms}
    (HERE / "results" / "prefetch_bench.json").write_text(json.dumps(result, indent=2) + "\n")
    rows = [f"| {name} | {t:.1f} | {base / t:.2f}x |" for name, t in ms.items()]
    md = ["## Stage-3 prefetch (`prefetch_bench.py`)", "",
          f"{LAYERS} x Linear({DIM}, {DIM}) (8.4M parameters, all partitioned), fp32 AdamW, micro batch "
          f"{MICRO}, {WORLD} ranks on gloo, 1 thread each; median step of {args.steps} after "
          f"{args.warmup} warm-up steps, configurations taking turns in one process pair "
          f"(load average {result['load'][0]:.1f}).", "",
          "| configuration | step (ms) | speed-up vs on-demand |", "|---|---|---|", *rows]
    (HERE / "results" / "prefetch_bench.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
