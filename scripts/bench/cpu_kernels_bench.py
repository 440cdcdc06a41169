"""dslaunch's C kernels on CPU: (a) each optimizer against torch's fastest equivalent and
DeepSpeed's CPU op, (b) the fused offloaded step against the same sequence in torch ops (and with
DeepSpeed's CPU Adam in it), (c) achieved memory bandwidth against a streaming measurement.

One flat fp32 partition of ``--numel`` elements. Each (case, threads) runs in its own process
(``OMP_NUM_THREADS`` and ``torch.set_num_threads`` = 1 or 2) in which the contenders take turns
(``--rounds`` rounds of ``--steps`` steps after a warm-up), so load drifts hit them alike; the
median round counts. DeepSpeed's ops must already be JIT-built (minutes each; ``make bench`` or
a first ``DeepSpeedCPUAdam(...)`` does it) or its column says so.

Bytes counted (no write-allocate traffic, for the kernels and the streaming copy alike): Adam
reads param, grad, exp_avg, exp_avg_sq and writes param, exp_avg, exp_avg_sq: 28 B/element;
Adagrad and Lion read param, grad and one state and write param and the state: 20 B/element; the
offloaded step with bf16 gradients and a bf16 copy: pass 1 reads the gradient (2 B), pass 2 reads
it again (2 B) and the fp32 param and moments (12 B), writes them (12 B) and the copy (2 B): 30
B/element. Streaming bandwidth: the best of torch's ``copy_`` (8 B/element) and triad ``add(b, c,
alpha=s, out=a)`` (12 B/element) over the same sizes, taking turns with the contenders.

Writes ``results/cpu_kernels_bench.json`` and ``results/cpu_kernels_bench.md``.
Usage: ``flock /tmp/dslaunch-bench.lock python scripts/bench/cpu_kernels_bench.py [--numel N]``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
THREADS = (1, 2)
# case -> (hyperparameters, DeepSpeed class)
CASES = {
    "AdamW": ({"lr": 1e-3, "weight_decay": 0.01}, "deepspeed.ops.adam:DeepSpeedCPUAdam"),
    "Adam (L2)": ({"lr": 1e-3, "weight_decay": 0.01}, "deepspeed.ops.adam:DeepSpeedCPUAdam"),
    "Adagrad": ({"lr": 1e-2, "weight_decay": 0.01}, "deepspeed.ops.adagrad:DeepSpeedCPUAdagrad"),
    "Lion": ({"lr": 1e-4, "weight_decay": 0.01}, "deepspeed.ops.lion:DeepSpeedCPULion"),
}
LOSS_SCALE, MAX_NORM = 1024.0, 1.0
# Bytes each step must move per element (see the module docstring).
BYTES_PER_ELEMENT = {"AdamW": 28, "Adam (L2)": 28, "Adagrad": 20, "Lion": 20, "offload": 30}


def _median_ms(fns: dict[str, Callable[[], None]], rounds: int, steps: int) -> dict[str, float]:
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            for _ in range(steps):
                fn()
            times[name].append((time.perf_counter() - t0) / steps * 1e3)
    return {k: statistics.median(v) for k, v in times.items()}


def _optimizers(case: str, numel: int) -> dict[str, Callable[[], None]]:
    import importlib

    import torch

    from dslaunch.ops.adagrad import DeepSpeedCPUAdagrad
    from dslaunch.ops.adam import DeepSpeedCPUAdam
    from dslaunch.ops.lion import DeepSpeedCPULion
    from dslaunch.runtime.optim.lion import Lion

    params, ds_path = CASES[case]
    l2 = {"adamw_mode": False} if case == "Adam (L2)" else {}

    def param():
        p = torch.nn.Parameter(torch.randn(numel, generator=torch.Generator().manual_seed(0)))
        p.grad = torch.randn(numel, generator=torch.Generator().manual_seed(1))
        return p

    ours = {"AdamW": DeepSpeedCPUAdam, "Adam (L2)": DeepSpeedCPUAdam, "Adagrad": DeepSpeedCPUAdagrad,
            "Lion": DeepSpeedCPULion}[case]
    opts = {"dslaunch": ours([param()], **params, **l2)}
    if case == "Lion":  # torch has no Lion: dslaunch's reference (torch foreach ops in cache-sized batches)
        opts["torch"] = Lion([param()], **params)
    else:
        cls = {"AdamW": torch.optim.AdamW, "Adam (L2)": torch.optim.Adam, "Adagrad": torch.optim.Adagrad}[case]
        opts["torch"] = cls([param()], fused=True, **params)
    try:
        module, name = ds_path.split(":")
        opts["deepspeed"] = getattr(importlib.import_module(module), name)([param()], **params, **l2)
    except Exception as exc:  # not built, or not installed: report it, measure the rest
        opts["deepspeed_error"] = f"{type(exc).__name__}: {str(exc)[:80]}"  # type: ignore[assignment]
    return opts


def _offload_contenders(numel: int) -> dict[str, Callable[[], None]]:
    import torch

    from dslaunch.kernels.cpu.offload import offload_adam_step

    gen = torch.Generator().manual_seed(0)
    grad16 = (torch.randn(numel, generator=gen) * LOSS_SCALE * 1e-3).to(torch.bfloat16)
    master, m, v = torch.randn(numel, generator=gen), torch.zeros(numel), torch.zeros(numel)
    copy16 = torch.empty(numel, dtype=torch.bfloat16)
    step = [0]

    def fused() -> None:
        step[0] += 1
        offload_adam_step([master], [grad16], [m], [v], step=step[0], lr=1e-3, weight_decay=0.01,
                          loss_scale=LOSS_SCALE, max_grad_norm=MAX_NORM, copies=[copy16])

    p_t = torch.nn.Parameter(master.clone())
    torch_opt = torch.optim.AdamW([p_t], lr=1e-3, weight_decay=0.01, fused=True)

    def sequence(opt, p) -> Callable[[], None]:
        def run() -> None:  # what an unfused offloaded step does, op by op
            g = grad16.float()
            g.div_(LOSS_SCALE)
            norm = torch.linalg.vector_norm(g)
            if not bool(torch.isfinite(norm)):
                return
            coef = MAX_NORM / (float(norm) + 1e-6)
            if coef < 1.0:
                g.mul_(coef)
            p.grad = g
            opt.step()
            copy16.copy_(p.detach())
        return run

    out = {"dslaunch fused": fused, "torch ops": sequence(torch_opt, p_t)}
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        p_d = torch.nn.Parameter(master.clone())
        out["torch ops + DeepSpeedCPUAdam"] = sequence(DeepSpeedCPUAdam([p_d], lr=1e-3, weight_decay=0.01), p_d)
    except Exception:
        pass
    return out


def _streams(numel: int) -> dict[str, Callable[[], None]]:
    """The streaming references (STREAM's copy and triad in torch), timed in the same rounds."""
    import torch

    a, b, c = (torch.randn(numel) for _ in range(3))
    return {"stream copy": lambda: a.copy_(b), "stream triad": lambda: torch.add(b, c, alpha=3.0, out=a)}


def _child(case: str, numel: int, threads: int, rounds: int, steps: int) -> dict:
    import torch

    torch.set_num_threads(threads)
    result: dict = {}
    if case == "offload":
        fns = _offload_contenders(numel)
    else:
        opts = _optimizers(case, numel)
        if "deepspeed_error" in opts:
            result["deepspeed_error"] = opts.pop("deepspeed_error")
        fns = {k: o.step for k, o in opts.items()}
    ms = _median_ms({**fns, **_streams(numel)}, rounds, steps)
    result["stream_gbps"] = {"copy": 8 * numel / ms.pop("stream copy") / 1e6,
                             "triad": 12 * numel / ms.pop("stream triad") / 1e6}
    result["ms"] = ms
    return result


def _run_child(case: str, threads: int, args: argparse.Namespace) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "DS_ACCELERATOR": "cpu"}
    cmd = [sys.executable, __file__, "--child", case, "--threads", str(threads), "--numel", str(args.numel),
           "--rounds", str(args.rounds), "--steps", str(args.steps)]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
    if out.returncode != 0 or not lines:
        return {"error": (out.stderr.strip().splitlines() or ["?"])[-1][:160]}
    return json.loads(lines[-1])


