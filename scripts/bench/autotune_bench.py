"""Autotuning: the exhaustive grid against the model-based tuner, on CPU/gloo at world 2.

The model is ``scripts/examples/autotune_train.py`` (a 131072 x 32 embedding table, cheap to
compute and large to keep and reduce, then residual MLP blocks over 32-token sequences), whose
best configuration depends on memory and speed: a larger micro batch is faster but needs more
activation memory, a higher ZeRO stage holds less but communicates more, checkpointing saves
activations and recomputes them. ``memory_per_device`` (per rank, enforced on CPU by the engine's
profile) leaves the largest micro batches out at low stages.

The space: ZeRO stages 0-3 x activation checkpointing x micro batch 128/256/512 (24 candidates).
Offload is left out here: on a CPU host the offloaded state stays in the same process memory,
so it can only cost time (the unit tests search it).

1. The grid: every candidate run (``TuneJob.exhaustive``: no pruning, no early stop).
2. The tuner as ``dslaunch --autotuning tune`` runs it: ``model_based``, ``tuner_num_trials`` a
   third of the grid, DeepSpeed's early stopping (5), the estimator's pruning, a real run.
3. The same pipeline (profiling experiment, estimator, pruning, tuner) replayed on the grid's
   measurements for 20 seeds: each experiment it asks for is looked up in the grid's table, so
   this measures the search itself, without the machine's run-to-run noise.

Each experiment warms up for ``START`` optimizer steps, then times the next ``END - START`` steps
one by one; its score is the median step's (``runtime/autotuning.py``), so one step stalled by a
neighbour on the shared host does not move it.

Run through ``/tmp/dsl/bench-quiet`` in two calls (each under 10 minutes): ``--phase grid`` runs
the grid and keeps its table in ``--work``; ``--phase tuner`` runs the tuner and the replay and
writes ``results/autotune_bench.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import replace
from functools import partial
from pathlib import Path

from dslaunch.launcher.autotuning.estimate import engine_estimate
from dslaunch.launcher.autotuning.experiments import ExperimentRunner, Outcome
from dslaunch.launcher.autotuning.search import SearchResult, score
from dslaunch.launcher.autotuning.space import build_space
from dslaunch.launcher.autotuning.tune import TuneJob, table, tune
from dslaunch.runtime.config.autotuning import AutotuningConfig

HERE = Path(__file__).resolve().parent
SCRIPT = str(HERE.parent / "examples" / "autotune_train.py")
MODEL = ["--vocab", "131072", "--seq", "32", "--depth", "2", "--width", "32"]
START, END = 3, 13  # warm-up steps, then 10 timed one by one


def _config(limit_mib: int, exps: Path, trials: int) -> dict:
    return {"train_micro_batch_size_per_gpu": 8, "steps_per_print": 100000,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            "autotuning": {"enabled": True, "tuner_type": "model_based", "metric": "throughput",
                           "start_profile_step": START, "end_profile_step": END, "offload": False,
                           "max_train_micro_batch_size_per_gpu": 512, "num_tuning_micro_batch_sizes": 3,
                           "memory_per_device": limit_mib * 2**20, "tuner_num_trials": trials,
                           "hang_timeout": 60, "experiment_timeout": 300, "exps_dir": str(exps)}}


def _job(cfg: dict, exps: Path, limit_mib: int, exhaustive: bool) -> TuneJob:
    at = AutotuningConfig(**{k: v for k, v in cfg["autotuning"].items()})
    runner = ExperimentRunner(["--num_gpus", "2"], [SCRIPT, *MODEL, "--deepspeed_config", "unset"],
                              "--deepspeed_config", str(exps), at.experiment_timeout, at.hang_timeout)
    return TuneJob(cfg, at, 2, runner, limit_mib * 2**20,
                   partial(engine_estimate, gpus_per_node=2, nodes=1, accelerator="cpu"), exhaustive=exhaustive)


class _Lookup:
    """An experiment runner that answers from the grid's table (the replay)."""

    def __init__(self, outcomes: dict) -> None:
        self.outcomes = outcomes

    def run(self, exp):
        return self.outcomes[exp.name]


