"""How closely the 1-bit optimizers track their plain peers, over learning rates and seeds.

One test run judges a 1% gap only roughly (the task's own noise: the same optimizer on the same
batches in another order differs by ~0.9%), so this runs a grid: for each learning rate and seed
(of model and data), the plain optimizer and its compressed twin on ``onebit_task`` (a tiny language
model; by default 40 steps, 10 warm-up, a constant lr: ``--steps``, ``--freeze-step``, ``--decay``),
and reports the held-out gap of each cell, the mean gap and the mean absolute gap.

    python scripts/bench/onebit_convergence.py --out scripts/bench/results/onebit_convergence.json
    python scripts/bench/onebit_convergence.py --pairs lamb --lrs 0.05 0.1 0.2 --decay --steps 160 \
        --freeze-step 40 --out scripts/bench/results/onebit_convergence_lamb_decay160.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.distributed import run_world  # noqa: E402
from tests.runtime.optim.onebit_task import config, linear_decay, train  # noqa: E402

STEPS, FREEZE, HELD_OUT = 40, 10, 4096
PAIRS = {  # plain, compressed (learning rate filled in; ``freeze_step`` from --freeze-step), ZeRO stage
    "adam": ({"type": "Adam", "params": {}}, {"type": "OneBitAdam", "params": {}}, 1),
    "lamb": ({"type": "Lamb", "params": {"weight_decay": 0.01}},
             {"type": "OneBitLamb", "params": {"weight_decay": 0.01}}, 1),
    "zero_one": ({"type": "Adam", "params": {}},
                 {"type": "ZeroOneAdam", "params": {"var_freeze_step": 20, "var_update_scaler": 4,
                                                    "local_step_scaler": 8, "local_step_clipper": 4}}, 0),
}
LRS = {"adam": (5e-3, 1e-2, 2e-2), "lamb": (2.5e-2, 5e-2, 1e-1), "zero_one": (5e-3, 1e-2, 2e-2)}


def _with(optimizer: dict, lr: float, freeze: int) -> dict:
    """``optimizer`` at learning rate ``lr``; a 1-bit one compressing after ``freeze`` steps."""
    frozen = {"freeze_step": freeze} if optimizer["type"] in ("OneBitAdam", "OneBitLamb") else {}
    return {"type": optimizer["type"], "params": {**optimizer["params"], **frozen, "lr": lr}}


def _cell(rank: int, world: int, cfgs: list[dict], seed: int, steps: int) -> list[float]:
    return [train(rank, world, cfg, steps, seed=seed, held_out=HELD_OUT)["held_out"] for cfg in cfgs]


def sweep(pair: str, world: int, lrs: tuple[float, ...], seeds: tuple[int, ...], steps: int = STEPS,
          freeze: int = FREEZE, decay: bool = False) -> dict[str, Any]:
    plain, compressed, stage = PAIRS[pair]
    cells = []
    for lr in lrs:
        for seed in seeds:
            extra = linear_decay(lr, steps) if decay else {}
            cfgs = [config(_with(opt, lr, freeze), stage, **extra) for opt in (plain, compressed)]
            losses = run_world(_cell, world, cfgs, seed, steps, timeout=600.0)[0]
            cell = {"lr": lr, "seed": seed, "plain": losses[0], "compressed": losses[1],
                    "gap": losses[1] / losses[0] - 1.0}
            cells.append(cell)
            print(json.dumps(cell), flush=True)
    gaps = [c["gap"] for c in cells]
    return {"pair": pair, "world": world, "steps": steps, "freeze_step": freeze, "lr_decay": decay, "held_out": HELD_OUT,
            "cells": cells, "mean_gap": statistics.fmean(gaps), "mean_abs_gap": statistics.fmean(map(abs, gaps)),
            "largest_gap": max(gaps, key=abs)}


def table(reports: list[dict[str, Any]]) -> str:
    lines = ["| compressed vs plain | world | mean gap | mean abs gap | largest | cells over 1% |",
             "|---|---|---|---|---|---|"]
    for r in reports:
        over = sum(abs(c["gap"]) > 0.01 for c in r["cells"])
        lines.append(f"| {r['pair']} | {r['world']} | {r['mean_gap']:+.2%} | {r['mean_abs_gap']:.2%} | "
                     f"{r['largest_gap']:+.2%} | {over} of {len(r['cells'])} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", choices=sorted(PAIRS), nargs="+", default=sorted(PAIRS))
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--lrs", type=float, nargs="+", help="default: three per pair around the tests' lr")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=STEPS, help="training steps per run")
    parser.add_argument("--freeze-step", type=int, default=FREEZE,
                        help="OneBitAdam's and OneBitLamb's warm-up steps (ZeroOneAdam's schedule is fixed)")
    parser.add_argument("--decay", action="store_true", help="the learning rate decays linearly to 0 (WarmupDecayLR)")
    parser.add_argument("--out", type=Path, help="JSON report; a Markdown table beside it")
    args = parser.parse_args()
    reports = [sweep(pair, world, tuple(args.lrs or LRS[pair]), tuple(args.seeds), args.steps, args.freeze_step,
                     args.decay)
               for pair in args.pairs for world in args.worlds]
    print(table(reports), end="")
    if args.out:
        args.out.write_text(json.dumps(reports, indent=1) + "\n")
        args.out.with_suffix(".md").write_text(table(reports))


if __name__ == "__main__":
    main()
