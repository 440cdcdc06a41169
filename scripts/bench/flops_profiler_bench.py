"""Flops profiler overhead: a profiled training step against an unprofiled one, on the engine.

One process (gloo, world 1, one thread), a GPT-like model trained by ``dslaunch.initialize``
(ZeRO-0, AdamW). Steps come in pairs: an unprofiled step and a step with a fresh
``FlopsProfilerObserver`` attached to ``engine.events`` for that step only (what the
``flops_profiler`` block does at ``profile_step``: counting every operator of forward and
backward, module hooks, the step's timing, and the tables printed, here to /dev/null). Reported:
the median step time of each and the overhead, the median over adjacent pairs of their ratio
(pairing cancels the drift of a shared machine's load; the order within a pair alternates).
Three sizes, from a model whose matmuls dominate to a small one where Python's per-operator cost
shows.

Writes ``results/flops_profiler_bench.json`` and ``results/flops_profiler_bench.md`` (or to ``--out``).
Target (issue 24): a profiled step costs at most 10% more than an unprofiled one.

Usage: ``python scripts/bench/flops_profiler_bench.py [--pairs 6] [--out DIR]``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent.parent))  # the tests' GPT

from dslaunch.profiling.flops_profiler.observer import FlopsProfilerObserver  # noqa: E402
from dslaunch.runtime.config.flops_profiler import FlopsProfilerConfig  # noqa: E402
from tests.profiling.flops_profiler.gpt import GPT  # noqa: E402

# name -> (vocab, d, layers, heads, seq, batch)
SIZES = {"GPT d=512 L=4 T=256 B=4": (2048, 512, 4, 8, 256, 4),
         "GPT d=256 L=4 T=128 B=4": (1024, 256, 4, 8, 128, 4),
         "GPT d=64 L=2 T=32 B=2": (128, 64, 2, 4, 32, 2)}


def _engine(vocab: int, d: int, layers: int, heads: int, seq: int, batch: int) -> object:
    import dslaunch

    cfg = {"train_micro_batch_size_per_gpu": batch, "steps_per_print": 10**6,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}}
    engine, *_ = dslaunch.initialize(model=GPT(vocab, d, layers, heads, seq, impl="sdpa"), config=cfg)
    return engine


def _step(engine: object, tokens: torch.Tensor) -> float:
    t0 = time.perf_counter()
    engine.backward(engine(tokens, tokens))
    engine.step()
    return time.perf_counter() - t0


def _measure(shape: tuple[int, ...], pairs: int) -> dict:
    vocab, _, _, _, seq, batch = shape
    engine = _engine(*shape)
    tokens = torch.randint(0, vocab, (batch, seq))
    cfg = FlopsProfilerConfig(enabled=True, output_file=os.devnull)
    for _ in range(2):
        _step(engine, tokens)  # warm-up
    off, on, ratios, flops = [], [], [], 0
    for i in range(pairs):
        if i % 2 == 0:  # the order alternates within pairs: neither side is always second
            off.append(_step(engine, tokens))
        obs = FlopsProfilerObserver(engine, dataclasses.replace(cfg, profile_step=engine.global_steps))
        engine.events.add(obs)
        on.append(_step(engine, tokens))
        engine.events.remove(obs)
        if i % 2 == 1:
            off.append(_step(engine, tokens))
        ratios.append(on[-1] / off[-1])
        flops = obs.profiler.last.fwd_flops + obs.profiler.last.bwd_flops
    return {"params": sum(p.numel() for p in engine.module.parameters()), "flops_per_step": flops,
            "ms_off": 1e3 * statistics.median(off), "ms_on": 1e3 * statistics.median(on),
            "overhead": statistics.median(ratios) - 1, "ratios": ratios}


def _table(results: dict, load: tuple[float, float]) -> str:
    rows = ["## Flops profiler overhead (`scripts/bench/flops_profiler_bench.py`)", "",
            "One process on the engine (ZeRO-0, AdamW, one thread), alternating an unprofiled step and a step "
            "profiled by the `flops_profiler` observer (every aten operator of forward and backward counted, "
            "module hooks, phase timing, the tables printed to /dev/null). overhead = median over adjacent "
            "pairs (order alternating) of profiled/unprofiled - 1.", "",
            "| model | params | flops per step | ms unprofiled | ms profiled | overhead (min..max) |",
            "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for name, r in results.items():
        lo, hi = min(r["ratios"]) - 1, max(r["ratios"]) - 1
        rows.append(f"| {name} | {r['params'] / 1e6:.2f} M | {r['flops_per_step'] / 1e9:.2f} G | {r['ms_off']:.1f} | "
                    f"{r['ms_on']:.1f} | {100 * r['overhead']:+.1f}% ({100 * lo:+.1f}..{100 * hi:+.1f}) |")
    rows += ["", f"Load average during the run: {load[0]:.1f} at the start, {load[1]:.1f} at the end (2 cores, "
             "shared). Target (issue 24): a profiled step costs at most 10% more than an unprofiled one."]
    return "\n".join(rows) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pairs", type=int, default=6)
    ap.add_argument("--out", type=Path, default=HERE / "results")
    args = ap.parse_args()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29631"), RANK="0",
                      WORLD_SIZE="1", LOCAL_RANK="0")
    torch.set_num_threads(1)
    load0 = os.getloadavg()[0]
    results = {name: _measure(shape, args.pairs) for name, shape in SIZES.items()}
    load = (load0, os.getloadavg()[0])
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "flops_profiler_bench.json").write_text(json.dumps({"results": results, "load": load}, indent=1))
    (args.out / "flops_profiler_bench.md").write_text(_table(results, load))
    print(_table(results, load))


if __name__ == "__main__":
    main()
