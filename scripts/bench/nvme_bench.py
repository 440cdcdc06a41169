"""NVMe offload benchmark: host RSS and step time of a rank, optimizer state on disk vs in host memory.

One rank (gloo, world 1, ZeRO-2, fp32 AdamW, OMP_NUM_THREADS=1) trains an MLP of ``--layers`` x
Linear(``--dim``, ``--dim``) with ``offload_optimizer`` ``cpu`` and ``nvme`` (swap file under
``--nvme-path``, 2 Adam buckets of buffers; ``nvme`` pipelines reads and writes, ``nvme-serial``
waits for each). Each configuration runs in
a fresh process, alternating, ``--repeats`` times: step time is the median of ``--steps`` steps
after ``--warmup`` (then the median over runs); RSS is the rank's resident set after the last step
and its peak (``ru_maxrss``). The swap file's pages are written through the page cache, which is
not part of a process's RSS; on this machine (24 GiB, a small file) reads are mostly served from
that cache, so the step time is the overhead of the swap path more than the disk's speed.

Usage: flock /tmp/dslaunch-bench.lock python scripts/bench/nvme_bench.py [--dim 2048] [--layers 8]
Writes scripts/bench/results/nvme_bench.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from dslaunch.utils.ports import free_port

HERE = Path(__file__).resolve().parent
MICRO, LR = 8, 1e-4


def _config(offload: str, nvme_path: str, bucket: int) -> dict:
    off: dict = {"device": offload.split("-")[0]}
    if offload.startswith("nvme"):
        pipeline = offload == "nvme"  # "nvme-serial": each read and write waited for
        off.update(nvme_path=nvme_path, buffer_count=4, buffer_size=bucket, pipeline_read=pipeline,
                   pipeline_write=pipeline)
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 1, "steps_per_print": 10**6,
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}},
            "zero_optimization": {"stage": 2, "sub_group_size": bucket, "offload_optimizer": off}}


def _child(args: argparse.Namespace) -> None:
    import resource
    import time

    import psutil
    import torch

    import dslaunch

    torch.set_num_threads(1)
    torch.manual_seed(0)
    layers = []
    for _ in range(args.layers):
        layers += [torch.nn.Linear(args.dim, args.dim), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers[:-1])
    engine, *_ = dslaunch.initialize(model=model, config=_config(args.child, args.nvme_path, args.bucket))
    x = torch.randn(MICRO, args.dim)
    times = []
    for i in range(args.warmup + args.steps):
        t0 = time.perf_counter()
        engine.backward(engine(x).square().mean())
        engine.step()
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
    rss = psutil.Process().memory_info().rss
    held = engine.zero.held_bytes()["optimizer_state"]
    print(json.dumps({"step_s": statistics.median(times), "rss": rss,
                      "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                      "optimizer_state_in_memory": held,
                      "params": sum(p.numel() for p in model.parameters())}), flush=True)


def _run(kind: str, args: argparse.Namespace) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1",
           "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    cmd = [sys.executable, __file__, "--child", kind, "--nvme-path", args.nvme_path, "--dim", str(args.dim),
           "--layers", str(args.layers), "--bucket", str(args.bucket), "--steps", str(args.steps),
           "--warmup", str(args.warmup)]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise SystemExit(f"{kind} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dim", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--bucket", type=int, default=4_000_000, help="sub_group_size = buffer_size (elements)")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--nvme-path", default=None, help="directory for the swap file (default: a temp dir on /)")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        _child(args)
        return
    with tempfile.TemporaryDirectory(dir=args.nvme_path or HERE) as tmp:
        args.nvme_path = tmp
        runs: dict[str, list[dict]] = {"cpu": [], "nvme": [], "nvme-serial": []}
        for _ in range(args.repeats):
            for kind in runs:
                runs[kind].append(_run(kind, args))
    res = {k: {"step_s": statistics.median(r["step_s"] for r in v), "rss": max(r["rss"] for r in v),
               "peak_rss": max(r["peak_rss"] for r in v), "optimizer_state_in_memory": v[0]["optimizer_state_in_memory"],
               "runs": v} for k, v in runs.items()}
    params = runs["cpu"][0]["params"]
    doc = {"params": params, "dim": args.dim, "layers": args.layers, "bucket": args.bucket, "results": res,
           "load": os.getloadavg()}
    (HERE / "results" / "nvme_bench.json").write_text(json.dumps(doc, indent=1))
    mib = 2**20
    cpu, nvme = res["cpu"], res["nvme"]
    lines = [
        "## NVMe offload (`nvme_bench.py`)\n",
        f"One rank, ZeRO-2, fp32 AdamW, {params / 1e6:.0f}M-parameter MLP ({args.layers} x Linear({args.dim}, "
        f"{args.dim})), buckets of {args.bucket:,} elements; `offload_optimizer` cpu vs nvme (swap "
        "file on this VM's disk through the page cache; `nvme-serial`: pipeline_read/write off). Step time: median over "
        f"{args.repeats} fresh runs of the median of {args.steps} steps; RSS after the last step and peak.\n",
        "| offload | step ms | nvme / cpu | optimizer state in memory MiB | RSS MiB | peak RSS MiB |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for kind, r in res.items():
        ratio = f"{r['step_s'] / cpu['step_s']:.2f}x" if kind != "cpu" else "-"
        lines.append(f"| {kind} | {r['step_s'] * 1e3:.0f} | {ratio} | {r['optimizer_state_in_memory'] / mib:.0f} | "
                     f"{r['rss'] / mib:.0f} | {r['peak_rss'] / mib:.0f} |")
    lines.append(f"\nRSS saved by NVMe: {(cpu['rss'] - nvme['rss']) / mib:.0f} MiB (Adam state: "
                 f"{8 * params / mib:.0f} MiB). Load average during the run: {doc['load'][0]:.1f}.")
    (HERE / "results" / "nvme_bench.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
