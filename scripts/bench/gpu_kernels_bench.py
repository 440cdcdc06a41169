"""dslaunch's Triton kernels on one CUDA GPU against the peers, in one run.

(a) ``dslaunch.ops.adam.FusedAdam`` (the multi-tensor Triton kernel) against
``torch.optim.AdamW(fused=True)``, ``AdamW(foreach=True)`` and DeepSpeed's ``FusedAdam`` (its CUDA
op is JIT-built on first use: minutes, and it needs nvcc; its column says why when it fails), on
fp32 parameters shaped like a transformer's (``--adam-numel`` elements over many tensors). Bytes
counted: read param, grad, exp_avg, exp_avg_sq, write param, exp_avg, exp_avg_sq: 28 B/element;
a streaming ``copy_`` (8 B/element) is timed in the same rounds for reference.
(b) LayerNorm and RMSNorm, forward and forward + backward, and (c) bias + GeLU (+ dropout),
forward + backward, in bf16: ``dslaunch.ops.normalization``/``dslaunch.ops.bias_gelu`` (Triton on
CUDA) against torch eager and ``torch.compile`` of the same torch code. Each case also records the
forward's largest difference from eager.

The contenders of a case take turns (``--rounds`` rounds of ``--steps`` calls after a warm-up that
includes torch.compile's compilation), timed with ``torch.cuda.synchronize`` around each round;
the median round counts. Writes ``results/gpu_kernels_bench.json`` and ``.md`` (with the GPU's
name). Without a CUDA device it says so and exits 0 without writing (``run_all`` runs every bench).
``--cpu-smoke`` runs tiny sizes on CPU through the reference kernels, without compile or DeepSpeed,
to check the script itself; it writes nothing.

Usage: ``flock /tmp/dslaunch-bench.lock python scripts/bench/gpu_kernels_bench.py``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

RESULTS = Path(__file__).resolve().parent / "results"
ADAM_BYTES = 28
Fn = Callable[[], Any]


def _median_ms(fns: dict[str, Fn], device: torch.device, rounds: int, steps: int) -> dict[str, float]:
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for fn in fns.values():  # warm-up: compilation, autotuning, the allocator's first blocks
        fn()
        fn()
    sync()
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            for _ in range(steps):
                fn()
            sync()
            times[name].append((time.perf_counter() - t0) / steps * 1e3)
    return {k: statistics.median(v) for k, v in times.items()}


def _model_shapes(numel: int, hidden: int) -> list[tuple[int, ...]]:
    """Transformer-like tensors (qkv, proj, mlp in/out, their biases, norms) adding up to ~numel."""
    layer = [(3 * hidden, hidden), (3 * hidden,), (hidden, hidden), (hidden,), (4 * hidden, hidden),
             (4 * hidden,), (hidden, 4 * hidden), (hidden,), (hidden,), (hidden,)]
    shapes: list[tuple[int, ...]] = []
    while sum(torch.Size(s).numel() for s in shapes) < numel:
        shapes += layer
    return shapes


def _adam(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    from dslaunch import kernels
    from dslaunch.ops.adam import FusedAdam

    shapes = _model_shapes(args.adam_numel, args.adam_hidden)
    numel = sum(torch.Size(s).numel() for s in shapes)
    g = torch.Generator(device=device).manual_seed(0)

    def params() -> list[torch.nn.Parameter]:
        ps = [torch.nn.Parameter(torch.randn(s, device=device, generator=g)) for s in shapes]
        for p in ps:
            p.grad = torch.randn(p.shape, device=device, generator=g) * 1e-2
        return ps

    hyper = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01}
    contenders: dict[str, Fn] = {"dslaunch FusedAdam": FusedAdam(params(), **hyper).step}
    if device.type == "cuda":
        contenders["torch AdamW fused"] = torch.optim.AdamW(params(), fused=True, **hyper).step
    contenders["torch AdamW foreach"] = torch.optim.AdamW(params(), foreach=True, **hyper).step
    errors = {}
    if not args.cpu_smoke:
        try:
            import deepspeed
            from deepspeed.ops.adam import FusedAdam as DeepSpeedFusedAdam

            # check.sh installs dslaunch's own `deepspeed` distribution (for Lightning) where none is
            if "dslaunch" in deepspeed.__version__:
                raise ModuleNotFoundError(f"the deepspeed here is dslaunch's ({deepspeed.__version__}), no peer")
            contenders["DeepSpeed FusedAdam"] = DeepSpeedFusedAdam(params(), **hyper).step
        except Exception as e:  # not installed, or its CUDA op fails to build here
            errors["DeepSpeed FusedAdam"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
    src, dst = torch.empty(numel, device=device), torch.empty(numel, device=device)
    contenders["streaming copy_"] = lambda: dst.copy_(src)
    ms = _median_ms(contenders, device, args.rounds, args.steps)
    impl = kernels.get("adam", device)
    gbps = {k: (8 if k == "streaming copy_" else ADAM_BYTES) * numel / v / 1e6 for k, v in ms.items()}
    return {"numel": numel, "tensors": len(shapes), "dslaunch_impl": f"{impl.__module__}.{impl.__name__}",
            "ms": ms, "gbps": gbps, "errors": errors}


def _fwd_bwd(fn: Callable[..., torch.Tensor], inputs: list[torch.Tensor], dy: torch.Tensor) -> Fn:
    return lambda: torch.autograd.grad(fn(*inputs), inputs, dy)


def _versus(ours: Callable[..., torch.Tensor], eager: Callable[..., torch.Tensor], inputs: list[torch.Tensor],
            args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    """Forward and forward + backward of ``ours`` against eager and compiled ``eager``."""
    peers = {"dslaunch": ours, "torch eager": eager}
    if not args.cpu_smoke:
        peers["torch.compile"] = torch.compile(eager, dynamic=False)
    with torch.no_grad():
        y = ours(*inputs)
        diff = float((y.float() - eager(*inputs).float()).abs().max()) if y.numel() else 0.0
    dy = torch.randn_like(y)
    forward = {k: (lambda f=f: f(*inputs)) for k, f in peers.items()}
    with torch.no_grad():
        fwd = _median_ms(forward, device, args.rounds, args.steps)
    both = _median_ms({k: _fwd_bwd(f, inputs, dy) for k, f in peers.items()}, device, args.rounds, args.steps)
    return {"forward_ms": fwd, "forward_backward_ms": both, "max_abs_diff_vs_eager": diff}


def _norms(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> dict[str, Any]:
    from dslaunch.ops.normalization import layer_norm, rms_norm

    out = {}
    for n in args.features:
        x = torch.randn(args.rows, n, device=device, dtype=dtype, requires_grad=True)
        w = torch.randn(n, device=device, dtype=dtype, requires_grad=True)
        b = torch.randn(n, device=device, dtype=dtype, requires_grad=True)
        out[f"LayerNorm {args.rows}x{n}"] = _versus(
            lambda x, w, b: layer_norm(x, w, b, 1e-5), lambda x, w, b: F.layer_norm(x, (x.shape[-1],), w, b, 1e-5),
            [x, w, b], args, device)
        out[f"RMSNorm {args.rows}x{n}"] = _versus(
            lambda x, w: rms_norm(x, w, 1e-6), lambda x, w: F.rms_norm(x, (x.shape[-1],), w, 1e-6), [x, w], args, device)
    return out


def _bias_gelu(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> dict[str, Any]:
    from dslaunch.ops.bias_gelu import bias_gelu

    out = {}
    n = 4 * args.hidden
    x = torch.randn(args.rows, n, device=device, dtype=dtype, requires_grad=True)
    b = torch.randn(n, device=device, dtype=dtype, requires_grad=True)
    for approximate, p in (("none", 0.0), ("tanh", 0.0), ("tanh", 0.1)):
        def eager(x, b, approximate=approximate, p=p):
            return F.dropout(F.gelu(x + b, approximate=approximate), p)

        def ours(x, b, approximate=approximate, p=p):
            return bias_gelu(x, b, approximate, p)

        case = _versus(ours, eager, [x, b], args, device)
        if p:  # masks differ between implementations: the difference is not an error
            case["max_abs_diff_vs_eager"] = None
        out[f"bias+GeLU({approximate}) dropout {p} {args.rows}x{n}"] = case
    return out


def _table(res: dict[str, Any]) -> str:
    a = res["adam"]
    ours = a["ms"]["dslaunch FusedAdam"]
    rows = ["| contender | ms/step | GB/s | vs dslaunch |", "| --- | ---: | ---: | ---: |"]
    for k, v in a["ms"].items():
        rows.append(f"| {k} | {v:.2f} | {a['gbps'][k]:.0f} | {v / ours:.2f}x |")
    rows += [f"| {k} | {e} | | |" for k, e in a["errors"].items()]
    ops = ["| case | pass | dslaunch ms | eager ms | compiled ms | eager / dslaunch | compiled / dslaunch | max diff |",
           "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for case, r in res["ops"].items():
        for label, key in (("fwd", "forward_ms"), ("fwd+bwd", "forward_backward_ms")):
            ms = r[key]
            mine, eager, comp = ms["dslaunch"], ms["torch eager"], ms.get("torch.compile")
            diff = r["max_abs_diff_vs_eager"]
            ops.append(f"| {case} | {label} | {mine:.3f} | {eager:.3f} | {f'{comp:.3f}' if comp else 'n/a'} | "
                       f"{eager / mine:.2f}x | {f'{comp / mine:.2f}x' if comp else ''} | "
                       f"{'mask differs' if diff is None else f'{diff:.2g}'} |")
    return "\n".join([
        "## GPU kernels (`scripts/bench/gpu_kernels_bench.py`)", "",
        f"GPU: {res['gpu']}; torch {res['torch']}, triton {res['triton']}, DeepSpeed {res['deepspeed']}. "
        f"Median of {res['rounds']} rounds of {res['steps']} calls, contenders taking turns. Ratios > 1: dslaunch "
        "is faster.", "",
        f"FusedAdam on {a['numel'] / 1e6:.4g}M fp32 parameters in {a['tensors']} tensors (AdamW, 28 B/element; "
        f"dslaunch ran `{a['dslaunch_impl']}`); `streaming copy_` = 8 B/element, for the bandwidth.", "",
        *rows, "", "Norms and bias + GeLU in bf16 (compiled = `torch.compile` of the eager code):", "", *ops, ""])


def _version(module: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(module)
    except PackageNotFoundError:
        return "not installed"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--adam-numel", type=int, default=200_000_000)
    parser.add_argument("--adam-hidden", type=int, default=1024, help="width of the model FusedAdam updates")
    parser.add_argument("--hidden", type=int, default=4096, help="bias + GeLU acts on rows x 4*hidden")
    parser.add_argument("--rows", type=int, default=16384)
    parser.add_argument("--features", type=int, nargs="+", default=[1024, 4096, 8192])
    parser.add_argument("--rounds", type=int, default=11)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny sizes on CPU to check the script; writes nothing")
    args = parser.parse_args()
    if args.cpu_smoke:
        args.adam_numel, args.adam_hidden, args.hidden, args.rows = 5000, 8, 8, 16
        args.features, args.rounds, args.steps = [8, 33], 2, 1
        device, dtype = torch.device("cpu"), torch.float32
    elif not torch.cuda.is_available():
        print("gpu_kernels_bench: no CUDA device here; nothing measured (run it on a GPU machine)")
        return 0
    else:
        device, dtype = torch.device("cuda"), torch.bfloat16
    res = {"gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else "none (CPU smoke run)",
           "torch": torch.__version__, "triton": _version("triton"), "deepspeed": _version("deepspeed"),
           "rounds": args.rounds, "steps": args.steps, "adam": _adam(args, device)}
    res["ops"] = {**_norms(args, device, dtype), **_bias_gelu(args, device, dtype)}
    table = _table(res)
    print(table)
    if not args.cpu_smoke:
        RESULTS.mkdir(exist_ok=True)
        (RESULTS / "gpu_kernels_bench.json").write_text(json.dumps(res, indent=2))
        (RESULTS / "gpu_kernels_bench.md").write_text(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
