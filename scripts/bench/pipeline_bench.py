"""Pipeline bubble benchmark: per-rank busy time -> the measured bubble of each schedule against
its formula, and the step time of the same model under dslaunch, DeepSpeed 0.19.8's
``PipelineEngine`` and ``torch.distributed.pipelining``, in one run (4 ranks on gloo).

Model: ``LAYERS`` synthetic layers (a 16x16 ``Linear``, so every part has weights, then a
calibrated sleep: ``--forward-ms`` per stage and micro batch forward, twice that backward, split
evenly over the stage's layers). Sleeping ranks do not compete for the machine's 2 cores, so the
4 stages run as on 4 devices. Each layer adds the wall time it slept to its rank's busy time;
a step's bubble on a rank is ``1 - busy / step time`` (the time from a barrier until the last
rank's ``train_batch`` returned), averaged over ``--steps`` steps and the 4 ranks. The formula: 1F1B
``(p-1)/(m+p-1)``; interleaved 1F1B with ``v`` parts per rank ``(p-1)/(v*m+p-1)``; at p=4, m=8:
27.3%, 15.8% (v=2), 8.6% (v=4); DualPipeV (``dualpipev``: a ``DualPipeVModule``, two half-stages per
rank in a V) by the schedule simulator, 22.6%. The formula counts no time between the stages: each message on
the schedule's critical path (2 per slot) adds its latency, which shrinks relative to the stages'
compute as ``--forward-ms`` grows.

Peers: DeepSpeed 0.19.8 (its ``TrainSchedule``, 1F1B, and its ``DualPipeVEngine``) in the DeepSpeed venv (``--ds-venv``,
default /tmp/venv-ds-inf, with ``DS_ACCELERATOR=cpu``); torch 2.13's ``Schedule1F1B`` and
``ScheduleInterleaved1F1B`` in this venv. Each configuration runs in its own 4 processes, one
after the other.

Usage: ``/tmp/dsl/bench-quiet .venv/bin/python scripts/bench/pipeline_bench.py [--steps 8]
[--forward-ms 50] [--only NAME ...]``. Writes results/pipeline_bench.{json,md}
(``pipeline_bench_<ms>ms.*`` at another ``--forward-ms``); with ``--only`` some configurations,
they replace theirs in that file and the others stay (same steps, warm-up and stage time), so a
run can be split over calls; the load average of each call is recorded.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

from ranks import report, run_ranks

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
STAGES, MICRO_BATCHES, LAYERS, WIDTH, MICRO = 4, 8, 16, 16, 2
FORWARD_MS = 50.0  # default per stage and micro batch (--forward-ms); backward takes twice that
LR = 0.01

# name -> (system, schedule, parts per rank)
CONFIGS: dict[str, tuple[str, str, int]] = {
    "dslaunch-1f1b": ("dslaunch", "1f1b", 1),
    "dslaunch-interleaved-v2": ("dslaunch", "interleaved", 2),
    "dslaunch-interleaved-v4": ("dslaunch", "interleaved", 4),
    "dslaunch-dualpipev": ("dslaunch", "dualpipev", 2),
    "deepspeed-1f1b": ("deepspeed", "1f1b", 1),
    "deepspeed-dualpipev": ("deepspeed", "dualpipev", 2),
    "torch-1f1b": ("torch", "1f1b", 1),
    "torch-interleaved-v4": ("torch", "interleaved", 4),
}


def formula(schedule: str, parts: int, stages: int = STAGES, micro: int = MICRO_BATCHES) -> float:
    """The bubble fraction of a batch: the fill and drain over the whole. DualPipeV's is the schedule
    simulator's (``tests/runtime/pipe/test_dualpipev_schedule.py``) at backward = 2 x forward: idle
    ``2.5 (p-1) - 0.5`` forwards of a stage, against 1F1B's ``3 (p-1)``."""
    if schedule == "dualpipev":
        idle = 2.5 * (stages - 1) - 0.5
        return idle / (3 * micro + idle)
    return (stages - 1) / (parts * micro + stages - 1) if schedule == "interleaved" else (stages - 1) / (micro + stages - 1)


# ----- worker side ----------------------------------------------------------------------------
class Meter:
    """This rank's busy time: the wall time its layers spent computing (sleeping)."""

    def __init__(self) -> None:
        self.busy = 0.0


def _sleep_layer_class():
    import torch

    class _Sleep(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, seconds, meter):
            ctx.seconds, ctx.meter = seconds, meter
            _spend(seconds, meter)
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            _spend(2 * ctx.seconds, ctx.meter)
            return grad, None, None

    class SleepLayer(torch.nn.Module):
        """A small Linear, then ``seconds`` of sleep forward (twice that backward)."""

        def __init__(self, seconds: float, meter: Meter):
            super().__init__()
            self.lin = torch.nn.Linear(WIDTH, WIDTH)
            self.seconds, self.meter = seconds, meter

        def forward(self, x):
            return _Sleep.apply(self.lin(x), self.seconds, self.meter)

    return SleepLayer


