"""The cost of ``layout_invariant`` in AutoTP training: step time with the mode off and on at tp 2.

Model: the tests' plain-torch GQA language model (``tests/inference/models.py``'s ``TinyLM``)
widened to ``HIDDEN`` (8 query heads over 4 KV heads, MLP ``INNER``, ``LAYERS`` blocks, vocabulary
``VOCAB``); ``BATCH`` sequences of ``SEQ`` tokens per step, fp32, Adam, clipping 1.0, ZeRO-1, 2 gloo
ranks with one thread each, ``autotp_size`` 2. Under the mode (``chunks`` 4) each column and row
layer runs 2 matmuls of half the width per rank, and the row layers' partial sums are all-gathered
(2x the bytes of the all-reduce) and added in a tree. Both engines live in the same 2 processes
and take turns step by step (a barrier before each), so load from the rest of the machine hits
them alike; the table shows the median over steps of the slower rank's step.

Usage: ``flock /tmp/dslaunch-bench.lock python scripts/bench/tp_invariant_bench.py [--steps 20] [--warmup 3]``.
Writes scripts/bench/results/tp_invariant_bench.{json,md}.
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
WORLD, TP, VOCAB, HIDDEN, INNER, LAYERS, BATCH, SEQ = 2, 2, 1024, 256, 1024, 2, 8, 128
MODES = ("off", "on")


def _worker(steps: int, warmup: int) -> None:
    import torch

    sys.path.insert(0, str(HERE.parents[1]))
    import dslaunch
    from tests.inference.models import TinyLM

    torch.set_num_threads(1)
    engines = {}
    for mode in MODES:
        torch.manual_seed(0)
        config = {"train_micro_batch_size_per_gpu": BATCH, "optimizer": {"type": "Adam", "params": {"lr": 1e-4}},
                  "gradient_clipping": 1.0, "zero_optimization": {"stage": 1},
                  "tensor_parallel": {"autotp_size": TP}, "steps_per_print": 10**9,
                  "layout_invariant": {"enabled": mode == "on", "chunks": 4}}
        model = TinyLM(vocab=VOCAB, hidden=HIDDEN, heads=8, kv_heads=4, inner=INNER, layers=LAYERS)
        engines[mode] = dslaunch.initialize(model=model, config=config)[0]
    gen = torch.Generator().manual_seed(0)
    data = [torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=gen) for _ in range(4)]
    times: dict[str, list[float]] = {mode: [] for mode in MODES}
    for i in range(warmup + steps):
        for mode in MODES if i % 2 else MODES[::-1]:
            engine, ids = engines[mode], data[i % len(data)]
            torch.distributed.barrier()
            t0 = time.perf_counter()
            logits = engine(ids[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
            engine.backward(loss)
            engine.step()
            if i >= warmup:
                times[mode].append((time.perf_counter() - t0) * 1e3)
    report({mode: times[mode] for mode in MODES})


def main() -> None:
    if sys.argv[1:2] == ["--worker"]:  # a rank started by run_ranks
        return _worker(int(sys.argv[2]), int(sys.argv[3]))
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    args = ap.parse_args()
    before = os.getloadavg()[0]
    res, why = run_ranks(__file__, [str(args.steps), str(args.warmup)], WORLD, timeout=1200)
    if res is None:
        sys.exit(f"tp_invariant_bench: {why}")
    _write({mode: [max(step) for step in zip(*(r[mode] for r in res), strict=True)] for mode in MODES},
           [before, os.getloadavg()[0]], args)


def _write(per_step: dict[str, list[float]], load: list[float], args: argparse.Namespace) -> None:
    """The JSON (every step) and the markdown table under results/."""
    ratios = [on / off for off, on in zip(per_step["off"], per_step["on"], strict=True)]
    q = statistics.quantiles(ratios, n=4)
    rows = [{"mode": mode, "step_ms": statistics.median(times), "step_ms_all": times}
            for mode, times in per_step.items()]
    meta = {"world": WORLD, "tp": TP, "vocab": VOCAB, "hidden": HIDDEN, "inner": INNER, "layers": LAYERS,
            "batch": BATCH, "seq": SEQ, "chunks": 4, "steps": args.steps, "warmup": args.warmup,
            "loadavg_1m": load, "cpus": os.cpu_count(), "on_over_off": {"q1": q[0], "median": q[1], "q3": q[2]}}
    table = ["| layout_invariant | step ms (median, slower rank) |", "| --- | ---: |",
             *(f"| {r['mode']} | {r['step_ms']:.0f} |" for r in rows),
             f"\non / off per step: median {q[1]:.2f} [{q[0]:.2f}-{q[2]:.2f}]; load average (1 min) "
             f"before/after: {load[0]:.1f} / {load[-1]:.1f} on {os.cpu_count()} CPUs"]
    (HERE / "results" / "tp_invariant_bench.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    (HERE / "results" / "tp_invariant_bench.md").write_text("\n".join(table) + "\n")
    print("\n".join(table))


if __name__ == "__main__":
    main()