def _progress(c, o) -> None:
    if o.status != "pruned":
        print(f"  {c.name}: {o.status} {o.metrics.get('throughput', 0):.0f} samples/s, "
              f"{o.metrics.get('peak_memory', 0) / 2**20:.0f} MiB, {o.seconds:.1f} s {o.message[:60]}", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--limit_mib", type=int, default=520, help="memory_per_device per rank, MiB")
    ap.add_argument("--out", type=Path, default=HERE / "results")
    ap.add_argument("--work", type=Path, default=Path("/tmp/dslaunch-autotune-bench"))
    ap.add_argument("--phase", choices=("grid", "tuner"), required=True)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    load_before = os.getloadavg()

    at = AutotuningConfig(offload=False, max_train_micro_batch_size_per_gpu=512)
    space = build_space(at, 2, 1)
    trials = len(space) // 3

    kept = args.work / "grid.json"
    if args.phase == "grid":
        print(f"grid: {len(space)} candidates", flush=True)
        grid_cfg = _config(args.limit_mib, args.work / "grid", trials)
        started = time.monotonic()
        grid = tune(_job(grid_cfg, args.work / "grid", args.limit_mib, exhaustive=True), on_result=_progress)
        kept.write_text(json.dumps({"seconds": time.monotonic() - started, "load_avg_before": load_before,
                                    "load_avg_after": os.getloadavg(), "best": grid.best.name if grid.best else None,
                                    "runs": [json.loads(o.to_json()) for _, o in grid.runs]}))
        return 0
    saved = json.loads(kept.read_text())
    outcomes = {o["name"]: Outcome.from_json(json.dumps(o)) for o in saved["runs"]}
    grid = SearchResult(tuple((c, outcomes[c.name]) for c in space),
                        next(c for c in space if c.name == saved["best"]))
    grid_s = saved["seconds"]
    measured = {c: o for c, o in grid.runs}
    grid_best = score("throughput", measured[grid.best].metrics)

    print(f"tuner: model_based, at most {trials} experiments", flush=True)
    tuner_cfg = _config(args.limit_mib, args.work / "tuner", trials)
    started = time.monotonic()
    tuned = tune(_job(tuner_cfg, args.work / "tuner", args.limit_mib, exhaustive=False), on_result=_progress)
    tuner_s = time.monotonic() - started
    own = score("throughput", tuned.outcome(tuned.best).metrics) if tuned.best else None
    in_grid = score("throughput", measured[tuned.best].metrics) if tuned.best and measured[tuned.best].status == "ok" else None

    replays = []
    by_name = {c.name: o for c, o in grid.runs}
    for seed in range(20):
        cfg = _config(args.limit_mib, args.work / "replay", trials)
        cfg["autotuning"]["seed"] = seed
        job = replace(_job(cfg, args.work / "replay", args.limit_mib, exhaustive=False), runner=_Lookup(by_name))
        r = tune(job)
        best = score("throughput", measured[r.best].metrics) if r.best else 0.0
        replays.append({"seed": seed, "experiments": r.experiments, "best": r.best.name if r.best else None,
                        "ratio": round(best / grid_best, 4)})

    result = {
        "load_avg_grid": [saved["load_avg_before"], saved["load_avg_after"]],
        "load_avg_before": load_before, "load_avg_after": os.getloadavg(), "cpus": os.cpu_count(),
        "model": MODEL, "limit_mib": args.limit_mib, "space": len(space),
        "grid": {"experiments": grid.experiments, "seconds": round(grid_s, 1), "best": grid.best.name,
                 "throughput": round(grid_best, 1),
                 "statuses": {s: sum(1 for _, o in grid.runs if o.status == s) for s in {o.status for _, o in grid.runs}},
                 "table": [{"name": c.name, "status": o.status, "throughput": o.metrics.get("throughput"),
                            "peak_mib": round(o.metrics.get("peak_memory", 0) / 2**20), "seconds": o.seconds}
                           for c, o in grid.runs]},
        "tuner": {"experiments": tuned.experiments, "pruned": len(tuned.runs) - tuned.experiments,
                  "seconds": round(tuner_s, 1), "best": tuned.best.name if tuned.best else None,
                  "throughput_own_run": round(own, 1) if own else None,
                  "ratio_own_run": round(own / grid_best, 4) if own else None,
                  "ratio_grid_measured": round(in_grid / grid_best, 4) if in_grid else None,
                  "experiments_ratio": round(tuned.experiments / grid.experiments, 3),
                  "order": [(c.name, o.status) for c, o in tuned.runs]},
        "replay": {"seeds": len(replays), "within_5pct": sum(r["ratio"] >= 0.95 for r in replays),
                   "mean_experiments": sum(r["experiments"] for r in replays) / len(replays),
                   "max_experiments": max(r["experiments"] for r in replays), "runs": replays},
    }
    (args.out / "autotune_bench.json").write_text(json.dumps(result, indent=1))
    md = ["## Autotuning: the exhaustive grid against the tuner (`scripts/bench/autotune_bench.py`)", "",
          f"grid ({grid.experiments} experiments, {grid_s:.0f} s):", "", "```",
          table(grid, "throughput"), "```", "", f"tuner ({tuned.experiments} experiments, {tuner_s:.0f} s):",
          "", "```", table(tuned, "throughput"), "```"]
    (args.out / "autotune_bench.md").write_text("\n".join(md) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k not in ("grid", "replay")} |
                     {"grid_best": result["grid"]["best"], "grid_throughput": result["grid"]["throughput"],
                      "replay": {k: v for k, v in result["replay"].items() if k != "runs"}}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
