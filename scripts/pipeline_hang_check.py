"""Pipeline hang check: many short pipeline runs at 2-4 stages on gloo; count the ones that hang.

Each run is a fresh world of processes (forked from a forkserver that imported torch once:
``tests/distributed.py``) that builds a ``PipelineModule`` and trains ``STEPS`` batches, then
evaluates one. The runs cycle through ``SHAPES``: 2, 3 and 4 stages with 1F1B, 2 stages x 2
replicas with ZeRO-1, the interleaved schedule at 2 and 4 stages, DualPipeV (a ``DualPipeVModule``)
at 2 and 3 ranks; the micro batches per step vary with the run (1-5 for 1F1B, 1-2 rounds of the
stages for interleaved, 2-4 times the stages for DualPipeV). A run whose ranks do not all
finish within ``--timeout`` seconds is a hang (its ranks are killed); one that raises is a failure.

Usage: ``python scripts/pipeline_hang_check.py [--runs 200] [--first 0] [--timeout 60] [--out DIR]``
(``--first``: the index of the first run, to split the 200 over several calls; ``--merge
A.json B.json ...`` then makes one report of them). Writes
``pipeline_hang_check.json`` and ``.md`` into ``--out`` (default scripts/bench/results) and exits 1
when any run hung or failed. ``tests/runtime/pipe/test_hang_check.py`` runs a short version.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

STEPS = 3
# (stages, world, schedule, virtual stages, ZeRO stage); "dualpipev": a DualPipeVModule (two parts per rank)
SHAPES = [(2, 2, "1f1b", 1, 0), (3, 3, "1f1b", 1, 0), (4, 4, "1f1b", 1, 0), (2, 4, "1f1b", 1, 1),
          (2, 2, "interleaved", 2, 0), (4, 4, "interleaved", 2, 0), (2, 2, "dualpipev", 2, 0), (3, 3, "dualpipev", 2, 0)]


def _micro_batches(run: int, stages: int, schedule: str) -> int:
    if schedule == "dualpipev":
        return stages * (2 + run // len(SHAPES) % 3)
    return stages * (1 + run // len(SHAPES) % 2) if schedule == "interleaved" else 1 + run // len(SHAPES) % 5


def _run(rank: int, world: int, stages: int, schedule: str, virtual: int, zero: int, gas: int) -> float:
    """One rank of one run: train ``STEPS`` batches and evaluate one; returns the last loss."""
    import torch

    import dslaunch
    from dslaunch.pipe import DualPipeVModule, LayerSpec, PipelineModule

    dslaunch.init_distributed(verbose=False)
    layers = [LayerSpec(torch.nn.Linear, 8, 8) if i % 2 == 0 else LayerSpec(torch.nn.Tanh)
              for i in range(2 * stages * virtual)]
    dualpipev = schedule == "dualpipev"
    module = (DualPipeVModule(layers, num_stages=stages, loss_fn=torch.nn.functional.mse_loss,
                              partition_method="type:linear") if dualpipev else
              PipelineModule(layers, num_stages=stages, loss_fn=torch.nn.functional.mse_loss,
                             partition_method="type:linear", virtual_stages=virtual))
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": gas, "steps_per_print": 10**9,
           "optimizer": {"type": "SGD", "params": {"lr": 0.01}}, "zero_optimization": {"stage": zero},
           "pipeline": {"schedule": "1f1b" if dualpipev else schedule}, "dist_init_timeout": 120}
    engine, *_ = dslaunch.initialize(model=module, config=cfg)
    g = torch.Generator().manual_seed(rank)
    data = iter(lambda: (lambda x: (x, x.tanh()))(torch.randn(2, 8, generator=g)), None)
    for _ in range(STEPS):
        loss = engine.train_batch(data)
    engine.eval_batch(data)
    return float(loss)


def check(runs: int, first: int, timeout: float) -> list[dict]:
    from tests.distributed import preload, run_world

    preload(["dslaunch", "dslaunch.pipe"])
    records = []
    for run in range(first, first + runs):
        stages, world, schedule, virtual, zero = SHAPES[run % len(SHAPES)]
        gas = _micro_batches(run, stages, schedule)
        start, outcome, detail = time.monotonic(), "ok", ""
        try:
            run_world(_run, world, stages, schedule, virtual, zero, gas, timeout=timeout)
        except AssertionError as err:  # run_world's report: a rank that raised, or ranks that never finished
            outcome = "hang" if "did not finish" in str(err) else "failed"
            detail = str(err)[-2000:]
        records.append({"run": run, "stages": stages, "world": world, "schedule": schedule, "virtual": virtual,
                        "zero": zero, "micro_batches": gas, "outcome": outcome,
                        "seconds": round(time.monotonic() - start, 2), "detail": detail})
        print(json.dumps({k: v for k, v in records[-1].items() if k != "detail"}), flush=True)
    return records


def _markdown(records: list[dict], load: str, seconds: float) -> str:
    count = {o: sum(r["outcome"] == o for r in records) for o in ("ok", "hang", "failed")}
    lines = [f"## Pipeline hang check: {len(records)} short runs at 2-4 stages (`scripts/pipeline_hang_check.py`)", "",
             f"{count['hang']} hung, {count['failed']} failed, {count['ok']} finished; {seconds:.0f} s in all; "
             f"load average {load}.", "",
             "| stages x replicas | schedule | runs | hung | failed | median s |", "|---|---|---|---|---|---|"]
    for stages, world, schedule, virtual, zero in SHAPES:
        mine = [r for r in records if (r["stages"], r["world"], r["schedule"]) == (stages, world, schedule)]
        if mine:
            secs = sorted(r["seconds"] for r in mine)
            name = schedule + (f" (v={virtual})" if virtual > 1 and schedule != "dualpipev" else "") + (f", ZeRO-{zero}" if zero else "")
            lines.append(f"| {stages} x {world // stages} | {name} | {len(mine)} | "
                         f"{sum(r['outcome'] == 'hang' for r in mine)} | {sum(r['outcome'] == 'failed' for r in mine)} "
                         f"| {secs[len(secs) // 2]:.1f} |")
    return "\n".join(lines) + "\n"


def _write(out: Path, name: str, records: list[dict], load: list[list[float]], seconds: float) -> None:
    """``load``: the load averages (1, 5, 15 min) at the start and end of each call."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps({"load": load, "seconds": round(seconds, 1),
                                                  "runs": records}, indent=2) + "\n")
    ones = [x[0] for x in load]
    load = f"(1 min) {ones[0]} at the start, {ones[-1]} at the end, {min(ones)}-{max(ones)} between calls"
    (out / f"{name}.md").write_text(_markdown(records, load, seconds))
    print(_markdown(records, load, seconds))


def _merge(parts: list[Path], out: Path) -> list[dict]:
    """One report of several calls' (``--first``) JSON files: runs in order, times summed, the
    load range."""
    loaded = [json.loads(p.read_text()) for p in parts]
    records = sorted((r for d in loaded for r in d["runs"]), key=lambda r: r["run"])
    load = [x for d in loaded for x in d["load"]]
    _write(out, "pipeline_hang_check", records, load, sum(d["seconds"] for d in loaded))
    return records


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument("--first", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=60.0)
    parser.add_argument("--out", type=Path, default=ROOT / "scripts" / "bench" / "results")
    parser.add_argument("--merge", type=Path, nargs="+", metavar="JSON", help="combine these calls' results")
    args = parser.parse_args()
    if args.merge:
        records = _merge(args.merge, args.out)
    else:
        before, start = [round(x, 2) for x in os.getloadavg()], time.monotonic()
        records = check(args.runs, args.first, args.timeout)
        seconds, after = time.monotonic() - start, [round(x, 2) for x in os.getloadavg()]
        name = "pipeline_hang_check" + (f"_from{args.first}" if args.first else "")
        _write(args.out, name, records, [before, after], seconds)
    return 0 if all(r["outcome"] == "ok" for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