def _spend(seconds: float, meter: Meter) -> None:
    start = time.perf_counter()
    time.sleep(seconds)
    meter.busy += time.perf_counter() - start


def _loss(out, y):
    import torch

    return torch.nn.functional.mse_loss(out, y)


def _batches(rank: int):
    """The same micro batch forever (the time does not depend on the values)."""
    import torch

    g = torch.Generator().manual_seed(0)
    x = torch.randn(MICRO, WIDTH, generator=g)
    return x, x.sin()


def _layers(meter: Meter, forward_ms: float) -> list:
    per_layer, cls = forward_ms / 1000 * STAGES / LAYERS, _sleep_layer_class()
    return [(cls, per_layer, meter) for _ in range(LAYERS)]


def _build(name: str, meter: Meter, forward_ms: float):
    """One configuration -> a function running one training step (all its micro batches)."""

    system, schedule, parts = CONFIGS[name]
    specs = _layers(meter, forward_ms)
    x, y = _batches(0)
    if system == "torch":
        return _build_torch(specs, schedule, parts, x, y)
    if system == "deepspeed":
        import deepspeed as ds
        from deepspeed.pipe import DualPipeVModule, LayerSpec, PipelineModule

        ds.init_distributed(dist_backend="gloo")  # its comm wraps the process group made above
    else:
        import dslaunch as ds
        from dslaunch.pipe import DualPipeVModule, LayerSpec, PipelineModule
    extra = {"virtual_stages": parts} if system == "dslaunch" and schedule != "dualpipev" else {}
    module = (DualPipeVModule if schedule == "dualpipev" else PipelineModule)([LayerSpec(cls, *args) for cls, *args in specs], num_stages=STAGES, loss_fn=_loss,
                            partition_method="uniform", **extra)
    cfg = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": MICRO_BATCHES,
           "train_batch_size": MICRO * MICRO_BATCHES, "steps_per_print": 10**9, "gradient_clipping": 0.0,
           "optimizer": {"type": "SGD", "params": {"lr": LR}}}
    if system == "dslaunch" and schedule != "dualpipev":  # a DualPipeVModule runs its own
        cfg["pipeline"] = {"schedule": schedule}
    engine, *_ = ds.initialize(model=module, config=cfg, model_parameters=[p for p in module.parameters()])
    data = iter(lambda: (x, y), None)
    return lambda: engine.train_batch(data)


def _build_torch(specs: list, schedule: str, parts: int, x, y):
    import torch
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleInterleaved1F1B

    rank, total = dist.get_rank(), STAGES * parts
    per = LAYERS // total
    stages, params = [], []
    for part in range(rank, total, STAGES):  # rank r holds parts r, r + STAGES, ...
        mod = torch.nn.Sequential(*(cls(*args) for cls, *args in specs[part * per:(part + 1) * per]))
        params += list(mod.parameters())
        stages.append(PipelineStage(mod, part, total, torch.device("cpu")))
    opt = torch.optim.SGD(params, lr=LR)
    if schedule == "interleaved":
        pipe = ScheduleInterleaved1F1B(stages, n_microbatches=MICRO_BATCHES, loss_fn=_loss)
    else:
        pipe = Schedule1F1B(stages[0], n_microbatches=MICRO_BATCHES, loss_fn=_loss)
    xs, ys = x.repeat(MICRO_BATCHES, 1), y.repeat(MICRO_BATCHES, 1)

    def step():
        opt.zero_grad()
        if rank == 0:
            pipe.step(xs)
        elif rank == STAGES - 1:
            pipe.step(target=ys)
        else:
            pipe.step()
        opt.step()
    return step


def worker(name: str, steps: int, warmup: int, forward_ms: float) -> None:
    import datetime

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    meter = Meter()
    step = _build(name, meter, forward_ms)
    times, busy = [], []
    for i in range(warmup + steps):
        dist.barrier()
        before, start = meter.busy, time.perf_counter()
        step()
        elapsed = time.perf_counter() - start
        if i >= warmup:
            times.append(elapsed)
            busy.append(meter.busy - before)
    report({"times": times, "busy": busy})


