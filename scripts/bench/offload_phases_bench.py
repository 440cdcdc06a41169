"""Where the offloaded (ZeRO-2 + ``offload_optimizer: cpu``) step's time goes, by phase.

One rank, the ``engine_bench`` MLP (5 x Linear(2048, 2048), ~21M parameters) in bf16, AdamW,
micro batch 32, optional gradient clipping. Per timed step: forward + backward, the whole
``engine.step()``, and the engine's own split of it (``engine.zero.offload.phases``: norm,
gradients in, update, NVMe state, write-back) with the bytes its copies moved and the bytes a
separate norm pass read (0 where the backward folded the norm into its writes). Medians over
``--steps`` after ``--warmup``. On a CPU host the "device" is the host: the copies move nothing
and the overhead beyond the update is the norm pass and the step's bookkeeping.

Usage: python scripts/bench/offload_phases_bench.py [--steps 10] [--warmup 2] [--clip 1.0]
Prints a markdown table (for BENCHMARKS.md); run it under the bench lock.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import time

DIM, LAYERS, MICRO = 2048, 5, 32


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--clip", type=float, default=1.0, help="gradient_clipping (0: none)")
    args = ap.parse_args()
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(20000 + os.getpid() % 20000))
    import torch
    import torch.distributed as dist

    import dslaunch

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
    torch.manual_seed(0)
    layers = []
    for _ in range(LAYERS):
        layers += [torch.nn.Linear(DIM, DIM), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers[:-1])
    cfg = {"train_micro_batch_size_per_gpu": MICRO, "steps_per_print": 10**6, "bf16": {"enabled": True},
           "gradient_clipping": args.clip, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
           "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}
    engine, *_ = dslaunch.initialize(model=model, config=cfg)
    x, y = torch.randn(MICRO, DIM).bfloat16(), torch.randn(MICRO, DIM)
    rows: list[tuple[float, float, dict, int, int, int | None]] = []
    for i in range(args.warmup + args.steps):
        t0 = time.perf_counter()
        engine.backward(torch.nn.functional.mse_loss(engine(x).float(), y))
        t1 = time.perf_counter()
        engine.step()
        t2 = time.perf_counter()
        ph = engine.zero.offload.phases
        if i >= args.warmup:
            rows.append(((t1 - t0) * 1e3, (t2 - t1) * 1e3, ph.ms, ph.grad_bytes, ph.param_bytes,
                         getattr(ph, "norm_bytes", None)))  # None: a tree from before the norm was folded
    med = statistics.median
    step = med(r[1] for r in rows)
    phases = {k: med(r[2][k] for r in rows) for k in rows[0][2]}
    params = sum(p.numel() for p in model.parameters())
    print(f"{params / 1e6:.0f}M parameters, bf16, ZeRO-2 + offload_optimizer cpu, 1 rank, clip {args.clip}; "
          f"medians of {args.steps} steps; load average {os.getloadavg()[0]:.1f}\n")
    print("| fwd+bwd ms | engine.step ms | " + " | ".join(f"{k} ms" for k in phases)
          + " | step - update ms | grad bytes | param bytes | norm pass bytes |")
    print("| " + " | ".join(["---:"] * (len(phases) + 6)) + " |")
    print(f"| {med(r[0] for r in rows):.1f} | {step:.1f} | " + " | ".join(f"{v:.1f}" for v in phases.values())
          + f" | {step - phases['update']:.1f} | {rows[-1][3]} | {rows[-1][4]} | "
          + f"{'-' if rows[-1][5] is None else rows[-1][5]} |")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
