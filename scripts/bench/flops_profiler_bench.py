"""Flops profiler overhead: a profiled training step against an unprofiled one, dslaunch's and
DeepSpeed's, in one run.

One process (gloo, world 1, one thread) per system, a GPT-like model (``tests/profiling/
flops_profiler/gpt.py``, SDPA attention), three sizes, from a model whose matmuls dominate to a
small one where the per-operator cost shows. Steps come in pairs, an unprofiled step and a
profiled one (the order within a pair alternates: pairing cancels the drift of a shared
machine's load):

- dslaunch (``dslaunch.initialize``, ZeRO-0, AdamW): a fresh ``FlopsProfilerObserver`` on
  ``engine.events`` for that step only, what the ``flops_profiler`` block does at ``profile_step``:
  torch's profiler records every aten operator of forward and backward with its shapes, module
  hooks mark the modules, the phases are timed; after the step the record is counted (formulas,
  module attribution) and the tables printed (to /dev/null).
- DeepSpeed 0.19.8 (``deepspeed.initialize``, ZeRO-0, torch's AdamW; run in its venv, ``--ds-venv``,
  with ``DS_ACCELERATOR=cpu``): its engine's own ``flops_profiler`` block, ``profile_step`` moved
  to the next step: its ``FlopsProfiler`` patches ``torch.nn.functional`` and tensor methods and
  counts the forward only (the backward is assumed 2x); after the step its tables are printed
  (to /dev/null). With the block on, its engine times every step (both sides of a pair).

Reported per system: the median step times, the in-step overhead (the median over pairs of
(profiled - post-step work) / unprofiled - 1), the post-step work (counting and tables after the
step's last operator: paid once, by the profiled step only) and the whole profiled step's
overhead. Writes ``results/flops_profiler_bench.json`` and ``.md`` (or to ``--out``).
Target (issue 24): a profiled step costs at most 10% more than an unprofiled one.

Usage: ``/tmp/dsl/bench-quiet .venv/bin/python scripts/bench/flops_profiler_bench.py [--pairs 8]
[--out DIR] [--ds-venv DIR]``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
sys.path.insert(0, str(ROOT))  # the tests' GPT (and dslaunch)

from tests.profiling.flops_profiler.gpt import GPT  # noqa: E402

# name -> (vocab, d, layers, heads, seq, batch)
SIZES = {"GPT d=512 L=4 T=256 B=4": (2048, 512, 4, 8, 256, 4),
         "GPT d=256 L=4 T=128 B=4": (1024, 256, 4, 8, 128, 4),
         "GPT d=64 L=2 T=32 B=2": (128, 64, 2, 4, 32, 2)}
ENV = {"MASTER_ADDR": "127.0.0.1", "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}


def _step(engine: Any, tokens: torch.Tensor) -> float:
    t0 = time.perf_counter()
    engine.backward(engine(tokens, tokens))
    engine.step()
    return time.perf_counter() - t0


class _Timed:
    """Wraps a callable, adding the seconds its calls take to ``seconds``."""

    def __init__(self, fn: Callable[..., Any]):
        self.fn, self.seconds = fn, 0.0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return self.fn(*args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - t0


def _pairs(off: Callable[[], float], on: Callable[[], tuple[float, float, int]], pairs: int) -> dict:
    """``off()`` -> seconds of an unprofiled step; ``on()`` -> (seconds, of which post-step work,
    flops counted) of a profiled one."""
    for _ in range(2):
        off()  # warm-up
    offs, ons, posts, flops = [], [], [], 0
    for i in range(pairs):
        if i % 2 == 0:  # the order alternates within pairs: neither side is always second
            offs.append(off())
        seconds, post, flops = on()
        ons.append(seconds)
        posts.append(post)
        if i % 2 == 1:
            offs.append(off())
    in_step = [(t - p) / o - 1 for t, p, o in zip(ons, posts, offs, strict=True)]
    whole = [t / o - 1 for t, o in zip(ons, offs, strict=True)]
    return {"flops": flops, "ms_off": 1e3 * statistics.median(offs), "ms_on": 1e3 * statistics.median(ons),
            "ms_post": 1e3 * statistics.median(posts), "overhead": statistics.median(in_step),
            "overhead_whole": statistics.median(whole), "in_step": in_step, "whole": whole}


def _ours(shape: tuple[int, ...], pairs: int) -> dict:
    import dslaunch
    from dslaunch.runtime.config.flops_profiler import FlopsProfilerConfig
    from dslaunch.runtime.profiling.observer import FlopsProfilerObserver

    vocab, d, layers, heads, seq, batch = shape
    cfg = {"train_micro_batch_size_per_gpu": batch, "steps_per_print": 10**6,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}}
    engine, *_ = dslaunch.initialize(model=GPT(vocab, d, layers, heads, seq, impl="sdpa"), config=cfg)
    tokens = torch.randint(0, vocab, (batch, seq))
    block = FlopsProfilerConfig(enabled=True, output_file=os.devnull)

    def on() -> tuple[float, float, int]:
        obs = FlopsProfilerObserver(engine, dataclasses.replace(block, profile_step=engine.global_steps))
        obs.on_step = post = _Timed(obs.on_step)  # the counting and the tables, after the step
        engine.events.add(obs)
        seconds = _step(engine, tokens)
        engine.events.remove(obs)
        return seconds, post.seconds, obs.profiler.last.fwd_flops + obs.profiler.last.bwd_flops

    r = _pairs(lambda: _step(engine, tokens), on, pairs)
    return {"params": sum(p.numel() for p in engine.module.parameters()), **r}


def _deepspeed(shape: tuple[int, ...], pairs: int) -> dict:
    import deepspeed

    vocab, d, layers, heads, seq, batch = shape
    model = GPT(vocab, d, layers, heads, seq, impl="sdpa")
    cfg = {"train_micro_batch_size_per_gpu": batch, "steps_per_print": 10**6,
           "flops_profiler": {"enabled": True, "profile_step": -1, "output_file": os.devnull}}
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-4),
                                      config=cfg)
    tokens = torch.randint(0, vocab, (batch, seq))
    prof = engine.flops_profiler
    counted = [0]
    prof.print_model_profile = printing = _Timed(prof.print_model_profile)
    prof.end_profile = ending = _Timed(prof.end_profile)
    prof.stop_profile = _Timed(_then(prof.stop_profile, lambda: counted.__setitem__(0, prof.get_total_flops())))

    def on() -> tuple[float, float, int]:
        engine._config.flops_profiler_config.profile_step = engine.global_steps  # this step, the block's way
        printing.seconds = ending.seconds = 0.0
        seconds = _step(engine, tokens)
        return seconds, printing.seconds + ending.seconds, counted[0]

    return _pairs(lambda: _step(engine, tokens), on, pairs)


def _then(fn: Callable[[], Any], after: Callable[[], Any]) -> Callable[[], Any]:
    def run() -> Any:
        out = fn()
        after()
        return out
    return run


def _peer(ds_venv: str, pairs: int) -> dict:
    """DeepSpeed's side, in its venv: this script with ``--peer``; its last stdout line is JSON."""
    from dslaunch.utils.ports import free_port  # here: the peer's venv has no dslaunch

    env = {**os.environ, **ENV, "MASTER_PORT": str(free_port()), "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([str(Path(ds_venv) / "bin" / "python"), __file__, "--peer", "--pairs", str(pairs)],
                          env=env, capture_output=True, text=True, timeout=540)
    if done.returncode != 0:
        return {"error": done.stderr.strip().splitlines()[-1] if done.stderr.strip() else f"rc {done.returncode}"}
    return json.loads(done.stdout.strip().splitlines()[-1])


