"""Mixture of experts at expert-parallel degree 1, 2 and 4 on 4 ranks: step time and bytes per step.

Model: a token projection, ``MOE_LAYERS`` MoE layers (``EXPERTS`` experts of a ``DIM`` -> ``FFN``
-> ``DIM`` GELU MLP, top-2, capacity factor 1.25, tokens dropped over it; ~4.2M expert parameters
in all) with a residual connection around each, and a classifier head; ``TOKENS`` tokens per rank
and step (rank-seeded, a cycle of 4 batches), fp32, AdamW, ZeRO stage 0, gloo on 4 CPU ranks with
one thread each. At ep 1 every rank holds all experts and their gradients are all-reduced over the
4 ranks; at ep 2 and 4 the experts are spread, each MoE layer exchanges tokens with two
all-to-alls over its expert group forward and two backward, and expert gradients are all-reduced
over the expert-data group only (2 ranks at ep 2, none at ep 4).

Bytes: the comms logger's (``comms_logger`` in the ds_config): what each rank hands each
collective per step (its payload), all-to-all and all-reduce apart; an all-to-all's "sent" is the
share that leaves the rank, (ep-1)/ep of it. Time: the three
engines live in one set of 4 processes and take turns step by step (order rotated, a barrier
before each step), as ``engine_bench.py``: load from the rest of the machine hits them alike. The
table shows the median over steps of the slowest rank's step.

Usage: ``flock /tmp/dslaunch-bench.lock python scripts/bench/moe_bench.py [--steps 12] [--warmup 3]``.
Writes scripts/bench/results/moe_bench.{json,md}.
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
WORLD, DIM, FFN, EXPERTS, MOE_LAYERS, TOKENS, CLASSES = 4, 256, 512, 8, 2, 512, 16
EP_SIZES = (1, 2, 4)


def _model(ep: int):
    import torch

    from dslaunch.moe.layer import MoE

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            expert = torch.nn.Sequential(torch.nn.Linear(DIM, FFN), torch.nn.GELU(), torch.nn.Linear(FFN, DIM))
            self.inp = torch.nn.Linear(DIM, DIM)
            self.moe = torch.nn.ModuleList(MoE(DIM, expert, num_experts=EXPERTS, ep_size=ep, k=2,
                                               capacity_factor=1.25, min_capacity=4)
                                           for _ in range(MOE_LAYERS))
            self.head = torch.nn.Linear(DIM, CLASSES)

        def forward(self, batch):
            x, y = batch
            h = self.inp(x)
            aux = 0.0
            for layer in self.moe:
                out, l_aux, _ = layer(h)
                h, aux = h + out, aux + l_aux
            return torch.nn.functional.cross_entropy(self.head(h), y) + 0.01 * aux

    return Net()


def _batches(rank: int) -> list:
    import torch

    gen = torch.Generator().manual_seed(rank)
    return [(torch.randn(TOKENS, DIM, generator=gen), torch.randint(0, CLASSES, (TOKENS,), generator=gen))
            for _ in range(4)]


def _bytes(logger, ep: int) -> dict[str, float]:
    """This step's payload bytes per collective kind, from the comms logger's records."""
    out = {"all_to_all": 0, "all_reduce": 0, "all_to_all_calls": 0, "all_reduce_calls": 0}
    for name, by_size in logger.get_raw_data().items():
        kind = "all_to_all" if "all_to_all" in name else "all_reduce" if "all_reduce" in name else None
        for size, row in by_size.items() if kind else ():
            out[kind] += size * row[0]
            out[f"{kind}_calls"] += row[0]
    out["all_to_all_sent"] = out["all_to_all"] * (ep - 1) / ep
    return out


def _worker(steps: int, warmup: int) -> None:
    import torch

    import dslaunch
    from dslaunch import comm

    torch.set_num_threads(1)
    config = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
              "zero_optimization": {"stage": 0}, "comms_logger": {"enabled": True, "prof_all": True},
              "steps_per_print": 10**9}
    engines = {}
    for ep in EP_SIZES:
        model = _model(ep)
        engines[ep], *_ = dslaunch.initialize(model=model, model_parameters=model.parameters(), config=config)
    data = _batches(comm.get_rank())
    times: dict[int, list[float]] = {ep: [] for ep in EP_SIZES}
    sent: dict[int, list[dict]] = {ep: [] for ep in EP_SIZES}
    order = list(EP_SIZES)
    for i in range(warmup + steps):
        for ep in order[i % len(order):] + order[:i % len(order)]:
            engine = engines[ep]
            torch.distributed.barrier()
            comm.comms_logger.reset()
            t0 = time.perf_counter()
            loss = engine(data[i % len(data)])
            engine.backward(loss)
            engine.step()
            if i >= warmup:
                times[ep].append((time.perf_counter() - t0) * 1e3)
                sent[ep].append(_bytes(comm.comms_logger, ep))
    report({str(ep): {"times": times[ep], "bytes": sent[ep][-1]} for ep in EP_SIZES})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return _worker(int(args.worker[0]), int(args.worker[1]))
    load = [os.getloadavg()[0]]
    res, why = run_ranks(__file__, [str(args.steps), str(args.warmup)], WORLD, timeout=1200)
    load.append(os.getloadavg()[0])
    if res is None:
        sys.exit(f"moe_bench: {why}")
    rows = []
    for ep in EP_SIZES:
        per_step = [max(step) for step in zip(*(r[str(ep)]["times"] for r in res), strict=True)]
        b = res[0][str(ep)]["bytes"]
        rows.append({"ep": ep, "step_ms": statistics.median(per_step), "step_ms_all": per_step,
                     "all_to_all_bytes": b["all_to_all"], "all_to_all_sent_bytes": b["all_to_all_sent"],
                     "all_to_all_calls": b["all_to_all_calls"], "all_reduce_bytes": b["all_reduce"],
                     "all_reduce_calls": b["all_reduce_calls"]})
        print(f"ep {ep}: {rows[-1]['step_ms']:.0f} ms, all_to_all {b['all_to_all'] / 2**20:.2f} MiB, "
              f"all_reduce {b['all_reduce'] / 2**20:.2f} MiB", flush=True)
    _write(rows, load, args)


def _write(rows: list[dict], load: list[float], args: argparse.Namespace) -> None:
    out = HERE / "results"
    out.mkdir(exist_ok=True)
    meta = {"world": WORLD, "dim": DIM, "ffn": FFN, "experts": EXPERTS, "moe_layers": MOE_LAYERS,
            "tokens_per_rank": TOKENS, "k": 2, "capacity_factor": 1.25, "steps": args.steps,
            "warmup": args.warmup, "loadavg_1m": load, "cpus": os.cpu_count()}
    (out / "moe_bench.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    mib = 2**20
    lines = ["| ep | step ms (median, slowest rank) | all-to-all MiB/step/rank: payload (sent), calls "
             "| all-reduce MiB/step/rank: payload, calls |",
             "| ---: | ---: | ---: | ---: |"]
    lines += [f"| {r['ep']} | {r['step_ms']:.0f} | {r['all_to_all_bytes'] / mib:.2f} ({r['all_to_all_sent_bytes'] / mib:.2f}),"
              f" {r['all_to_all_calls']} | {r['all_reduce_bytes'] / mib:.2f}, {r['all_reduce_calls']} |" for r in rows]
    lines.append(f"\nload average (1 min) before/after: {load[0]:.1f} / {load[-1]:.1f} on {os.cpu_count()} CPUs")
    (out / "moe_bench.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
