"""Where the Triton norms' time goes on a GPU: kernel time (profiler) against time per call.

For LayerNorm/RMSNorm at a few widths, forward and forward + backward, eager torch and dslaunch:
``call_us`` is the wall time per call of 200 back-to-back calls (what gpu_kernels_bench sees),
``cpu_us`` the time to enqueue one call (no sync), ``gpu_us`` the device time of the kernels one
call runs (torch.profiler). ``call_us`` near ``cpu_us`` and far above ``gpu_us``: launch-bound.
The backward is also run with other numbers of weight-gradient programs (``_GROUPS``).
Writes JSON to the path given (stdout too).
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

CALLS = 200


def _per_call(fn: Callable[[], object]) -> dict[str, float]:
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(CALLS):
        fn()
    cpu = (time.perf_counter() - t0) / CALLS * 1e6
    torch.cuda.synchronize()
    call = (time.perf_counter() - t0) / CALLS * 1e6
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
    gpu = sum(e.device_time_total for e in prof.key_averages()) / 20
    kernels = sorted(((e.key[:60], round(e.device_time_total / 20, 1)) for e in prof.key_averages()
                      if e.device_time_total), key=lambda k: -k[1])[:4]
    return {"call_us": round(call, 1), "cpu_us": round(cpu, 1), "gpu_us": round(gpu, 1), "kernels": kernels}


def _width(n: int, rows: int = 16384) -> dict[str, dict]:
    from dslaunch.kernels.triton import norms
    from dslaunch.ops.normalization import layer_norm, rms_norm

    x = torch.randn(rows, n, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(n, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    b = torch.randn(n, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn_like(x)
    cases = {"LN eager": (lambda: F.layer_norm(x, (n,), w, b, 1e-5), [x, w, b]),
             "LN ours": (lambda: layer_norm(x, w, b, 1e-5), [x, w, b]),
             "RMS eager": (lambda: F.rms_norm(x, (n,), w, 1e-6), [x, w]),
             "RMS ours": (lambda: rms_norm(x, w, 1e-6), [x, w])}
    out = {}
    for name, (fn, inputs) in cases.items():
        with torch.no_grad():
            out[f"{name} fwd {n}"] = _per_call(fn)
        out[f"{name} fwd+bwd {n}"] = _per_call(lambda fn=fn, i=inputs: torch.autograd.grad(fn(), i, dy))
    default = norms._GROUPS
    for groups in (128, 512, 1024, 2048):
        norms._GROUPS = groups
        out[f"LN ours fwd+bwd {n} groups={groups}"] = _per_call(
            lambda: torch.autograd.grad(layer_norm(x, w, b, 1e-5), [x, w, b], dy))
    norms._GROUPS = default
    return out


def main() -> None:
    out = {}
    for n in (1024, 4096, 8192):
        out.update(found := _width(n))
        print(json.dumps(found), flush=True)
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
