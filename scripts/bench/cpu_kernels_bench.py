"""dslaunch's C kernels on CPU: (a) each optimizer against torch's fastest equivalent and
DeepSpeed's CPU op, (b) the fused offloaded steps (Adam, Adagrad, Lion) against the same sequence
in torch ops (and with DeepSpeed's CPU optimizer in it), (c) achieved memory bandwidth against a
streaming kernel that moves exactly the same bytes.

One flat fp32 partition of ``--numel`` elements. Each (case, threads) runs in its own process
(``OMP_NUM_THREADS`` and ``torch.set_num_threads`` = 1 or 2) in which the contenders take turns:
``--rounds`` rounds, each timing ``--steps`` steps of every contender, the order rotated every
round, so load drifts hit them alike; they share one parameter, gradient and state memory (a
kernel's speed on this VM depends on the allocation it runs on). Ratios are paired per round (a
contender's time over dslaunch's in the same round) and reported as the median with the
quartiles, so a tie shows as a tie. DeepSpeed's ops must already be JIT-built (minutes each;
``make bench`` or a first ``DeepSpeedCPUAdam(...)`` does it) or its column says so.

Bandwidth (c): the reference is ``dsl_stream`` in the same library (same OpenMP frame, threads
and blocks) over tensors of the same sizes, reading and writing in place exactly what the kernel
does, with one add per tensor instead of the optimizer's arithmetic. Bytes counted (no
write-allocate traffic: every written line was read first): Adam reads param, grad, exp_avg,
exp_avg_sq and writes param, exp_avg, exp_avg_sq, 28 B/element; Adagrad and Lion read param,
grad and one state and write param and the state, 20 B/element. The offloaded steps with bf16
gradients and a bf16 copy: pass 1 reads the gradient (2 B; its reference ``dsl_stream_read``),
pass 2 reads it again (2 B), the fp32 param and states and writes them and the copy (2 B): Adam
30 B/element, Adagrad and Lion 22. "% of stream" = stream time / kernel time, paired per round.

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
# case -> (hyperparameters, DeepSpeed class, bytes per element)
CASES = {
    "AdamW": ({"lr": 1e-3, "weight_decay": 0.01}, "deepspeed.ops.adam:DeepSpeedCPUAdam", 28),
    "Adam (L2)": ({"lr": 1e-3, "weight_decay": 0.01}, "deepspeed.ops.adam:DeepSpeedCPUAdam", 28),
    "Adagrad": ({"lr": 1e-2, "weight_decay": 0.01}, "deepspeed.ops.adagrad:DeepSpeedCPUAdagrad", 20),
    "Lion": ({"lr": 1e-4, "weight_decay": 0.01}, "deepspeed.ops.lion:DeepSpeedCPULion", 20),
}
# The same elements as a model's parameters rather than one flat partition: case -> (case, tensors).
MANY = {"AdamW, 1000 tensors": ("AdamW", 1000)}
OFFLOAD = {"offload AdamW": ("AdamW", 30), "offload Adagrad": ("Adagrad", 22), "offload Lion": ("Lion", 22)}
LOSS_SCALE, MAX_NORM = 1024.0, 1.0
Fns = dict[str, Callable[[], None]]


def _rounds(fns: Fns, rounds: int, steps: int) -> dict[str, list[float]]:
    """Per contender, ms per step in each round; the order rotates so no one always goes first."""
    for fn in fns.values():
        fn()
    names = list(fns)
    times: dict[str, list[float]] = {k: [] for k in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            t0 = time.perf_counter()
            for _ in range(steps):
                fns[name]()
            times[name].append((time.perf_counter() - t0) / steps * 1e3)
    return times


def _tensors(numel: int, seed: int, n: int):
    import torch

    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(numel, generator=gen) for _ in range(n)]


def _deepspeed(case: str, params: list, **kw):
    import importlib

    module, name = CASES[case][1].split(":")
    return getattr(importlib.import_module(module), name)(params, **kw)


def _torch_update(case: str, params: list, states: list | None = None, **kw) -> Callable[[], None]:
    """torch's fastest equivalent of one step of ``case`` on ``params`` (whose ``grad`` is set),
    on these moment ``states`` (per moment, one tensor per parameter) if given."""
    import torch

    if case == "Lion":  # torch has no Lion: dslaunch's reference, torch _foreach ops (not the Lion
        from dslaunch.kernels.reference import lion_update  # class: it dispatches to the C kernel)

        ms = states[0] if states else [torch.zeros_like(p) for p in params]
        return lambda: lion_update([p.data for p in params], [p.grad for p in params], ms, lr=kw["lr"],
                                   betas=(0.9, 0.999), weight_decay=kw["weight_decay"], inv_scale=None)
    cls = {"AdamW": torch.optim.AdamW, "Adam (L2)": torch.optim.Adam, "Adagrad": torch.optim.Adagrad}[case]
    opt = cls(params, fused=True, **kw)
    return (_sharing(opt, params, states) if states else opt).step


# Each optimizer's moment tensors, by the names the four implementations give them, in order.
MOMENTS = ("exp_avg", "exp_avg_sq", "sum")


def _sharing(opt, params: list, states: list):
    """``opt`` after one step, its moment tensors replaced by ``states`` (per moment, one tensor
    per parameter; the first len(states) of MOMENTS it has): every contender then streams over
    the same memory."""
    opt.step()
    for i, p in enumerate(params):
        slots = [k for k in MOMENTS if k in opt.state[p]][:len(states)]
        opt.state[p].update(zip(slots, (s[i] for s in states), strict=True))
    return opt


def _optimizers(case: str, numel: int) -> tuple[Fns, str | None]:
    """The contenders of ``case``, all on one parameter, gradient and state: on this VM one kernel
    runs at different speeds on different allocations of the same size (whole processes of
    rounds came out 0.8x against DeepSpeed, others 1.0x), so contenders on tensors of their own
    would compare allocations as much as kernels. A MANY case splits them into equal parameters."""
    import torch

    from dslaunch.kernels.cpu import ops
    from dslaunch.ops.adagrad import DeepSpeedCPUAdagrad
    from dslaunch.ops.adam import DeepSpeedCPUAdam
    from dslaunch.ops.lion import DeepSpeedCPULion

    case, parts = MANY.get(case, (case, 1))
    kw = CASES[case][0]
    l2 = {"adamw_mode": False} if case == "Adam (L2)" else {}
    flat, grad = _tensors(numel, 0, 1)[0], _tensors(numel, 1, 1)[0]
    params = [torch.nn.Parameter(x) for x in flat.chunk(parts)]  # views: the flat memory is theirs
    for p, g in zip(params, grad.chunk(parts), strict=True):
        p.grad = g
    # Second moments start positive (as after a first step), so no contender ever takes a sqrt of
    # a negative number whatever order they run in.
    flats = [t.abs() if i or case == "Adagrad" else t for i, t in
             enumerate(_tensors(numel, 2, 2 if "Adam" in case else 1))]
    states = [list(t.chunk(parts)) for t in flats]
    # The stream adds zeros: the same traffic, the values left as the optimizers need them. It
    # runs over the flat tensors: the bound of a MANY case is the flat one.
    zeros = torch.zeros(numel)
    ours = {"Adagrad": DeepSpeedCPUAdagrad, "Lion": DeepSpeedCPULion}.get(case, DeepSpeedCPUAdam)
    fns: Fns = {"dslaunch": _sharing(ours(params, **kw, **l2), params, states).step,
                "torch": _torch_update(case, params, states, **kw),
                "stream": lambda: ops.stream(flat, zeros, flats)}
    try:
        fns["deepspeed"] = _sharing(_deepspeed(case, params, **kw, **l2), params, states).step
    except Exception as exc:  # not built, or not installed: report it, measure the rest
        return fns, f"{type(exc).__name__}: {str(exc)[:80]}"
    return fns, None


def _offload(case: str, numel: int) -> tuple[Fns, str | None]:
    """The contenders of an offloaded step, on one master, state and 16-bit copy (as above)."""
    import torch

    from dslaunch.kernels.cpu import offload, ops

    opt = OFFLOAD[case][0]
    kw = CASES[opt][0]
    grad16 = (_tensors(numel, 1, 1)[0] * LOSS_SCALE * 1e-3).to(torch.bfloat16)
    p = torch.nn.Parameter(_tensors(numel, 0, 1)[0])
    p.grad = grad16.float()  # for the optimizers' first step (_sharing)
    states = [torch.zeros(numel) for _ in range(2 if opt == "AdamW" else 1)]
    copy16 = torch.empty(numel, dtype=torch.bfloat16)
    step = [0]
    fused_step = {"AdamW": offload.offload_adam_step, "Adagrad": offload.offload_adagrad_step,
                  "Lion": offload.offload_lion_step}[opt]

    def fused() -> None:
        step[0] += 1
        extra = {"step": step[0]} if opt == "AdamW" else {}
        fused_step([p.data], [grad16], *[[s] for s in states], **kw, **extra, loss_scale=LOSS_SCALE,
                   max_grad_norm=MAX_NORM, copies=[copy16])

    def sequence(update: Callable[[], None]) -> Callable[[], None]:
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
            update()
            copy16.copy_(p.detach())
        return run

    zeros16 = torch.zeros(numel, dtype=torch.bfloat16)  # the stream adds zeros, as above
    fns: Fns = {"dslaunch": fused, "torch": sequence(_torch_update(opt, [p], [[s] for s in states], **kw)),
                "stream": lambda: (ops.stream_read(zeros16), ops.stream(p.data, zeros16, states, out=copy16))}
    try:
        fns["deepspeed"] = sequence(_sharing(_deepspeed(opt, [p], **kw), [p], [[s] for s in states]).step)
    except Exception as exc:
        return fns, f"{type(exc).__name__}: {str(exc)[:80]}"
    return fns, None


def _child(case: str, numel: int, threads: int, rounds: int, steps: int) -> dict:
    import torch

    torch.set_num_threads(threads)
    fns, ds_error = (_offload if case in OFFLOAD else _optimizers)(case, numel)
    return {"ms": _rounds(fns, rounds, steps), "deepspeed_error": ds_error}


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


def _spread(values: list[float], fmt: str) -> str:
    """median (first quartile-third quartile)."""
    q1, _, q3 = statistics.quantiles(values, n=4) if len(values) > 1 else values * 3
    return f"{fmt.format(statistics.median(values))} ({fmt.format(q1)}-{fmt.format(q3)})"


def _paired(num: list[float], den: list[float]) -> list[float]:
    return [a / b for a, b in zip(num, den, strict=True)]


def _row(case: str, threads: str, r: dict, numel: int) -> str:
    if "error" in r:
        return f"| {case} | {threads} | {r['error']} |" + " |" * 7
    ms = r["ms"]
    ours, stream = ms["dslaunch"], ms["stream"]
    per_elem = CASES[MANY.get(case, (case,))[0]][2] if case not in OFFLOAD else OFFLOAD[case][1]
    stream_gbps = per_elem * numel / statistics.median(stream) / 1e6
    ds = ms.get("deepspeed")
    torch_pct = "" if case in OFFLOAD else _spread([100 * x for x in _paired(stream, ms["torch"])], "{:.0f}%")
    return " | ".join([
        f"| {case}", threads, _spread(ours, "{:.1f}"), _spread(ms["torch"], "{:.1f}"),
        _spread(ds, "{:.1f}") if ds else (r.get("deepspeed_error") or "n/a"),
        _spread(_paired(ms["torch"], ours), "{:.2f}x"), _spread(_paired(ds, ours), "{:.2f}x") if ds else "",
        f"{stream_gbps:.1f}", _spread([100 * x for x in _paired(stream, ours)], "{:.0f}%"), f"{torch_pct} |"])


def _table(res: dict) -> str:
    numel = res["numel"]
    rows = ["| case | threads | dslaunch ms | torch ms | DeepSpeed ms | torch / dslaunch | DeepSpeed / dslaunch "
            "| stream GB/s | dslaunch % of stream | torch % of stream |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    rows += [_row(*key.rsplit("@", 1), r, numel) for key, r in res["results"].items()]
    return "\n".join([
        "## CPU kernels (`scripts/bench/cpu_kernels_bench.py`)", "",
        f"One flat fp32 partition of {numel / 1e6:g}M elements; per (case, threads) one process in which "
        f"the contenders take turns ({res['rounds']} rounds of {res['steps']} steps, order rotated each round). "
        "Cells: median (quartiles) over the rounds; ratios and % are paired per round. dslaunch = "
        "`dslaunch.ops` (the C kernels), all contenders of a case on the same parameter, gradient and "
        "state memory (on this VM a kernel's speed depends on the allocation it runs on); torch = "
        "`AdamW`/`Adam`/`Adagrad(fused=True)`, for Lion dslaunch's reference in torch `_foreach` ops "
        "(torch has no Lion); DeepSpeed = its CPU ops (DS_ACCELERATOR=cpu). "
        "`offload X` = the whole offloaded step on bf16 gradients (unscale by "
        f"{LOSS_SCALE:.0f}, overflow check, global norm, clip, update, bf16 copy): dslaunch's two-pass kernel vs "
        "the same sequence in torch ops with torch's optimizer (DeepSpeed column: with DeepSpeed's CPU optimizer). "
        "stream = `dsl_stream` in the same library and threads, moving exactly the kernel's bytes with one add "
        "per tensor: Adam 28 B/element (read p, g, m, v; write p, m, v), Adagrad and Lion 20 (read p, g, s; "
        "write p, s), offload AdamW 30 and offload Adagrad/Lion 22 (bf16 g read in both passes, bf16 copy "
        "written; no write-allocate counted: every written line was read). `AdamW, 1000 tensors`: the same "
        "elements as 1000 parameters of one optimizer (the per-tensor cost; its stream is the flat one). "
        "Ratios > 1: dslaunch is faster.", "",
        f"Load: before `{res['uptime_before']}`; after `{res['uptime_after']}` (2 shared cores).", "",
        *rows, ""])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=int, default=8_000_000)
    parser.add_argument("--rounds", type=int, default=21)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--cases", nargs="*", default=[*CASES, *MANY, *OFFLOAD], help="subset of the cases")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--threads", type=int, default=1, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(_child(args.child, args.numel, args.threads, args.rounds, args.steps)))
        return
    res = {"numel": args.numel, "rounds": args.rounds, "steps": args.steps, "uptime_before": _uptime(),
           "results": {}}
    for case in args.cases:
        for threads in THREADS:
            res["results"][f"{case}@{threads}"] = r = _run_child(case, threads, args)
            print(_row(case, str(threads), r, args.numel), flush=True)
    res["uptime_after"] = _uptime()
    table = _table(res)
    print(table)
    if args.cases != [*CASES, *MANY, *OFFLOAD]:
        return  # a partial run does not overwrite the results
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "cpu_kernels_bench.json").write_text(json.dumps(res, indent=2))
    (RESULTS / "cpu_kernels_bench.md").write_text(table)


if __name__ == "__main__":
    main()
