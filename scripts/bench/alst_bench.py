"""ALST's tiling on one process: the longest sequence that trains within an activation budget,
with ``TiledMLP`` + ``TiledFusedLogitsLoss`` against the same model without them.

A tiny-but-wide causal LM (2 pre-norm blocks, hidden 128, 4 heads, a SwiGLU MLP of 2048, a vocabulary
of 16384: the MLP and the logits dominate activation memory, as in Llama-class models at long
sequence), fp32, one forward + backward. Memory: ``LiveBytes`` (a torch dispatch mode counting each
tensor storage created during the step from creation to free; parameters and their gradients exist
before and are not counted), so the numbers do not depend on the machine's load. Per mode, the
length doubles from 256 while the peak stays within the budget, then bisects to 64 tokens.
Time: the process's CPU time of one step at the untiled mode's longest length, both modes (the
tiling recomputes each MLP slice and each logits slice in backward).

Target (issue 38): the tiled model trains >= 4x the untiled model's longest sequence.

Writes ``results/alst_bench.json`` and ``.md``. Usage:
``python scripts/bench/alst_bench.py [--budget-mib 128] [--out DIR]``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from dslaunch.runtime.activation_checkpointing.memory import LiveBytes
from dslaunch.runtime.sequence_parallel.ulysses_sp import TiledFusedLogitsLoss, TiledMLP

HERE = Path(__file__).resolve().parent
LAYERS, HIDDEN, HEADS, MLP, VOCAB = 2, 128, 4, 2048, 16384
LOGIT_ROWS = 256  # rows of logits alive at once when tiled


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Attention over ``[batch, heads, sequence, head_dim]`` (``sp_bench`` puts Ulysses around it)."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


class Block(nn.Module):
    def __init__(self, tiled: bool, attend: Callable[..., torch.Tensor] = causal_attention) -> None:
        super().__init__()
        self.tiled, self.attend = tiled, attend
        self.n1, self.n2 = nn.RMSNorm(HIDDEN), nn.RMSNorm(HIDDEN)
        self.qkv, self.o = nn.Linear(HIDDEN, 3 * HIDDEN, bias=False), nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.gate, self.up = nn.Linear(HIDDEN, MLP, bias=False), nn.Linear(HIDDEN, MLP, bias=False)
        self.down = nn.Linear(MLP, HIDDEN, bias=False)

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = self.qkv(self.n1(x)).view(b, s, 3, HEADS, HIDDEN // HEADS).permute(2, 0, 3, 1, 4)
        a = self.attend(q, k, v).transpose(1, 2).reshape(b, s, HIDDEN)
        x = x + self.o(a)
        h = self.n2(x)
        if not self.tiled:
            return x + self.mlp(h)
        shards = math.ceil(s / HIDDEN)  # DeepSpeed's tutorial: slices of about hidden-size tokens
        return x + TiledMLP.apply(Block.mlp, self, h, shards, [self.gate.weight, self.up.weight, self.down.weight])


class LM(nn.Module):
    def __init__(self, tiled: bool, attend: Callable[..., torch.Tensor] = causal_attention) -> None:
        super().__init__()
        self.tiled = tiled
        self.tok = nn.Embedding(VOCAB, HIDDEN)
        self.blocks = nn.ModuleList(Block(tiled, attend) for _ in range(LAYERS))
        self.norm, self.head = nn.RMSNorm(HIDDEN), nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.tok(ids)
        for block in self.blocks:
            x = block(x)
        x = self.norm(x)
        if not self.tiled:
            return F.cross_entropy(self.head(x).view(-1, VOCAB), labels.view(-1))
        shards = math.ceil(labels.numel() / LOGIT_ROWS)
        loss = TiledFusedLogitsLoss.apply(_loss_sum, self.head, x, labels, None, shards, [self.head.weight], "sum")
        return loss / labels.numel()


def _loss_sum(head: nn.Linear, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(head(x).view(-1, VOCAB), y.view(-1), reduction="sum")


def step_peak(model: LM, seq: int) -> tuple[int, float]:
    """Peak live bytes of one forward + backward at ``seq`` tokens, and its CPU seconds."""
    g = torch.Generator().manual_seed(seq)
    ids = torch.randint(0, VOCAB, (1, seq + 1), generator=g)
    model.zero_grad(set_to_none=False)  # gradient buffers exist before the step: not counted
    start = time.process_time()
    with LiveBytes() as tracker:
        model(ids[:, :-1], ids[:, 1:]).backward()
    return tracker.peak, time.process_time() - start


def longest(model: LM, budget: int) -> tuple[int, dict[int, int]]:
    """The longest length (multiple of 64) whose step peaks within ``budget`` bytes."""
    seen: dict[int, int] = {}

    def fits(seq: int) -> bool:
        seen[seq] = step_peak(model, seq)[0]
        return seen[seq] <= budget

    lo, hi = 0, 256
    while fits(hi):
        lo, hi = hi, hi * 2
    while hi - lo > 64:
        mid = (lo + hi) // 2 // 64 * 64
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo, seen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget-mib", type=int, default=128)
    parser.add_argument("--out", type=Path, default=HERE / "results")
    args = parser.parse_args()
    torch.set_num_threads(1)
    budget = args.budget_mib * 2**20
    models, rows = {}, {}
    for name in ("plain", "tiled"):
        torch.manual_seed(0)
        models[name] = LM(name == "tiled")
        step_peak(models[name], 64)  # gradient buffers made
        rows[name] = dict(zip(("longest", "peaks"), longest(models[name], budget), strict=True))
    at = rows["plain"]["longest"]
    for name, row in rows.items():  # no optimizer step: the same weights as during the search
        row["peak_at_plain_longest"], row["cpu_s_at_plain_longest"] = step_peak(models[name], at)
    ratio = rows["tiled"]["longest"] / max(1, at)
    _write(args.out, rows, budget, ratio, os.getloadavg()[0])


def _write(out: Path, rows: dict, budget: int, ratio: float, load: float) -> None:
    out.mkdir(parents=True, exist_ok=True)
    params = sum(p.numel() for p in LM(False).parameters())
    (out / "alst_bench.json").write_text(json.dumps({
        "model": {"layers": LAYERS, "hidden": HIDDEN, "heads": HEADS, "mlp": MLP, "vocab": VOCAB, "params": params},
        "budget_bytes": budget, "modes": {k: {**v, "peaks": {str(s): b for s, b in v["peaks"].items()}}
                                          for k, v in rows.items()},
        "ratio": ratio, "target_met": ratio >= 4, "load_avg_1m_end": load}, indent=1))
    mib = 2**20
    p, t = rows["plain"], rows["tiled"]
    lines = ["## ALST tiling on one process (`scripts/bench/alst_bench.py`)\n",
             f"A {LAYERS}-block causal LM ({params / 1e6:.1f}M parameters: hidden {HIDDEN}, {HEADS} heads, SwiGLU "
             f"MLP {MLP}, vocabulary {VOCAB}), fp32, batch 1, one forward + backward; activation memory "
             "counted by a dispatch mode (tensors created during the step, alive at once; parameters and "
             f"gradient buffers not counted), budget {budget // mib} MiB. Tiled: `TiledMLP` (slices of "
             f"{HIDDEN} tokens) and `TiledFusedLogitsLoss` (slices of {LOGIT_ROWS} rows). Load average at "
             f"the end: {load:.1f} on 2 shared cores (memory does not depend on it).\n",
             "| model | longest sequence within budget | peak at the plain model's longest (MiB) "
             "| CPU s per step there |",
             "| --- | ---: | ---: | ---: |",
             f"| plain | {p['longest']} | {p['peak_at_plain_longest'] / mib:.1f} | {p['cpu_s_at_plain_longest']:.2f} |",
             f"| ALST tiling | {t['longest']} | {t['peak_at_plain_longest'] / mib:.1f} | "
             f"{t['cpu_s_at_plain_longest']:.2f} |",
             f"\nTiled / plain longest sequence: {ratio:.1f}x (target >= 4x: {'met' if ratio >= 4 else 'NOT met'}); "
             f"step CPU time at the same length: "
             f"{t['cpu_s_at_plain_longest'] / max(1e-9, p['cpu_s_at_plain_longest']):.2f}x (the slices' recompute)."]
    (out / "alst_bench.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