# ----- driver -----------------------------------------------------------------------------------
def _summary(name: str, ranks: list[dict]) -> dict:
    """A step's time is its slowest rank's (the batch is done when every stage is); a rank's
    bubble in it: the part of that time it did not compute."""
    system, schedule, parts = CONFIGS[name]
    steps = [max(r["times"][i] for r in ranks) for i in range(len(ranks[0]["times"]))]
    per_rank = [statistics.mean(1 - b / t for t, b in zip(steps, r["busy"], strict=True)) for r in ranks]
    bubble, want = statistics.mean(per_rank), formula(schedule, parts)
    return {"system": system, "schedule": schedule, "parts_per_rank": parts,
            "step_ms": round(statistics.median(steps) * 1e3, 1), "bubble": round(bubble, 4),
            "bubble_per_rank": [round(b, 4) for b in per_rank], "formula": round(want, 4),
            "off_points": round(100 * (bubble - want), 2)}


def _markdown(results: dict, meta: dict) -> str:
    base = results.get("dslaunch-1f1b", {})
    ms = meta["forward_ms"]
    lines = ["## Pipeline bubble and step time (`scripts/bench/pipeline_bench.py`)", "",
             f"p={STAGES} stages, m={MICRO_BATCHES} micro batches, {ms:g} ms forward + {2 * ms:g} ms backward "
             "(sleeps) per stage and micro batch, gloo, 4 ranks.", "",
             f"{meta['steps']} steps after {meta['warmup']} warm-up. Load average before/after each call:",
             "",
             *(f"- {c['start']}, {', '.join(c['only'])}: {c['load_before']} / {c['load_after']}"
               for c in meta["calls"]), "",
             "| configuration | step ms | bubble measured | formula | points off | bubble / dslaunch 1F1B's |"
             " step / dslaunch 1F1B's |", "|---|---|---|---|---|---|---|"]
    for name, r in results.items():
        if "error" in r:
            lines.append(f"| {name} | failed: {r['error'].splitlines()[-1][:150] if r['error'] else '?'} |||||")
            continue
        ratio = f"{r['bubble'] / base['bubble']:.2f}" if base.get("bubble") else "-"
        step = f"{r['step_ms'] / base['step_ms']:.2f}" if base.get("step_ms") else "-"
        lines.append(f"| {name} | {r['step_ms']:.1f} | {100 * r['bubble']:.1f}% | {100 * r['formula']:.1f}% | "
                     f"{r['off_points']:+.1f} | {ratio} | {step} |")
    return "\n".join(lines) + "\n"


def _earlier(path: Path, args: argparse.Namespace) -> tuple[dict, dict]:
    """With ``--only`` a subset: the results file's earlier calls and configurations (those of the same
    steps, warm-up and stage time), so a run split over several calls ends as one file."""
    if not path.exists():
        return {}, {}
    old = json.loads(path.read_text())
    same = all(old["meta"].get(k) == v for k, v in
               (("steps", args.steps), ("warmup", args.warmup), ("forward_ms", args.forward_ms)))
    if not same or "calls" not in old["meta"]:
        return {}, {}
    return old["meta"], {k: v for k, v in old["results"].items() if k not in args.only}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--forward-ms", type=float, default=FORWARD_MS)
    parser.add_argument("--ds-venv", default="/tmp/venv-ds-inf")
    parser.add_argument("--only", nargs="*", default=list(CONFIGS), choices=list(CONFIGS))
    args = parser.parse_args()
    out = HERE / "results"
    name = "pipeline_bench" + ("" if args.forward_ms == FORWARD_MS else f"_{args.forward_ms:g}ms")
    meta, results = _earlier(out / f"{name}.json", args) if len(args.only) < len(CONFIGS) else ({}, {})
    meta.update({"steps": args.steps, "warmup": args.warmup, "forward_ms": args.forward_ms})
    call = {"only": args.only, "load_before": [round(x, 2) for x in os.getloadavg()],
            "start": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    for config in args.only:
        peer = CONFIGS[config][0] == "deepspeed"
        python = str(Path(args.ds_venv) / "bin" / "python") if peer else sys.executable
        argv = [config, str(args.steps), str(args.warmup), str(args.forward_ms)]
        ranks, why = run_ranks(__file__, argv, STAGES, timeout=300, python=python,
                               extra_env={"PYTHONPATH": str(ROOT)})
        results[config] = _summary(config, ranks) if ranks else {"error": why}
        print(config, json.dumps(results[config]), flush=True)
    call["load_after"] = [round(x, 2) for x in os.getloadavg()]
    meta["calls"] = meta.get("calls", []) + [call]
    results = {n: results[n] for n in CONFIGS if n in results}
    (out / f"{name}.json").write_text(json.dumps({"meta": meta, "results": results}, indent=2) + "\n")
    (out / f"{name}.md").write_text(_markdown(results, meta))
    print(_markdown(results, meta))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5]))
    else:
        main()
