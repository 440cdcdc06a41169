"""MoE under ZeRO-3 with starving experts: 500 steps, 0 hangs (issue 39).

World 4 on gloo (one thread per rank), the tests' tiny MoE net (``tests/runtime/moe/models.py``,
``starving_model``): 4 experts at ep 2, top-1, no token dropping, the gate forced so that experts
2 and 3 (both on expert rank 1) get no token from any rank and expert 1 none from the even ranks.
DeepSpeed users see such runs hang in ZeRO-3's parameter gathers (its issues 4808, 5066, 7461);
here every rank runs every exchange and every local expert whatever the routing.

Each run is one world of ``--steps`` steps; every collective carries a ``--collective-timeout``
(a rank left waiting raises instead of hanging), and the world is killed at ``--world-timeout``.
A run that raises a timeout or is killed counts as a hang. Reported: steps finished per rank,
hangs, the routing seen on the first and last step, wall time. Writes
``results/moe_starve.json`` and ``.md`` (or to ``--out``).

Usage: ``flock /tmp/dslaunch-bench.lock .venv/bin/python scripts/bench/moe_starve.py [--steps 500]
[--runs 1]``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
sys.path.insert(0, str(ROOT))  # the tests' model and run_world (and dslaunch)

from tests.distributed import run_world  # noqa: E402
from tests.runtime.moe.models import starving_counts, train_starving  # noqa: E402

WORLD = 4


def _run(steps: int, collective_timeout: float, world_timeout: float) -> dict:
    start = time.perf_counter()
    try:
        results = run_world(train_starving, WORLD, steps, collective_timeout, timeout=world_timeout)
    except Exception as exc:  # a rank raised (a collective timed out) or the world was killed
        return {"hang": True, "error": str(exc).splitlines()[-1][:300], "wall_s": time.perf_counter() - start}
    routed = all(r["counts"] == [starving_counts(rank)] * 2 for rank, r in enumerate(results))
    return {"hang": False, "steps": [len(r["losses"]) for r in results], "routing_as_forced": routed,
            "finite": all(x == x for r in results for x in r["losses"]),
            "loop_s": max(r["wall_s"] for r in results), "wall_s": time.perf_counter() - start,
            "first_loss": results[0]["losses"][0], "last_loss": results[0]["losses"][-1]}


def _table(runs: list[dict], steps: int, load: tuple[float, ...], when: str) -> str:
    lines = [f"MoE ZeRO-3 starving experts, world {WORLD}, {steps} steps per run ({when}, load "
             f"{load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f})", "",
             "| run | steps per rank | hang | routing as forced | loop s | ms / step | wall s |",
             "| ---: | --- | --- | --- | ---: | ---: | ---: |"]
    for i, r in enumerate(runs):
        if r["hang"]:
            lines.append(f"| {i} | - | yes: {r['error']} | - | - | - | {r['wall_s']:.1f} |")
        else:
            lines.append(f"| {i} | {r['steps']} | no | {r['routing_as_forced']} | {r['loop_s']:.1f} | "
                         f"{1000 * r['loop_s'] / steps:.1f} | {r['wall_s']:.1f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=500)
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--collective-timeout", type=float, default=120.0, help="seconds, every collective")
    ap.add_argument("--world-timeout", type=float, default=1800.0, help="seconds, a whole run")
    ap.add_argument("--out", type=Path, default=HERE / "results")
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    runs = [_run(args.steps, args.collective_timeout, args.world_timeout) for _ in range(args.runs)]
    load = os.getloadavg()
    summary = {"world": WORLD, "steps": args.steps, "runs": runs, "hangs": sum(r["hang"] for r in runs),
               "when": when, "load": load}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "moe_starve.json").write_text(json.dumps(summary, indent=1))
    table = _table(runs, args.steps, load, when)
    (args.out / "moe_starve.md").write_text(table)
    print(table)
    sys.exit(1 if summary["hangs"] else 0)


if __name__ == "__main__":
    main()
