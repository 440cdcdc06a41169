"""ZeRO-3 benchmark: step time and peak memory per rank, dslaunch stage 3 (+ offloads) vs torch
FSDP2 (``fully_shard``) vs DeepSpeed stage 3 (+ CPU offload), one run, same model and data.

Model: a GPT-like decoder (token + position embeddings, ``LAYERS`` pre-norm blocks of causal
self-attention and a 4x MLP, untied head; ~20M parameters), next-token cross-entropy on a cycle of
4 fixed random batches per rank (rank-seeded), the same initial weights for all (seed 0). fp32
(``--dtype bf16`` for bf16), AdamW (torch's fused kernel for everyone: dslaunch's ``AdamW`` config
builds it, FSDP2 and DeepSpeed get it as a client optimizer), 2 ranks on gloo, OMP_NUM_THREADS=1.

Workers get the launcher's env contract. First each configuration runs alone in a fresh process
pair: peak RSS (``VmHWM`` of /proc/self/status: it includes the ~220 MiB of importing torch, more
for DeepSpeed), the bytes of live tensors after the last step (a gc scan of unique storages:
parameters, gradients, optimizer state, buffers the engine keeps), the final loss (mean over ranks)
and its step time alone (JSON only). A configuration that fails to build there (NVMe offload
without an aio build, a key not implemented) is recorded with its error as "unsupported". Then
each of ``--repeats`` runs starts one process pair holding every working configuration, which take
turns step by step (order rotated; a barrier before each step; a step is forward, backward,
optimizer step, gathers finished), as ``engine_bench.py``: on this shared machine load drifts
within seconds, and separate runs per configuration measured the load more than the engines.
The table shows the median over runs of the slowest rank's median of ``--steps`` steps.

Usage: ``flock /tmp/dslaunch-bench.lock python scripts/bench/zero3_bench.py [--repeats 3]
[--steps 5] [--warmup 2] [--dtype fp32|bf16] [--only NAME ...]``.
Writes scripts/bench/results/zero3_bench.{json,md} (``zero3_bench_bf16.*`` for bf16).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from ranks import ratio_stats, ratio_text, report, run_ranks, slowest

HERE = Path(__file__).resolve().parent
VOCAB, DIM, LAYERS, HEADS, SEQ, MICRO, WORLD, LR = 8192, 384, 8, 6, 64, 4, 2, 1e-4
BUCKET = 5_000_000  # reduce/prefetch bucket elements, for dslaunch and DeepSpeed alike

# name -> (system, zero_optimization additions); "{nvme}" is replaced by a fresh directory
CONFIGS: dict[str, tuple[str, dict]] = {
    "dslaunch-z3": ("dslaunch", {}),
    "dslaunch-z3-offload-opt": ("dslaunch", {"offload_optimizer": {"device": "cpu"}}),
    "dslaunch-z3-offload-param": ("dslaunch", {"offload_param": {"device": "cpu"}}),
    "dslaunch-z3-nvme-opt": ("dslaunch", {"offload_optimizer": {"device": "nvme", "nvme_path": "{nvme}"}}),
    # dslaunch without its same-host shared-memory collectives: gloo for everything (before issue 43's)
    "dslaunch-z3-gloo": ("dslaunch-gloo", {}),
    "fsdp2": ("fsdp2", {}),
    "deepspeed-z3": ("deepspeed", {}),
    "deepspeed-z3-offload-opt": ("deepspeed", {"offload_optimizer": {"device": "cpu"}}),
    "deepspeed-z3-offload-param": ("deepspeed", {"offload_param": {"device": "cpu"}}),
    "deepspeed-z3-nvme-opt": ("deepspeed", {"offload_optimizer": {"device": "nvme", "nvme_path": "{nvme}"}}),
}
LABELS = {"dslaunch-z3": "dslaunch ZeRO-3", "dslaunch-z3-offload-opt": "dslaunch ZeRO-3 + offload_optimizer cpu",
          "dslaunch-z3-offload-param": "dslaunch ZeRO-3 + offload_param cpu",
          "dslaunch-z3-nvme-opt": "dslaunch ZeRO-3 + offload_optimizer nvme", "fsdp2": "torch FSDP2",
          "dslaunch-z3-gloo": "dslaunch ZeRO-3, gloo only",
          "deepspeed-z3": "DeepSpeed ZeRO-3", "deepspeed-z3-offload-opt": "DeepSpeed ZeRO-3 + offload_optimizer cpu",
          "deepspeed-z3-offload-param": "DeepSpeed ZeRO-3 + offload_param cpu",
          "deepspeed-z3-nvme-opt": "DeepSpeed ZeRO-3 + offload_optimizer nvme"}
# the peer each dslaunch configuration is compared with (besides FSDP2)
DS_PEER = {"dslaunch-z3": "deepspeed-z3", "dslaunch-z3-gloo": "deepspeed-z3", "dslaunch-z3-offload-opt": "deepspeed-z3-offload-opt",
           "dslaunch-z3-offload-param": "deepspeed-z3-offload-param", "dslaunch-z3-nvme-opt": "deepspeed-z3-nvme-opt"}


# ----- worker side ----------------------------------------------------------------------------
def _gpt():
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
            self.qkv, self.proj = nn.Linear(DIM, 3 * DIM), nn.Linear(DIM, DIM)
            self.fc, self.out = nn.Linear(DIM, 4 * DIM), nn.Linear(4 * DIM, DIM)

        def forward(self, x):
            b, t, _ = x.shape
            q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, HEADS, DIM // HEADS).permute(2, 0, 3, 1, 4)
            a = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.proj(a.transpose(1, 2).reshape(b, t, DIM))
            return x + self.out(nn.functional.gelu(self.fc(self.ln2(x))))

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok, self.pos = nn.Embedding(VOCAB, DIM), nn.Embedding(SEQ, DIM)
            self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
            self.ln, self.head = nn.LayerNorm(DIM), nn.Linear(DIM, VOCAB, bias=False)

        def forward(self, tokens):
            x = self.tok(tokens) + self.pos(torch.arange(tokens.shape[1]))
            for blk in self.blocks:
                x = blk(x)
            return self.head(self.ln(x))

    torch.manual_seed(0)
    return GPT()


def _batches(rank: int) -> list:
    import torch

    g = torch.Generator().manual_seed(1000 + rank)
    return [torch.randint(0, VOCAB, (MICRO, SEQ + 1), generator=g) for _ in range(4)]


def _loss(logits, seq):
    import torch

    return torch.nn.functional.cross_entropy(logits.float().reshape(-1, VOCAB), seq[:, 1:].reshape(-1))


def _ds_config(zero: dict, dtype: str, nvme: str) -> dict:
    zero = json.loads(json.dumps(zero).replace("{nvme}", nvme))
    cfg = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 1,
           "steps_per_print": 10**6, "zero_allow_untested_optimizer": True,
           "zero_force_ds_cpu_optimizer": False,
           "zero_optimization": {"stage": 3, "reduce_bucket_size": BUCKET, "overlap_comm": True,
                                 "stage3_prefetch_bucket_size": BUCKET, **zero}}
    return {**cfg, "bf16": {"enabled": True}} if dtype == "bf16" else cfg


def _build(name: str, dtype: str, nvme: str):
    """One configuration -> a function running one training step on a batch, returning the loss."""
    import torch

    system, zero = CONFIGS[name]
    model = _gpt()
    if system == "fsdp2":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16) if dtype == "bf16" else MixedPrecisionPolicy()
        for blk in model.blocks:
            fully_shard(blk, mp_policy=mp)
        fully_shard(model, mp_policy=mp)
        opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01, fused=True)

        def fsdp_step(seq):
            loss = _loss(model(seq[:, :-1]), seq)
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss
        return fsdp_step
    if system == "deepspeed":
        import deepspeed as ds

        client = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01, fused=True)
        cfg = _ds_config(zero, dtype, nvme)
    else:
        import dslaunch as ds

        client = None
        cfg = {**_ds_config(zero, dtype, nvme),
               "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}}}
        # same-host shared-memory collectives are opt-in; dslaunch-z3-gloo runs without
        cfg["shared_memory_collectives"] = "never" if system == "dslaunch-gloo" else "on"
    engine, _, _, _ = ds.initialize(model=model, config=cfg, model_parameters=model.parameters(),
                                    optimizer=client)
    finish = engine.zero.synchronize if system != "deepspeed" else (lambda: None)

    def ds_step(seq):
        loss = _loss(engine(seq[:, :-1]), seq)
        engine.backward(loss)
        engine.step()
        finish()  # nothing left in flight past the timed step
        return loss
    return ds_step


def _vm_hwm_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _tensor_mib() -> float:
    """Bytes of the unique storages of every live tensor the gc can see (wrapper subclasses such
    as DTensor hold no storage of their own: their local tensors are counted)."""
    import gc

    import torch

    seen: dict[int, int] = {}
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor):
            obj = getattr(obj, "_local_tensor", obj)  # a DTensor: its shard
            try:
                st = obj.untyped_storage()
                if st.data_ptr():
                    seen[st.data_ptr()] = max(seen.get(st.data_ptr(), 0), st.nbytes())
            except (RuntimeError, NotImplementedError, TypeError):
                pass
    return sum(seen.values()) / 2**20


def _init():
    import datetime

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=600))
    return dist


def _error(e: Exception) -> str:
    msg = str(e).strip()
    return f"{type(e).__name__}: {msg.splitlines()[0][:300] if msg else ''}"


def _alone_worker(name: str, steps: int, warmup: int, dtype: str) -> None:
    """One configuration in fresh processes: peak RSS, live tensors, final loss, step time alone."""
    dist = _init()
    out: dict = {}
    with tempfile.TemporaryDirectory(prefix="z3bench-nvme-") as nvme:
        try:
            step = _build(name, dtype, nvme)
        except Exception as e:  # noqa: BLE001 - a peer's failure is a result, recorded as is
            out["error"] = _error(e)
        if "error" not in out:
            data = _batches(dist.get_rank())
            times, loss = [], None
            for i in range(warmup + steps):
                dist.barrier()
                t0 = time.perf_counter()
                loss = step(data[i % len(data)])
                if i >= warmup:
                    times.append(time.perf_counter() - t0)
            final = loss.detach().float().reshape(1).clone()
            dist.all_reduce(final)
            out.update(alone_step_ms=statistics.median(times) * 1e3, final_loss=final.item() / WORLD,
                       tensor_mib=_tensor_mib())
        out["rss_peak_mib"] = _vm_hwm_mib()
    report(out)


def _turns_worker(names: list[str], steps: int, warmup: int, dtype: str) -> None:
    """Every configuration in one process pair, one step of each in turn (order rotated): load
    from other processes on the machine hits all of them alike, so the ratios stay meaningful."""
    dist = _init()
    with tempfile.TemporaryDirectory(prefix="z3bench-nvme-") as nvme:
        steps_of = {n: _build(n, dtype, nvme) for n in names}
        data = _batches(dist.get_rank())
        times: dict[str, list[float]] = {n: [] for n in names}
        for i in range(warmup + steps):
            for n in names[i % len(names):] + names[:i % len(names)]:
                dist.barrier()
                t0 = time.perf_counter()
                steps_of[n](data[i % len(data)])
                if i >= warmup:
                    times[n].append((time.perf_counter() - t0) * 1e3)
    report(times)


# ----- driver side ----------------------------------------------------------------------------
def _run(argv: list[str]) -> list[dict] | dict:
    res, why = run_ranks(__file__, argv, WORLD, timeout=1800)
    return res if res is not None else {"error": why.strip().splitlines()[-1][:300] if why.strip() else "no output"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    ap.add_argument("--only", nargs="*", help="subset of configurations, e.g. dslaunch-z3 fsdp2")
    args = ap.parse_args()
    names = [n for n in CONFIGS if not args.only or n in args.only]
    load = [os.getloadavg()[0]]
    alone: dict[str, list[dict] | dict] = {}
    for n in names:
        alone[n] = _run(["alone", n, str(args.steps), str(args.warmup), args.dtype])
        print(f"alone {n}: {_brief(alone[n])}", flush=True)
    load.append(os.getloadavg()[0])
    ok = [n for n in names if not _failed(alone[n])]
    turns: list = []
    for rep in range(args.repeats):
        res = _run(["turns", ",".join(ok), str(args.steps), str(args.warmup), args.dtype])
        load.append(os.getloadavg()[0])
        if _failed(res):
            print(f"turns round {rep} failed: {_failed(res)}", flush=True)
            continue
        turns.append(res)
        print(f"turns round {rep}: " + ", ".join(f"{n} {statistics.median(slowest(res, n)):.0f} ms" for n in ok),
              flush=True)
    _write(names, alone, turns, load, args)


def _failed(res: list[dict] | dict) -> str | None:
    if isinstance(res, dict):
        return res["error"]
    return next((r["error"] for r in res if "error" in r), None)


def _brief(res: list[dict] | dict) -> str:
    err = _failed(res)
    if err:
        return f"unsupported ({err})"
    return ", ".join(f"rank{i} {r['alone_step_ms']:.0f} ms {r['rss_peak_mib']:.0f} MiB loss {r['final_loss']:.6f}"
                     for i, r in enumerate(res))


def _summary(name: str, alone: list[dict] | dict, turns: list) -> dict:
    err = _failed(alone)
    if err:
        return {"error": err}
    rounds = [statistics.median(slowest(res, name)) for res in turns]
    return {"step_ms": statistics.median(rounds) if turns else float("nan"), "rounds_ms": rounds,
            "alone_step_ms": max(r["alone_step_ms"] for r in alone),
            "rss_peak_mib": max(r["rss_peak_mib"] for r in alone),
            "tensor_mib": max(r["tensor_mib"] for r in alone), "final_loss": alone[0]["final_loss"]}


def _ratio(this: dict, other: dict, key: str, speed: bool) -> str:
    """other/this for times (a speed-up, "x"), this/other for memory; "-" without a peer."""
    if "error" in other or key not in other or other is this:
        return "-"
    return f"{other[key] / this[key]:.2f}x" if speed else f"{this[key] / other[key]:.2f}"


def _write(names: list[str], alone: dict, turns: list, load: list[float], args: argparse.Namespace) -> None:
    summary = {n: _summary(n, alone[n], turns) for n in names}
    for n in names:  # per-round ratios and per-step quartiles against the peers
        for peer, key in (("fsdp2", "fsdp2_over_this"), (DS_PEER.get(n), "deepspeed_over_this")):
            if n in DS_PEER and turns and "error" not in summary[n] and "error" not in summary.get(peer, {"error": 1}):
                summary[n][key] = ratio_stats(turns, n, peer)
    import torch

    params = sum(p.numel() for p in _gpt().parameters())
    results = HERE / "results"
    results.mkdir(exist_ok=True)
    stem = "zero3_bench" if args.dtype == "fp32" else f"zero3_bench_{args.dtype}"
    (results / f"{stem}.json").write_text(json.dumps(
        {"model": f"GPT {LAYERS} layers, dim {DIM}, vocab {VOCAB}, seq {SEQ}", "params": params,
         "world": WORLD, "micro_batch": MICRO, "dtype": args.dtype, "repeats": args.repeats,
         "steps": args.steps, "warmup": args.warmup, "load_average_1min": load,
         "torch": torch.__version__, "summary": summary, "alone_runs": alone, "turns_runs": turns},
        indent=1))
    ref = summary.get("dslaunch-z3", {}).get("final_loss")
    rows = [f"## ZeRO-3 vs FSDP2 and DeepSpeed, {args.dtype} (`zero3_bench.py --dtype {args.dtype}`)", "",
            f"GPT-like decoder, {params / 1e6:.1f}M parameters ({LAYERS} layers, dim {DIM}, vocab {VOCAB}), "
            f"{args.dtype}, AdamW (torch's fused kernel for all), {WORLD} ranks on gloo, micro batch "
            f"{MICRO} x {SEQ} tokens, same initial weights and data for all. Step time: median over "
            f"{args.repeats} runs of the slowest rank's median of {args.steps} steps (after "
            f"{args.warmup} warm-up); in each run every configuration lives in one process pair and "
            "they take turns step by step, so load from other processes hits them alike. Peak RSS "
            "(VmHWM, max over ranks; includes the interpreter and torch, ~220 MiB, and DeepSpeed's "
            "imports), live tensors (gc scan after the last step) and the final loss (mean over "
            f"ranks after {args.warmup + args.steps} steps) come from a separate fresh run per "
            f"configuration. Load average (1 min) during the run: {min(load):.1f}-{max(load):.1f} on "
            "2 cores shared with other work: absolute times are noisy, ratios less so. For the "
            "dslaunch configurations each ratio is the overall one, then per round, then the median "
            "[quartiles] of the per-step ratios over all rounds.", "",
            "| config | step ms | FSDP2 / this | DeepSpeed / this | peak RSS/rank MiB | RSS / FSDP2's "
            "| RSS / DeepSpeed's | live tensors MiB | final loss (diff to dslaunch ZeRO-3) |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    fsdp = summary.get("fsdp2", {})
    for n in names:
        s = summary[n]
        if "error" in s:
            rows.append(f"| {LABELS[n]} | unsupported: {s['error'][:160].replace('|', '/')} "
                        "| - | - | - | - | - | - | - |")
            continue
        peer = summary.get(DS_PEER.get(n, ""), {})
        diff = f" ({s['final_loss'] - ref:+.1e})" if ref is not None and n != "dslaunch-z3" else ""
        vs_fsdp, vs_ds = _ratio(s, fsdp, "step_ms", True), _ratio(s, peer, "step_ms", True)
        vs_fsdp += f": {ratio_text(s['fsdp2_over_this'])}" if "fsdp2_over_this" in s else ""
        vs_ds += f": {ratio_text(s['deepspeed_over_this'])}" if "deepspeed_over_this" in s else ""
        rows.append(f"| {LABELS[n]} | {s['step_ms']:.0f} | {vs_fsdp} "
                    f"| {vs_ds} | {s['rss_peak_mib']:.0f} "
                    f"| {_ratio(s, fsdp, 'rss_peak_mib', False)} | {_ratio(s, peer, 'rss_peak_mib', False)} "
                    f"| {s['tensor_mib']:.1f} | {s['final_loss']:.6f}{diff} |")
    text = "\n".join(rows)
    (results / f"{stem}.md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--worker":
        kind, what = sys.argv[2], sys.argv[3]
        worker = _alone_worker if kind == "alone" else _turns_worker
        worker(what if kind == "alone" else what.split(","), int(sys.argv[4]), int(sys.argv[5]), sys.argv[6])
    else:
        main()
