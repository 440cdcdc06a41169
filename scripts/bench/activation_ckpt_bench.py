"""Activation checkpointing: activation memory and step time for none / full / selective / cpu.

A 12-layer GPT-like model (pre-norm blocks: attention through ``scaled_dot_product_attention``, a
4x MLP with GeLU, dropout 0.1 on both residual branches, an LM head tied to the embedding) trains
in one dslaunch engine (one rank, ZeRO 0, fp32 AdamW). Each block is wrapped as a Megatron-style
script does: ``deepspeed.checkpointing.checkpoint(block, x)``, with ``configure`` setting the mode:

- none: no checkpointing (the baseline);
- full: DeepSpeed's checkpoint (each block's input kept, the block recomputed in backward);
- selective: ``mode: "selective"`` (matmul and attention outputs kept, the rest recomputed);
- cpu: full with ``cpu_checkpointing`` (the kept inputs copied to host memory: on this CPU-only
  machine a copy to the same memory, so it shows the copy's cost, not a device saving);
- full (non-reentrant): ``non_reentrant_checkpoint``.

Memory: ``LiveBytes`` (``runtime/activation_checkpointing/memory.py``), a torch dispatch mode that
sees every op's output and counts the bytes of each new tensor storage from its creation until it
is freed, over one forward + backward after warm-up steps. "held after forward" = bytes alive when the loss is computed (what
the forward keeps for backward, plus the loss); "peak" = the most alive at once during forward +
backward (kept activations, one block's recompute, gradients being produced). Parameters, their
gradient buffers and optimizer state exist before and are not counted.

Time: the modes run in interleaved rounds (each round: every mode for ``--steps`` optimizer steps)
so a shared machine's load drifts over all of them alike; each mode's ratio is the median over
rounds of (its mean step time / none's in the same round), in wall time and in the process's CPU
time (one thread: the work itself; the targets are judged on it, since on a machine loaded far
beyond its cores wall time mostly measures the scheduler).

Targets (issue 24): full >= 60% less activation memory (peak) for <= 35% more step time;
selective <= 10% more step time.

Writes ``results/activation_ckpt_bench.json`` and ``.md``. Usage:
``python scripts/bench/activation_ckpt_bench.py [--rounds 4] [--steps 2] [--out DIR]``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import dslaunch
from dslaunch import checkpointing
from dslaunch.runtime.activation_checkpointing.memory import measure_step

HERE = Path(__file__).resolve().parent
LAYERS, D, HEADS, SEQ, BATCH, VOCAB, DROPOUT = 12, 256, 4, 128, 4, 512, 0.1
MODES: dict[str, dict[str, Any]] = {
    "none": {}, "full": {"mode": "full"}, "selective": {"mode": "selective"},
    "cpu": {"mode": "full", "checkpoint_in_cpu": True}, "full (non-reentrant)": {"mode": "full"},
}


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.qkv, self.proj = nn.Linear(D, 3 * D), nn.Linear(D, D)
        self.fc, self.out = nn.Linear(D, 4 * D), nn.Linear(4 * D, D)
        self.drop = nn.Dropout(DROPOUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (z.view(b, t, HEADS, D // HEADS).transpose(1, 2) for z in self.qkv(self.ln1(x)).split(D, -1))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, D)
        x = x + self.drop(self.proj(att))
        return x + self.drop(self.out(F.gelu(self.fc(self.ln2(x)))))


class GPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb, self.pos = nn.Embedding(VOCAB, D), nn.Parameter(torch.zeros(SEQ, D))
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.ln, self.head = nn.LayerNorm(D), nn.Linear(D, VOCAB, bias=False)
        self.head.weight = self.emb.weight
        self.wrap: Any = None

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.emb(tokens) + self.pos
        for block in self.blocks:
            x = self.wrap(block, x) if self.wrap is not None else block(x)
        logits = self.head(self.ln(x))
        return F.cross_entropy(logits.flatten(0, 1), tokens.roll(-1, 1).flatten())


class _Passthrough(TorchDispatchMode):
    """Does nothing but see every op: what the selective mode's interception costs by itself."""

    ops = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        _Passthrough.ops += 1
        return func(*args, **(kwargs or {}))


def _dispatch_cost(model: GPT, tokens: torch.Tensor, rounds: int) -> dict[str, float]:
    """CPU time of a no-grad forward with and without a pass-through dispatch mode (best of rounds)."""
    model.wrap = None
    plain, under = [], []
    with torch.no_grad():
        for _ in range(rounds):
            t = time.process_time()
            model(tokens)
            plain.append(time.process_time() - t)
            _Passthrough.ops = 0
            with _Passthrough():
                t = time.process_time()
                model(tokens)
                under.append(time.process_time() - t)
    extra = min(under) - min(plain)
    return {"ops": _Passthrough.ops, "forward_s": min(plain), "extra_s": extra,
            "us_per_op": 1e6 * extra / _Passthrough.ops}


def _select(model: GPT, name: str) -> None:
    if name == "none":
        model.wrap = None
        return
    checkpointing.configure(None, **MODES[name])
    model.wrap = checkpointing.non_reentrant_checkpoint if "non-reentrant" in name else checkpointing.checkpoint


def _step(engine: Any, tokens: torch.Tensor) -> None:
    engine.backward(engine(tokens))
    engine.step()


