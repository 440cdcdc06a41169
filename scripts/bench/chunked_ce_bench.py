"""The chunked cross-entropy against Hugging Face's loss: memory of one forward + backward, and time.

Hugging Face's ``ForCausalLMLoss`` is ``F.cross_entropy(logits.float(), target)``: an fp32 copy of
the ``[tokens, vocab]`` logits, an fp32 log-softmax kept for backward, two more fp32 tensors in
backward. ``deepspeed.runtime.chunked_cross_entropy`` (``backend="torch"``, the one that runs on
this CPU machine) keeps the logits as given and one fp32 number per token.

Memory: bytes of the tensors created during forward + backward (the logits exist before and are not
counted), alive after forward and at most (``LiveBytes``, a dispatch mode counting each storage
from creation to free): exact, whatever the machine's load. Time: median of ``--repeats`` forward +
backward passes per variant, interleaved, as wall and CPU time (one thread).

Target: no fp32 ``[tokens, vocab]`` tensor: the chunked loss's peak is at most its gradient (the
logits' size and dtype) plus one fp32 block of rows (``cross_entropy_block_rows``, ~256 MiB) and
1 MiB, whatever the sizes; Hugging Face's peak is about three fp32 copies of the logits.

Writes ``results/chunked_ce_bench.json`` and ``.md``. Usage:
``python scripts/bench/chunked_ce_bench.py [--repeats 3] [--out DIR]``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from dslaunch.kernels.reference import cross_entropy_block_rows
from dslaunch.runtime.activation_checkpointing.memory import LiveBytes
from dslaunch.runtime.chunked_cross_entropy import chunked_cross_entropy

HERE = Path(__file__).resolve().parent
SHAPES = [(4096, 32000), (2048, 128256)]  # (tokens, vocab): a Llama-2-size vocabulary, a Llama-3-size one
VARIANTS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "Hugging Face (fp32 cross_entropy)": lambda x, t: F.cross_entropy(x.float(), t),
    "chunked (torch backend)": lambda x, t: chunked_cross_entropy(x, t, backend="torch"),
}


def _inputs(tokens: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(tokens, vocab, generator=g) * 2).to(torch.bfloat16).requires_grad_()
    return logits, torch.randint(0, vocab, (tokens,), generator=g)


def _memory(fn: Callable, logits: torch.Tensor, target: torch.Tensor) -> dict[str, int]:
    logits.grad = None
    with LiveBytes() as live:
        loss = fn(logits, target)
        held = live.live
        loss.backward()
        peak = live.peak
    return {"held_after_forward": held, "peak": peak}


def _time(fn: Callable, logits: torch.Tensor, target: torch.Tensor) -> tuple[float, float]:
    logits.grad = None
    wall, cpu = time.perf_counter(), time.process_time()
    fn(logits, target).backward()
    return time.perf_counter() - wall, time.process_time() - cpu


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, default=HERE / "results")
    args = ap.parse_args()
    torch.set_num_threads(1)
    results = []
    for tokens, vocab in SHAPES:
        logits, target = _inputs(tokens, vocab)
        row = {"tokens": tokens, "vocab": vocab, "logits_bytes": logits.numel() * logits.element_size(), "variants": {}}
        for name, fn in VARIANTS.items():
            row["variants"][name] = {**_memory(fn, logits, target), "wall_s": [], "cpu_s": []}
        for _ in range(args.repeats):
            for name, fn in VARIANTS.items():
                wall, cpu = _time(fn, logits, target)
                row["variants"][name]["wall_s"].append(wall)
                row["variants"][name]["cpu_s"].append(cpu)
        hf, ours = (row["variants"][n] for n in VARIANTS)
        row["peak_ratio"] = ours["peak"] / hf["peak"]
        block = min(tokens, cross_entropy_block_rows(vocab)) * vocab * 4
        row["bound_bytes"] = row["logits_bytes"] + block + 2**20
        row["target_met"] = ours["peak"] <= row["bound_bytes"]
        row["cpu_ratio"] = statistics.median(ours["cpu_s"]) / statistics.median(hf["cpu_s"])
        results.append(row)
        print(f"{tokens}x{vocab}: peak {ours['peak'] / 2**20:.0f} MiB vs {hf['peak'] / 2**20:.0f} MiB "
              f"({row['peak_ratio']:.2f}); CPU time {row['cpu_ratio']:.2f}x", flush=True)
    _write(args.out, results, os.getloadavg()[0], args.repeats)


def _write(out: Path, results: list[dict], load: float, repeats: int) -> None:
    met = all(r["target_met"] for r in results)
    out.mkdir(parents=True, exist_ok=True)
    (out / "chunked_ce_bench.json").write_text(json.dumps({"results": results, "load_avg_1m_end": load,
                                                           "repeats": repeats, "target_met": met}, indent=1))
    mib = 2**20
    lines = ["## Chunked cross-entropy (`scripts/bench/chunked_ce_bench.py`)\n",
             "bf16 logits `[tokens, vocab]`, one forward + backward of the mean loss on one CPU thread. Memory: "
             "bytes of the tensors created during it (the logits themselves not counted), alive after forward and "
             "at most (exact: a dispatch mode counting storages). Time: median of "
             f"{repeats} interleaved passes, CPU time of the process (wall time in the JSON). Load average at "
             f"the end: {load:.1f} on 2 shared cores. Target: the chunked peak at most its gradient plus one fp32 "
             f"block of rows (~256 MiB) and 1 MiB (no fp32 copy of the logits): {'met' if met else 'NOT met'}.\n",
             "| tokens x vocab (logits MiB) | loss | held after forward (MiB) | peak (MiB) | peak vs HF | CPU s | CPU vs HF |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    for r in results:
        hf = r["variants"][next(iter(VARIANTS))]
        for name, v in r["variants"].items():
            cpu = statistics.median(v["cpu_s"])
            lines.append(f"| {r['tokens']} x {r['vocab']} ({r['logits_bytes'] / mib:.0f}) | {name} | "
                         f"{v['held_after_forward'] / mib:.1f} | {v['peak'] / mib:.1f} | {v['peak'] / hf['peak']:.2f} | "
                         f"{cpu:.2f} | {cpu / statistics.median(hf['cpu_s']):.2f}x |")
    (out / "chunked_ce_bench.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
