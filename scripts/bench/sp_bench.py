"""Ulysses sequence parallelism: per-rank peak activation memory and step time at sp 1, 2 and 4, at
the longest sequence one process fits within an activation budget.

The model is ``alst_bench``'s tiny-but-wide causal LM (2 blocks, hidden 128, 4 heads, SwiGLU MLP
2048, vocabulary 16384; fp32, batch 1, untiled), with Ulysses around its attention at sp > 1 (the
all-to-alls of ``sequence_parallel.layout``: each rank holds ``1/sp`` of the positions, and the
whole sequence for ``1/sp`` of the heads inside attention) and the shard losses averaged over the
whole sequence (``sequence_parallel_loss``).

1. The longest length (a multiple of 64) whose forward + backward peaks within ``--budget-mib`` in
   one process (``alst_bench.longest``: ``LiveBytes``, tensors created during the step, parameters
   and gradient buffers not counted, so the numbers do not depend on the load).
2. At that length, for each sp: ``sp`` ranks (gloo, one thread each) split every sequence; each
   measures the peak of one forward + backward the same way, then times ``--steps`` steps
   (forward, backward, gradient average over the group, SGD) after one warm-up. The same total
   tokens per step at every sp. On this 2-core machine sp 4 runs 4 ranks on 2 cores: its step time
   is that of a machine with half a core per rank.

Targets (issue 38): per-rank peak at sp 4 <= 0.30x that of sp 1; step time reported against sp 1.
The budget (512 MiB) is set where activations dominate: the step also creates gradients the size of
the embedding and the head (8 MiB each here) whatever the length, which a short sequence's peak
would be mostly made of.

Writes ``results/sp_bench.json`` and ``.md``. Usage:
``python scripts/bench/sp_bench.py [--budget-mib 512] [--sp 2 4] [--steps 5] [--out DIR]``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import alst_bench  # noqa: E402  (the model and the length search: one directory up the path)
from ranks import report, run_ranks  # noqa: E402


def ulysses(group: Any) -> Any:
    """``alst_bench.causal_attention`` with the heads split over ``group`` and the sequence whole."""
    from dslaunch.runtime.sequence_parallel.layout import seq_all_to_all

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        q, k, v = (seq_all_to_all(t, group, 1, 2) for t in (q, k, v))  # [b, h, s/P, d] -> [b, h/P, s, d]
        return seq_all_to_all(alst_bench.causal_attention(q, k, v), group, 2, 1)

    return attend


def worker(seq: int, steps: int) -> None:
    """One rank of ``WORLD_SIZE`` that split each ``seq``-token sequence; reports its peak and times."""
    import torch.distributed as dist

    from dslaunch.runtime.activation_checkpointing.memory import LiveBytes
    from dslaunch.runtime.sequence_parallel.batch import shard_batch
    from dslaunch.runtime.sequence_parallel.loss import sequence_parallel_loss

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, sp = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = alst_bench.LM(False, ulysses(dist.group.WORLD)) if sp > 1 else alst_bench.LM(False)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    ids = torch.randint(0, alst_bench.VOCAB, (1, seq), generator=torch.Generator().manual_seed(seq))
    shard = shard_batch({"input_ids": ids, "labels": ids}, rank, sp)

    def loss() -> torch.Tensor:
        x, y = shard["input_ids"], shard["shift_labels"]
        own = model(x, y.clamp(min=0))  # the last position's label is ignored: any token, the same at every sp
        return own if sp == 1 else sequence_parallel_loss(own, y.numel(), dist.group.WORLD)

    def step() -> None:
        opt.zero_grad(set_to_none=False)
        loss().backward()
        if sp > 1:
            for p in model.parameters():
                dist.all_reduce(p.grad, op=dist.ReduceOp.AVG)
        opt.step()

    step()  # gradient buffers made, first-call costs paid
    opt.zero_grad(set_to_none=False)
    with LiveBytes() as tracker:
        loss().backward()
    times = []
    for _ in range(steps):
        dist.barrier()
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    report({"rank": rank, "peak": tracker.peak, "times": times})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget-mib", type=int, default=512)
    parser.add_argument("--sp", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--out", type=Path, default=HERE / "results")
    parser.add_argument("--worker", nargs=2, type=int, metavar=("SEQ", "STEPS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(*args.worker)
        return
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = alst_bench.LM(False)
    alst_bench.step_peak(model, 64)  # gradient buffers made
    seq, _ = alst_bench.longest(model, args.budget_mib * 2**20)
    rows = {}
    for sp in (1, *args.sp):
        got, why = run_ranks(__file__, [str(seq), str(args.steps)], sp, timeout=900)
        if got is None:
            raise SystemExit(f"sp_bench: sp {sp} failed: {why}")
        slowest = [max(step) for step in zip(*(r["times"] for r in got), strict=True)]
        rows[sp] = {"peaks": [r["peak"] for r in got], "peak": max(r["peak"] for r in got),
                    "step_s": statistics.median(slowest), "steps_s": slowest}
    _write(args.out, seq, args.budget_mib, rows, os.getloadavg()[0])


def _write(out: Path, seq: int, budget_mib: int, rows: dict, load: float) -> None:
    out.mkdir(parents=True, exist_ok=True)
    base = rows[1]
    for row in rows.values():
        row["peak_vs_sp1"], row["step_vs_sp1"] = row["peak"] / base["peak"], row["step_s"] / base["step_s"]
    top = max(rows)
    met = rows[top]["peak_vs_sp1"] <= 0.30 if top == 4 else None
    (out / "sp_bench.json").write_text(json.dumps({
        "model": {"layers": alst_bench.LAYERS, "hidden": alst_bench.HIDDEN, "heads": alst_bench.HEADS,
                  "mlp": alst_bench.MLP, "vocab": alst_bench.VOCAB}, "budget_mib": budget_mib, "seq": seq,
        "sp": {str(k): v for k, v in rows.items()}, "target_sp4_peak_le_0.30x_met": met,
        "load_avg_1m_end": load}, indent=1))
    mib = 2**20
    lines = ["## Ulysses sequence parallelism: memory and step time (`scripts/bench/sp_bench.py`)\n",
             f"`alst_bench`'s model (untiled), fp32, batch 1, at {seq} tokens: the longest sequence one process "
             f"trains within a {budget_mib} MiB activation budget. Per rank: the peak of one forward + backward "
             "(tensors created during the step, parameters and gradient buffers not counted); the median of "
             "the slowest rank's step (forward, backward, gradient average, SGD) over the timed steps. The same "
             f"{seq} tokens a step at every sp; gloo, one thread a rank, 2 shared cores (sp 4: 4 ranks on 2 "
             f"cores). Load average at the end: {load:.1f}.\n",
             "| sp | peak per rank (MiB) | vs sp 1 | step (s) | vs sp 1 | tokens/s |",
             "| ---: | ---: | ---: | ---: | ---: | ---: |"]
    lines += [f"| {sp} | {r['peak'] / mib:.1f} | {r['peak_vs_sp1']:.2f}x | {r['step_s']:.3f} | {r['step_vs_sp1']:.2f}x "
              f"| {seq / r['step_s']:.0f} |" for sp, r in rows.items()]
    if met is not None:
        lines.append(f"\nsp 4 peak / sp 1 peak: {rows[4]['peak_vs_sp1']:.2f}x (target <= 0.30x: "
                     f"{'met' if met else 'NOT met'}).")
    (out / "sp_bench.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
