"""Engine benchmark: step time and peak RSS per rank, dslaunch ZeRO 0-2 vs torch DDP vs DeepSpeed.

One run, same model and data for everyone: a ~21M-parameter MLP (5 x Linear(2048, 2048)), fp32,
AdamW, 2 ranks on gloo, micro batch 32, no accumulation. Each configuration runs as 2 fresh
worker processes started with the launcher's env contract (RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR, MASTER_PORT), OMP_NUM_THREADS=1; each worker times ``--steps`` steps after
``--warmup`` and reports its median step time and peak RSS. Each configuration is repeated
``--repeats`` times (interleaved); the table shows medians over repeats. DeepSpeed (the peer) is
measured only if it imports. Timings on a shared 2-core machine are noisy.

Usage: python scripts/bench/engine_bench.py [--repeats 3] [--steps 8] [--warmup 3]
Writes scripts/bench/results/engine_bench.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
DIM, LAYERS, MICRO, WORLD, LR = 2048, 5, 32, 2, 1e-4
BUCKET = 5_000_000  # elements per reduce/all-gather bucket, for dslaunch and DeepSpeed alike


def _ds_config(stage: int, peer: bool) -> dict:
    params = {"lr": LR, "weight_decay": 0.01}
    if peer:
        params["torch_adam"] = True  # FusedAdam needs CUDA; torch's AdamW on CPU
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 1,
            "steps_per_print": 10**6, "optimizer": {"type": "AdamW", "params": params},
            "zero_optimization": {"stage": stage, "reduce_bucket_size": BUCKET,
                                  "allgather_bucket_size": BUCKET, "overlap_comm": stage > 0}}


# ----- worker side ----------------------------------------------------------------------------
def _model():
    import torch

    torch.manual_seed(0)
    layers = []
    for _ in range(LAYERS):
        layers += [torch.nn.Linear(DIM, DIM), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers[:-1])


def _worker(kind: str, stage: int, steps: int, warmup: int) -> None:
    import resource

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    model = _model()
    rank = int(os.environ["RANK"])
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(MICRO, DIM, generator=g), torch.randn(MICRO, DIM, generator=g)
    if kind == "ddp":
        import datetime

        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
        engine = torch.nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.AdamW(engine.parameters(), lr=LR, weight_decay=0.01, fused=True)

        def step() -> None:
            loss = torch.nn.functional.mse_loss(engine(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
    else:
        if kind == "deepspeed":
            import deepspeed as ds
        else:
            import dslaunch as ds
        engine, _, _, _ = ds.initialize(model=model, config=_ds_config(stage, kind == "deepspeed"),
                                        model_parameters=model.parameters())

        def step() -> None:
            loss = torch.nn.functional.mse_loss(engine(x), y)
            engine.backward(loss)
            engine.step()
    times = []
    for i in range(warmup + steps):
        dist.barrier()
        t0 = time.perf_counter()
        step()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # MiB
    out = [None] * WORLD
    dist.all_gather_object(out, {"step_ms": statistics.median(times) * 1e3, "rss_mib": rss})
    if rank == 0:
        print("RESULT " + json.dumps(out), flush=True)
    dist.destroy_process_group()


# ----- driver side ----------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(kind: str, stage: int, steps: int, warmup: int) -> list[dict] | None:
    port = _free_port()
    procs = []
    for r in range(WORLD):
        env = {**os.environ, "RANK": str(r), "WORLD_SIZE": str(WORLD), "LOCAL_RANK": str(r),
               "LOCAL_WORLD_SIZE": str(WORLD), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}
        procs.append(subprocess.Popen([sys.executable, __file__, "--worker", kind, str(stage),
                                       str(steps), str(warmup)], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    outs = [p.communicate(timeout=600) for p in procs]
    for line in outs[0][0].splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    print(f"  {kind} stage {stage} failed:\n{outs[0][1][-2000:]}", file=sys.stderr)
    return None


def _has_deepspeed() -> bool:
    return subprocess.run([sys.executable, "-c", "import deepspeed"], capture_output=True,
                          env={**os.environ, "DS_ACCELERATOR": "cpu"}).returncode == 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--only", nargs="*", help="subset of configs, e.g. dslaunch-2 ddp-0")
    args = ap.parse_args()
    configs = [("ddp", 0)] + [("dslaunch", s) for s in (0, 1, 2)]
    if _has_deepspeed():
        configs += [("deepspeed", s) for s in (0, 1, 2)]
    if args.only:
        configs = [c for c in configs if f"{c[0]}-{c[1]}" in args.only]
    raw: dict[str, list] = {f"{k}-{s}": [] for k, s in configs}
    for rep in range(args.repeats):
        for kind, stage in configs:
            res = _run(kind, stage, args.steps, args.warmup)
            if res:
                raw[f"{kind}-{stage}"].append(res)
                print(f"rep {rep} {kind} stage {stage}: "
                      + ", ".join(f"rank{i} {r['step_ms']:.0f} ms {r['rss_mib']:.0f} MiB"
                                  for i, r in enumerate(res)), flush=True)
    _write(raw, args)


def _summary(runs: list) -> dict:
    return {"step_ms": statistics.median(max(r["step_ms"] for r in run) for run in runs),
            "rss_mib": statistics.median(max(r["rss_mib"] for r in run) for run in runs)}


def _write(raw: dict, args: argparse.Namespace) -> None:
    summary = {k: _summary(v) for k, v in raw.items() if v}
    results = HERE / "results"
    results.mkdir(exist_ok=True)
    (results / "engine_bench.json").write_text(json.dumps(
        {"model": f"MLP {LAYERS}x Linear({DIM},{DIM})", "params": LAYERS * (DIM * DIM + DIM),
         "world": WORLD, "micro_batch": MICRO, "repeats": args.repeats, "steps": args.steps,
         "summary": summary, "raw": raw}, indent=1))
    rows = ["## Training engine (`engine_bench.py`)", "",
            f"{LAYERS * (DIM * DIM + DIM) / 1e6:.0f}M-parameter MLP, fp32 AdamW, {WORLD} ranks on gloo, "
            f"micro batch {MICRO}; medians of {args.repeats} runs x {args.steps} steps (slowest rank). "
            "Shared 2-core machine: timings are noisy.", "",
            "| config | step ms | vs DDP | vs DeepSpeed same stage | peak RSS/rank MiB | RSS vs DeepSpeed |",
            "| --- | --- | --- | --- | --- | --- |"]
    ddp = summary.get("ddp-0")
    for key, s in summary.items():
        kind, stage = key.split("-")
        peer = summary.get(f"deepspeed-{stage}") if kind == "dslaunch" else None
        vs_ddp = f"{ddp['step_ms'] / s['step_ms']:.2f}x" if ddp and kind != "ddp" else "-"
        vs_ds = f"{peer['step_ms'] / s['step_ms']:.2f}x faster" if peer else "-"
        rss_ds = f"{s['rss_mib'] / peer['rss_mib']:.2f}" if peer else "-"
        name = "torch DDP" if kind == "ddp" else f"{kind} ZeRO-{stage}"
        rows.append(f"| {name} | {s['step_ms']:.0f} | {vs_ddp} | {vs_ds} | {s['rss_mib']:.0f} | {rss_ds} |")
    (results / "engine_bench.md").write_text("\n".join(rows) + "\n")
    print("\n".join(rows))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        _worker(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]))
    else:
        main()