def _peer_main(pairs: int) -> None:
    import logging

    import deepspeed
    from deepspeed.utils import logger

    logger.setLevel(logging.WARNING)  # its step timers log every step while the block is on
    deepspeed.init_distributed(dist_backend="gloo")
    results = {name: _deepspeed(shape, pairs) for name, shape in SIZES.items()}
    print(json.dumps({"results": results, "version": deepspeed.__version__}))


def _pct(x: float) -> str:
    return f"{100 * x:+.1f}%"


def _table(results: dict, peer: dict, load: tuple[float, float], when: str, pairs: int) -> str:
    version = peer.get("version", "?")
    rows = ["## Flops profiler overhead (`scripts/bench/flops_profiler_bench.py`)", "",
            f"One process per system (one thread), a GPT-like model (SDPA), alternating an unprofiled step and a "
            f"step profiled by the engine's `flops_profiler` block: dslaunch (ZeRO-0, AdamW) records every aten "
            f"operator of forward and backward with torch's profiler and counts after the step; DeepSpeed "
            f"{version} (ZeRO-0, torch AdamW) patches torch's functionals and counts the forward only. in step = "
            f"median over adjacent pairs (order alternating) of (profiled - post-step work) / unprofiled - 1; "
            f"post-step = the counting and tables after the step's last operator (paid once, by the profiled "
            f"step only); whole = the profiled step with it. in-step cost = the milliseconds each adds in the "
            f"step, ours / DeepSpeed's (a ratio where both are above zero). Run {when}, {pairs} pairs.", "",
            "| model | params | flops counted (ours fwd+bwd / DS fwd) | ms unprofiled (ours / DS) "
            "| ours in step (min..max) | ours post-step ms (whole) | DS in step (min..max) "
            "| DS post-step ms (whole) | in-step cost ours / DS |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for name, r in results.items():
        p = peer.get("results", {}).get(name)
        ours = f"{_pct(r['overhead'])} ({_pct(min(r['in_step']))}..{_pct(max(r['in_step']))})"
        ours_post = f"{r['ms_post']:.1f} ({_pct(r['overhead_whole'])})"
        if p is None:
            ds = ds_post = ratio = "n/a"
            flops, ms_off = f"{r['flops'] / 1e9:.2f} G / n/a", f"{r['ms_off']:.1f} / n/a"
        else:
            ds = f"{_pct(p['overhead'])} ({_pct(min(p['in_step']))}..{_pct(max(p['in_step']))})"
            ds_post = f"{p['ms_post']:.1f} ({_pct(p['overhead_whole'])})"
            ours_ms, ds_ms = r["overhead"] * r["ms_off"], p["overhead"] * p["ms_off"]
            ratio = f"{ours_ms:.1f} / {ds_ms:.1f} ms" + (f" = {ours_ms / ds_ms:.2f}" if ours_ms > 0 and ds_ms > 0 else "")
            flops, ms_off = f"{r['flops'] / 1e9:.2f} G / {p['flops'] / 1e9:.2f} G", f"{r['ms_off']:.1f} / {p['ms_off']:.1f}"
        rows.append(f"| {name} | {r['params'] / 1e6:.2f} M | {flops} | {ms_off} | {ours} | {ours_post} | {ds} | "
                    f"{ds_post} | {ratio} |")
    if "error" in peer:
        rows += ["", f"DeepSpeed's side failed: {peer['error']}"]
    rows += ["", f"Load average (1 min) {load[0]:.1f} at the start, {load[1]:.1f} at the end (2 cores, shared). "
             "Target (issue 24): a profiled step costs at most 10% more than an unprofiled one."]
    return "\n".join(rows) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pairs", type=int, default=8)
    ap.add_argument("--out", type=Path, default=HERE / "results")
    ap.add_argument("--ds-venv", default="/tmp/venv-ds-inf")
    ap.add_argument("--peer", action="store_true", help=argparse.SUPPRESS)  # DeepSpeed's side, in its venv
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.peer:
        _peer_main(args.pairs)
        return
    from dslaunch.utils.ports import free_port

    os.environ.update(ENV, MASTER_PORT=os.environ.get("MASTER_PORT") or str(free_port()))
    load0 = os.getloadavg()[0]
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    results = {name: _ours(shape, args.pairs) for name, shape in SIZES.items()}
    peer = _peer(args.ds_venv, args.pairs)
    load = (load0, os.getloadavg()[0])
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "flops_profiler_bench.json").write_text(json.dumps(
        {"results": results, "deepspeed": peer, "load": load, "when": when, "pairs": args.pairs}, indent=1))
    (args.out / "flops_profiler_bench.md").write_text(_table(results, peer, load, when, args.pairs))
    print(_table(results, peer, load, when, args.pairs))


if __name__ == "__main__":
    main()