def _uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def _table(res: dict) -> str:
    numel = res["numel"]
    rows = ["| case | threads | dslaunch ms | torch ms | DeepSpeed ms | torch / dslaunch | DeepSpeed / dslaunch "
            "| achieved GB/s | streaming GB/s | % of streaming |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for key, r in res["results"].items():
        case, threads = key.rsplit("@", 1)
        if "error" in r:
            rows.append(f"| {case} | {threads} | {r['error']} | | | | | | | |")
            continue
        ms = r["ms"]
        ours = ms.get("dslaunch", ms.get("dslaunch fused"))
        torch_ms = ms.get("torch", ms.get("torch ops"))
        ds = ms.get("deepspeed", ms.get("torch ops + DeepSpeedCPUAdam"))
        per_elem = BYTES_PER_ELEMENT[case]
        stream = max(r["stream_gbps"].values())
        got = per_elem * numel / ours / 1e6
        ds_cell = f"{ds:.1f}" if ds is not None else r.get("deepspeed_error", "n/a")
        rows.append(f"| {case} | {threads} | {ours:.1f} | {torch_ms:.1f} | {ds_cell} | {torch_ms / ours:.2f}x | "
                    f"{(f'{ds / ours:.2f}x' if ds else '')} | {got:.1f} | {stream:.1f} | {100 * got / stream:.0f}% |")
    return "\n".join([
        "## CPU kernels (`scripts/bench/cpu_kernels_bench.py`)", "",
        f"One flat fp32 partition of {numel / 1e6:g}M elements; per (case, threads) one process in which "
        f"the contenders take turns ({res['rounds']} rounds of {res['steps']} steps, median). dslaunch = "
        "`dslaunch.ops` (the C kernels); torch = `AdamW`/`Adam`/`Adagrad(fused=True)`, for Lion dslaunch's "
        "torch reference (torch has no Lion); DeepSpeed = its CPU ops (DS_ACCELERATOR=cpu). `offload` = "
        f"the whole offloaded step on bf16 gradients (unscale by {LOSS_SCALE:.0f}, overflow check, global norm, "
        "clip, AdamW, bf16 copy): dslaunch's two-pass kernel vs the same sequence in torch ops with torch's "
        "fused AdamW, and with DeepSpeedCPUAdam. Bytes: Adam 28 B/element, Adagrad and Lion 20, offload 30 (see the "
        "script's docstring); streaming = best of torch copy/triad, timed in the same rounds as the contenders. Ratios > 1: dslaunch "
        "is faster.", "",
        f"Load: before `{res['uptime_before']}`; after `{res['uptime_after']}` (2 shared cores).", "",
        *rows, ""])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=int, default=8_000_000)
    parser.add_argument("--rounds", type=int, default=11)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--threads", type=int, default=1, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(_child(args.child, args.numel, args.threads, args.rounds, args.steps)))
        return
    res = {"numel": args.numel, "rounds": args.rounds, "steps": args.steps, "uptime_before": _uptime(),
           "results": {}}
    for case in [*CASES, "offload"]:
        for threads in THREADS:
            res["results"][f"{case}@{threads}"] = r = _run_child(case, threads, args)
            print(case, threads, r.get("ms", r.get("error")), flush=True)
    res["uptime_after"] = _uptime()
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "cpu_kernels_bench.json").write_text(json.dumps(res, indent=2))
    table = _table(res)
    (RESULTS / "cpu_kernels_bench.md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
