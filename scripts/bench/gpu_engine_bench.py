"""One-GPU training step of a ~1B-parameter GPT-like model: plain torch against the engine.

Each case runs in its own process (a clean CUDA allocator for its peak), 3 warm-up steps and then
``--steps`` timed one by one; the step time is their median. Cases:

- ``torch``: fp32 parameters, ``autocast(bf16)``, ``torch.optim.AdamW(fused=True)``, ``nn.LayerNorm``
  (what a user writes without DeepSpeed);
- ``z0``/``z2``/``z3``: the engine in bf16 (bf16 parameters, fp32 master weights and Adam state),
  the model's norms ``dslaunch.ops.FusedLayerNorm`` and the config's ``AdamW`` (FusedAdam);
- ``z0_reference``: ``z0`` with ``DSLAUNCH_KERNELS=reference`` (torch's norm and optimizer code in
  place of the Triton kernels): what the kernels buy inside a real step;
- ``z2_offload``: ZeRO-2 with the optimizer on the CPU (``DeepSpeedCPUAdam``, pinned staging). Its
  step splits into forward + backward and the optimizer step (``engine.step``, which waits for the
  CPU update and the copy back); the overlap column is how much of the gradients' device-to-host
  copy and the CPU update was hidden behind the backward: 1 - (step - fwd/bwd of z2) / (optimizer
  step alone), where "alone" is ``DeepSpeedCPUAdam`` on as many elements, timed on its own after
  the run. Its ``phases`` are the engine's own split of the optimizer step (median per phase:
  norm, gradients in, update, write-back; ``engine.zero.offload.phases``).

    python scripts/bench/gpu_engine_bench.py              (a CUDA device; results/gpu_engine_bench.*)
    python scripts/bench/gpu_engine_bench.py --smoke      (CPU, a tiny model: the bookkeeping only)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

RESULTS = Path(__file__).resolve().parent / "results"
CASES = ["torch", "z0", "z0_reference", "z2", "z3", "z2_offload"]


class Block(nn.Module):
    def __init__(self, d: int, heads: int, norm: type[nn.Module]):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = norm(d), norm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (z.view(b, t, self.heads, -1).transpose(1, 2) for z in self.qkv(self.ln1(x)).split(d, -1))
        x = x + self.proj(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class GPT(nn.Module):
    def __init__(self, d: int, layers: int, heads: int, vocab: int, norm: type[nn.Module]):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d, heads, norm) for _ in range(layers))
        self.ln = norm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.emb(tokens)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln(x)).float()
        return F.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())


def _shape(smoke: bool) -> dict:
    # d=2048, 20 layers: 20 x 12 d^2 + 2 x 32000 d = 1.14B parameters
    return dict(d=64, layers=2, heads=2, vocab=128, batch=2, seq=32) if smoke else \
        dict(d=2048, layers=20, heads=16, vocab=32000, batch=4, seq=1024)


def _config(case: str) -> dict:
    stage = {"z0": 0, "z0_reference": 0, "z2": 2, "z3": 3, "z2_offload": 2}[case]
    zero: dict = {"stage": stage}
    if case == "z2_offload":
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    return {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
            "steps_per_print": 10**6, "bf16": {"enabled": True}, "zero_optimization": zero,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.01}}}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def run_case(case: str, steps: int, smoke: bool) -> dict:
    """One case in this process: the median step, its split and the peak memory."""
    import dslaunch as deepspeed
    from dslaunch.ops.normalization import FusedLayerNorm

    shape = _shape(smoke)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    norm = nn.LayerNorm if case == "torch" else FusedLayerNorm
    with torch.device(device):
        model = GPT(shape["d"], shape["layers"], shape["heads"], shape["vocab"], norm)
    params = sum(p.numel() for p in model.parameters())
    tokens = torch.randint(0, shape["vocab"], (shape["batch"], shape["seq"]), device=device)
    if case == "torch":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01, fused=device.type == "cuda")

        def fwd_bwd() -> None:
            with torch.autocast(device.type, dtype=torch.bfloat16):
                loss = model(tokens)
            loss.backward()

        def update() -> None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
    else:
        deepspeed.init_distributed(verbose=False)
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=_config(case))

        def fwd_bwd() -> None:
            engine.backward(engine(tokens))

        update = engine.step
    times, split, phases = [], [], []
    for i in range(3 + steps):
        _sync(device)
        t0 = time.perf_counter()
        fwd_bwd()
        _sync(device)
        t1 = time.perf_counter()
        update()
        _sync(device)
        if i >= 3:
            times.append(time.perf_counter() - t0)
            split.append(t1 - t0)
            if case == "z2_offload":
                phases.append(engine.zero.offload.phases.ms)
    out = {"case": case, "params": params, "tokens": shape["batch"] * shape["seq"],
           "step_ms": 1e3 * statistics.median(times), "fwd_bwd_ms": 1e3 * statistics.median(split),
           "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None}
    if case == "z2_offload":
        out["phases_ms"] = {k: statistics.median(p[k] for p in phases) for k in phases[0]}
        del engine, model
        out["cpu_update_ms"] = _cpu_update_ms(params)
    return out


def _cpu_update_ms(numel: int) -> float:
    """``DeepSpeedCPUAdam`` updating ``numel`` fp32 elements on its own, as the offloaded step
    does (median of 3 after one warm-up)."""
    from dslaunch.ops.adam import DeepSpeedCPUAdam

    p = nn.Parameter(torch.zeros(numel))
    p.grad = torch.full_like(p, 1e-3)
    opt = DeepSpeedCPUAdam([p], lr=1e-4, weight_decay=0.01)
    times = []
    for _ in range(4):
        t0 = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times[1:])


def _table(rows: list[dict], env: dict) -> str:
    base = next((r for r in rows if r["case"] == "torch" and "step_ms" in r), None)
    z2 = next((r for r in rows if r["case"] == "z2" and "step_ms" in r), None)
    lines = [f"GPU: {env['gpu']}; torch {env['torch']}. GPT-like model, {rows[0].get('params', 0) / 1e9:.2f}B "
             f"parameters, {rows[0].get('tokens', 0)} tokens a step, bf16; median of the timed steps, each "
             "in its own process. Ratio > 1: faster than plain torch.", "",
             "| case | step ms | fwd+bwd ms | optimizer ms | tokens/s | vs torch | peak GiB | overlap |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        if "step_ms" not in r:
            lines.append(f"| {r['case']} | {r.get('error', 'failed')[:150]} | | | | | | |")
            continue
        ratio = f"{base['step_ms'] / r['step_ms']:.2f}x" if base else ""
        overlap = ""
        if "cpu_update_ms" in r and z2:
            hidden = 1 - (r["step_ms"] - z2["fwd_bwd_ms"]) / r["cpu_update_ms"]
            overlap = f"{hidden:.0%}"
        peak = f"{r['peak_gib']:.1f}" if r["peak_gib"] is not None else ""
        lines.append(f"| {r['case']} | {r['step_ms']:.1f} | {r['fwd_bwd_ms']:.1f} | "
                     f"{r['step_ms'] - r['fwd_bwd_ms']:.1f} | {r['tokens'] / r['step_ms'] * 1e3:,.0f} | {ratio} | "
                     f"{peak} | {overlap} |")
    lines += [f"\n{r['case']} optimizer step by phase (ms, median): "
              + ", ".join(f"{k} {v:.1f}" for k, v in r["phases_ms"].items()) for r in rows if "phases_ms" in r]
    return "\n".join(lines) + "\n"


def _write(folder: Path, rows: list[dict], env: dict) -> str:
    """gpu_engine_bench.json and .md in ``folder`` from the cases so far; the table."""
    table = _table(rows, env)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "gpu_engine_bench.json").write_text(json.dumps({"env": env, "rows": rows}, indent=1))
    (folder / "gpu_engine_bench.md").write_text("## One-GPU engine step (`scripts/bench/gpu_engine_bench.py`)\n\n" + table)
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", choices=CASES, help="run one case in this process (internal)")
    parser.add_argument("--cases", default=",".join(CASES), help="comma-separated, of: " + ", ".join(CASES))
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--smoke", action="store_true", help="CPU, a tiny model, results not saved")
    parser.add_argument("--timeout", type=float, default=240, help="seconds a case may take")
    parser.add_argument("--out", type=Path, help="also write the results here, after each case (a run stopped "
                                                 "part way leaves those that finished)")
    args = parser.parse_args()
    if args.case:
        print("RESULT " + json.dumps(run_case(args.case, args.steps, args.smoke)), flush=True)
        return
    env = {"gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "none (CPU smoke)",
           "torch": torch.__version__}
    rows = []
    for case in args.cases.split(","):
        env_vars = {**os.environ, **({"DSLAUNCH_KERNELS": "reference"} if case.endswith("_reference") else {})}
        cmd = [sys.executable, __file__, "--case", case, "--steps", str(args.steps)] + (["--smoke"] if args.smoke else [])
        try:
            done = subprocess.run(cmd, env=env_vars, capture_output=True, text=True, timeout=args.timeout)
            found = [ln[7:] for ln in done.stdout.splitlines() if ln.startswith("RESULT ")]
            rows.append(json.loads(found[-1]) if found else
                        {"case": case, "error": (done.stderr.strip().splitlines() or ["no output"])[-1]})
        except subprocess.TimeoutExpired:
            rows.append({"case": case, "error": f"timed out after {args.timeout:.0f} s"})
        print(json.dumps(rows[-1]), flush=True)
        if args.out:
            _write(args.out, rows, env)
    print(_table(rows, env))
    if not args.smoke:
        _write(RESULTS, rows, env)
    sys.exit(0 if all("step_ms" in r for r in rows) else 1)


if __name__ == "__main__":
    main()