def _memory(engine: Any, model: GPT, tokens: torch.Tensor) -> dict[str, int]:
    m = measure_step(engine, tokens)
    return {"held_after_forward": m.held_after_forward, "peak": m.peak}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--out", type=Path, default=HERE / "results")
    args = ap.parse_args()
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29731"), RANK="0",
                      WORLD_SIZE="1", LOCAL_RANK="0")
    torch.manual_seed(0)
    model = GPT()
    args.params = sum(p.numel() for p in model.parameters())
    cfg = {"train_micro_batch_size_per_gpu": BATCH, "steps_per_print": 10**9,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}}
    engine, *_ = dslaunch.initialize(model=model, config=cfg)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    for name in MODES:  # warm-up: every path once (allocations, the optimizer state)
        _select(model, name)
        _step(engine, tokens)
    memory = {}
    for name in MODES:
        _select(model, name)
        memory[name] = _memory(engine, model, tokens)
    wall: dict[str, list[float]] = {name: [] for name in MODES}
    cpu: dict[str, list[float]] = {name: [] for name in MODES}
    for _ in range(args.rounds):
        for name in MODES:
            _select(model, name)
            start, start_cpu = time.perf_counter(), time.process_time()
            for _ in range(args.steps):
                _step(engine, tokens)
            wall[name].append((time.perf_counter() - start) / args.steps)
            cpu[name].append((time.process_time() - start_cpu) / args.steps)
    args.dispatch = _dispatch_cost(model, tokens, args.rounds)
    load = os.getloadavg()[0]
    _write(args.out, memory, wall, cpu, load, args)


def _ratio(times: dict[str, list[float]], name: str) -> float:
    return statistics.median(t / b for t, b in zip(times[name], times["none"], strict=True))


def _write(out: Path, memory: dict, wall: dict, cpu: dict, load: float, args: Any) -> None:
    base_mem = memory["none"]["peak"]
    rows = {n: {"held_after_forward_bytes": memory[n]["held_after_forward"], "peak_bytes": memory[n]["peak"],
                "peak_saving": 1 - memory[n]["peak"] / base_mem, "step_s_median": statistics.median(wall[n]),
                "step_s": wall[n], "time_ratio": _ratio(wall, n), "cpu_s": cpu[n],
                "cpu_ratio": _ratio(cpu, n)} for n in MODES}
    full, sel = rows["full"], rows["selective"]
    # CPU time decides: at this machine's load wall time mostly measures the scheduler
    verdict = {"full_memory": full["peak_saving"] >= 0.60, "full_time": full["cpu_ratio"] <= 1.35,
               "selective_time": sel["cpu_ratio"] <= 1.10}
    out.mkdir(parents=True, exist_ok=True)
    (out / "activation_ckpt_bench.json").write_text(json.dumps({
        "model": {"layers": LAYERS, "d_model": D, "heads": HEADS, "seq": SEQ, "batch": BATCH, "vocab": VOCAB,
                  "dropout": DROPOUT, "params": args.params}, "rounds": args.rounds, "steps": args.steps,
        "load_avg_1m_end": load, "modes": rows, "dispatch_mode_cost": args.dispatch, "targets_met": verdict}, indent=1))
    mib = 2**20
    lines = ["## Activation checkpointing (`scripts/bench/activation_ckpt_bench.py`)\n",
             f"12-layer GPT-like model ({args.params / 1e6:.1f}M parameters, d={D}, {HEADS} heads, seq {SEQ}, batch {BATCH}, vocab {VOCAB}, dropout "
             f"{DROPOUT}, tied head), one dslaunch engine on one CPU thread, fp32 AdamW; every block through "
             "`deepspeed.checkpointing`. Memory: bytes of the tensors created during one forward + backward, "
             "alive at once (a dispatch mode counting each storage from creation to free); parameters, "
             "gradient buffers and optimizer state are not counted. Time: median over "
             f"{args.rounds} interleaved rounds of {args.steps} steps of (mode / none in the same round), as "
             "wall time and as the process's CPU time (one thread: the work done, which the machine's load "
             f"does not stretch). Load average at the end: {load:.1f} on 2 shared cores.\n",
             "| mode | held after forward (MiB) | peak (MiB) | peak vs none | step wall (s) | wall vs none "
             "| CPU vs none |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for n, r in rows.items():
        lines.append(f"| {n} | {r['held_after_forward_bytes'] / mib:.1f} | {r['peak_bytes'] / mib:.1f} | "
                     f"{-r['peak_saving']:+.0%} | {r['step_s_median']:.3f} | {r['time_ratio']:.2f}x | "
                     f"{r['cpu_ratio']:.2f}x |")
    d = args.dispatch
    lines.append(f"\nThe selective mode's dispatch mode by itself (a pass-through mode over a no-grad forward, "
                 f"best of {args.rounds}): {d['ops']} ops, +{d['extra_s'] * 1e3:.1f} ms CPU on a "
                 f"{d['forward_s'] * 1e3:.1f} ms forward ({d['extra_s'] / d['forward_s']:+.0%}), "
                 f"{d['us_per_op']:.0f} us per op; selective pays it in the forward and in the recompute.")
    met = {k: "met" if v else "NOT met" for k, v in verdict.items()}
    lines.append(f"\nTargets (step time by CPU time): full >= 60% less peak activation memory "
                 f"({met['full_memory']}), full <= 1.35x step time ({met['full_time']}), selective <= 1.10x "
                 f"step time ({met['selective_time']}).")
    (out / "activation_ckpt_bench.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
