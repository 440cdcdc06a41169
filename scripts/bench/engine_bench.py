"""Engine benchmark: step time and peak RSS per rank, dslaunch ZeRO 0-3 vs torch DDP vs DeepSpeed.

One run, same model and data for everyone: a ~21M-parameter MLP (5 x Linear(2048, 2048)), fp32,
AdamW, 2 ranks on gloo, micro batch 32, no accumulation. Workers are started with the launcher's
env contract (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT), OMP_NUM_THREADS=1.

Step time: each of ``--repeats`` runs (rounds) starts one process pair holding every configuration,
which take turns (order rotated), ``--block`` consecutive steps per turn, so load from other
processes on this shared machine hits all of them alike. Within a turn nothing waits between steps,
as in a training loop: dslaunch's parameter publish of one step overlaps the next forward (ZeRO-1/2
with ``overlap_param_gather``); the turn's last step also waits for what is still in flight. Per round the
median over ``--steps`` turns after ``--warmup``; the table gives the median over rounds and
``DDP / this`` per round plus the quartiles of the per-step ratios (steps of two configurations in
the same turn slot ran back to back). Peak RSS: one fresh process pair per configuration. DeepSpeed (the peer) is measured
only if it imports (DS_ACCELERATOR=cpu); it gets torch's fused AdamW as a client optimizer, the
same kernel dslaunch's ``AdamW`` uses, so the comparison is about the engines.

``--world 1`` measures one rank (issue 43: ZeRO-3 with nothing to gather against ZeRO-0); the
table then adds ZeRO-0 / ZeRO-3 per round.

Usage: python scripts/bench/engine_bench.py [--repeats 3] [--steps 6] [--warmup 2] [--block 3]
[--world 2] [--only ddp-0 ...]
Writes scripts/bench/results/engine_bench.{json,md} (``engine_bench_world<N>.*`` for another world).
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

from ranks import ratio_stats, ratio_text, report, run_ranks, slowest

HERE = Path(__file__).resolve().parent
DIM, LAYERS, MICRO, WORLD, LR = 2048, 5, 32, 2, 1e-4
BUCKET = 5_000_000  # elements per reduce/all-gather bucket, for dslaunch and DeepSpeed alike


def _ds_config(stage: int, peer: bool, gloo: bool = False) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 1,
           "steps_per_print": 10**6,
           "zero_optimization": {"stage": stage, "reduce_bucket_size": BUCKET,
                                 "allgather_bucket_size": BUCKET, "overlap_comm": stage > 0}}
    if peer:  # DeepSpeed gets torch's fused AdamW as a client optimizer (its FusedAdam needs CUDA)
        return {**cfg, "zero_allow_untested_optimizer": True}
    # dslaunch's publish stays in flight into the next forward (its own key; DeepSpeed has none)
    cfg["zero_optimization"]["overlap_param_gather"] = stage in (1, 2)
    # dslaunch's rows with its same-host shared-memory collectives (opt-in), gloo-N without (the "before")
    cfg["shared_memory_collectives"] = "never" if gloo else "on"
    return {**cfg, "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}}}


# ----- worker side ----------------------------------------------------------------------------
def _model():
    import torch

    torch.manual_seed(0)
    layers = []
    for _ in range(LAYERS):
        layers += [torch.nn.Linear(DIM, DIM), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers[:-1])


def _build(kind: str, stage: int):
    """One configuration -> a function doing one full training step (comm finished on return)."""
    import torch

    model = _model()
    rank = int(os.environ["RANK"])
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(MICRO, DIM, generator=g), torch.randn(MICRO, DIM, generator=g)
    if kind == "ddp":
        engine = torch.nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.AdamW(engine.parameters(), lr=LR, weight_decay=0.01, fused=True)

        def step(last: bool = True) -> None:
            loss = torch.nn.functional.mse_loss(engine(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
        return step
    if kind == "deepspeed":
        import deepspeed as ds
    else:
        import dslaunch as ds
    client = (torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01, fused=True)
              if kind == "deepspeed" else None)
    engine, _, _, _ = ds.initialize(model=model, config=_ds_config(stage, kind == "deepspeed", kind == "gloo"),
                                    model_parameters=model.parameters(), optimizer=client)
    finish = engine.zero.synchronize if kind != "deepspeed" else (lambda: None)

    def ds_step(last: bool = True) -> None:
        loss = torch.nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        if last:
            finish()  # no parameter gather left in flight into another configuration's turn
    return ds_step


def _init() -> None:
    import datetime

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))


def _timing_worker(configs: list[str], steps: int, warmup: int, block: int) -> None:
    """All configurations in one process pair, ``block`` steps of each in turn: load spikes from
    other processes on the machine hit every configuration alike, so the ratios stay meaningful.
    Reports every timed step (ms) of each configuration."""
    import torch.distributed as dist

    _init()
    fns = {c: _build(c.split("-")[0], int(c.split("-")[1])) for c in configs}
    times: dict[str, list[float]] = {c: [] for c in configs}
    for i in range(warmup + steps):
        order = configs[i % len(configs):] + configs[:i % len(configs)]  # rotate the order
        for c in order:
            dist.barrier()
            for k in range(block):
                t0 = time.perf_counter()
                fns[c](k == block - 1)
                if i >= warmup:
                    times[c].append((time.perf_counter() - t0) * 1e3)
    report(times)


def _memory_worker(config: str, steps: int) -> None:
    """One configuration alone in fresh processes: peak RSS of a whole training run."""
    import resource

    _init()
    fn = _build(config.split("-")[0], int(config.split("-")[1]))
    for _ in range(steps):
        fn()
    report({config: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024})  # MiB


# ----- driver side ----------------------------------------------------------------------------
def _run(argv: list[str], world: int) -> list[dict] | None:
    res, why = run_ranks(__file__, argv, world, timeout=900)
    if res is None:
        print(f"  worker {argv} failed:\n{why}", file=sys.stderr)
    return res


def _has_deepspeed() -> bool:
    return subprocess.run([sys.executable, "-c", "import deepspeed"], capture_output=True,
                          env={**os.environ, "DS_ACCELERATOR": "cpu"}).returncode == 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--block", type=int, default=3, help="consecutive steps per turn")
    ap.add_argument("--only", nargs="*", help="subset of configs, e.g. dslaunch-2 ddp-0")
    ap.add_argument("--world", type=int, default=WORLD, help="ranks (gloo, one thread each)")
    ap.add_argument("--gloo", action="store_true",
                    help="also dslaunch without shared-memory collectives (gloo-N: shared_memory_collectives never)")
    args = ap.parse_args()
    configs = ["ddp-0"] + [f"dslaunch-{s}" for s in (0, 1, 2, 3)]
    if args.gloo:
        configs += [f"gloo-{s}" for s in (0, 1, 2, 3)]
    if _has_deepspeed():
        configs += [f"deepspeed-{s}" for s in (0, 1, 2, 3)]
    if args.only:
        configs = [c for c in configs if c in args.only]
    timing: list[list[dict]] = []
    load = [os.getloadavg()[0]]
    for rep in range(args.repeats):
        res = _run(["time", ",".join(configs), str(args.steps), str(args.warmup), str(args.block)], args.world)
        load.append(os.getloadavg()[0])
        if res:
            timing.append(res)
            print(f"timing run {rep}: " + ", ".join(f"{c} {statistics.median(slowest(res, c)):.0f} ms"
                                                   for c in configs), flush=True)
    memory: dict[str, list[dict]] = {}
    for c in configs:
        res = _run(["memory", c, str(args.warmup + 2)], args.world)
        if res:
            memory[c] = res
            print(f"memory {c}: " + ", ".join(f"rank{i} {r[c]:.0f} MiB" for i, r in enumerate(res)),
                  flush=True)
    load.append(os.getloadavg()[0])
    _write(configs, timing, memory, load, args)


def _write(configs: list[str], timing: list, memory: dict, load: list[float], args: argparse.Namespace) -> None:
    summary = {}
    for c in configs:
        runs = [statistics.median(slowest(res, c)) for res in timing]  # slowest rank per step
        if runs and c in memory:
            summary[c] = {"step_ms": statistics.median(runs), "rounds_ms": runs,
                          "rss_mib": max(r[c] for r in memory[c])}
    if "ddp-0" in summary:
        for c, s in summary.items():
            if c != "ddp-0":
                s["ddp_over_this"] = ratio_stats(timing, c, "ddp-0")
    if "dslaunch-0" in summary and "dslaunch-3" in summary:
        summary["dslaunch-3"]["zero0_over_this"] = ratio_stats(timing, "dslaunch-3", "dslaunch-0")
    results = HERE / "results"
    results.mkdir(exist_ok=True)
    stem = "engine_bench" if args.world == WORLD else f"engine_bench_world{args.world}"
    (results / f"{stem}.json").write_text(json.dumps(
        {"model": f"MLP {LAYERS}x Linear({DIM},{DIM})", "params": LAYERS * (DIM * DIM + DIM),
         "world": args.world, "micro_batch": MICRO, "repeats": args.repeats, "steps": args.steps,
         "block": args.block, "load_average_1min": load, "summary": summary, "timing_runs": timing, "memory_runs": memory}, indent=1))
    rows = ["## Training engine (`engine_bench.py`)", "",
            f"{LAYERS * (DIM * DIM + DIM) / 1e6:.0f}M-parameter MLP, fp32 AdamW, {args.world} rank(s) on gloo, "
            f"micro batch {MICRO}, same model and data for all. Step time: median over {args.repeats} "
            f"rounds of the per-round median of {args.steps} turns x {args.block} consecutive steps "
            "(slowest rank per step); in each round all configurations share one process pair and "
            "take turns, so load from other processes hits them alike (the machine is a shared 2-core "
            "VM: absolute times are noisy, ratios less so). DDP / this: each round's ratio, then the "
            "median [quartiles] of the per-step ratios over all rounds. Peak RSS: max over ranks of a "
            f"separate run per configuration. Load average (1 min) during the run: {min(load):.1f}-"
            f"{max(load):.1f}.", "",
            "| config | step ms | DDP / this: per round (steps median [q1-q3]) | DeepSpeed same stage / this "
            "| peak RSS/rank MiB | RSS / DeepSpeed's |", "| --- | --- | --- | --- | --- | --- |"]
    ddp = summary.get("ddp-0")
    for key, s in summary.items():
        kind, stage = key.split("-")
        peer = summary.get(f"deepspeed-{stage}") if kind == "dslaunch" else None
        vs_ddp = ratio_text(s["ddp_over_this"]) if ddp and kind != "ddp" else "-"
        vs_ds = f"{peer['step_ms'] / s['step_ms']:.2f}x" if peer else "-"
        rss_ds = f"{s['rss_mib'] / peer['rss_mib']:.2f}" if peer else "-"
        name = ("torch DDP" if kind == "ddp" else f"dslaunch ZeRO-{stage}, gloo only" if kind == "gloo"
                else f"{kind} ZeRO-{stage}")
        rows.append(f"| {name} | {s['step_ms']:.0f} | {vs_ddp} | {vs_ds} | {s['rss_mib']:.0f} | {rss_ds} |")
    if "zero0_over_this" in summary.get("dslaunch-3", {}):
        rows += ["", "dslaunch ZeRO-0 / ZeRO-3 (> 1: ZeRO-3 faster): "
                 + ratio_text(summary["dslaunch-3"]["zero0_over_this"])]
    (results / f"{stem}.md").write_text("\n".join(rows) + "\n")
    print("\n".join(rows))


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1:3] == ["--worker", "time"]:
        _timing_worker(sys.argv[3].split(","), int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6]))
    elif len(sys.argv) > 2 and sys.argv[1:3] == ["--worker", "memory"]:
        _memory_worker(sys.argv[3], int(sys.argv[4]))
    else:
        main()
