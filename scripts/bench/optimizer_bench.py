"""Optimizer step time on CPU: dslaunch's optimizers vs DeepSpeed's CPU implementations.

One flat fp32 tensor of 20M elements (the layout of a ZeRO master shard) with a random
gradient; one thread (OMP_NUM_THREADS=1). For each ``optimizer.type`` the same config is built
by ``dslaunch.runtime.optim.registry.build_optimizer`` and by the DeepSpeed op that DeepSpeed uses on
CPU (``FusedAdam``'s CPU build, ``DeepSpeedCPUAdam``/``CPULion``/``CPUAdagrad``, the ops ZeRO
offload uses), plus torch's default (foreach) AdamW as a reference point. Each optimizer type
runs in its own process, where the contenders take turns (5 steps each, 9 rounds, after 2
warm-up steps) so that load drifts hit them alike; the median round counts. DeepSpeed's ops are
JIT-compiled on first use (minutes per op): a peer is used only when already compiled, unless
``--build-peers`` (a killed build would leave a lock that blocks later runs, so none is built
under a time limit). Writes ``results/optimizer_bench.json`` and ``results/optimizer_bench.md``. Timings on
a shared 2-core machine are noisy: compare ratios.

One more case calls the classes as a user does (`dslaunch.ops.adam.DeepSpeedCPUAdam` against
DeepSpeed's and against `torch.optim.AdamW(fused=True)`), and each ratio comes with the quartiles of
its paired per-round ratios, and the parameters' largest difference from DeepSpeed's after the run.
Run it with a Python that has both dslaunch and DeepSpeed (e.g. a DeepSpeed venv with dslaunch
installed editable from the tree under test); ``--case NAME`` runs one case and prints its ratios.

Usage: ``python scripts/bench/optimizer_bench.py [--numel 20000000] [--build-peers] [--case NAME]``.
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

RESULTS = Path(__file__).resolve().parent / "results"

# optimizer.type -> (ds_config params, the DeepSpeed class used for it on CPU)
CASES = {
    "AdamW": ({"lr": 1e-3, "weight_decay": 0.01}, "deepspeed.ops.adam:FusedAdam"),
    "Adam (L2, adam_w_mode=false)": ({"lr": 1e-3, "weight_decay": 0.01, "adam_w_mode": False},
                                     "deepspeed.ops.adam:DeepSpeedCPUAdam"),
    "Lion": ({"lr": 1e-4, "weight_decay": 0.01}, "deepspeed.ops.lion:DeepSpeedCPULion"),
    "Adagrad": ({"lr": 1e-2}, "deepspeed.ops.adagrad:DeepSpeedCPUAdagrad"),
    "Lamb": ({"lr": 1e-3, "weight_decay": 0.01}, None),  # DeepSpeed's FusedLamb is CUDA-only
    # DeepSpeed's class as a user constructs it, rather than through the ds_config.
    "AdamW (DeepSpeedCPUAdam class)": ({"lr": 1e-3, "weight_decay": 0.01}, "deepspeed.ops.adam:DeepSpeedCPUAdam"),
}
# Cases where dslaunch's contender is a class called directly (its DeepSpeed path), not the registry.
OUR_CLASS = {"AdamW (DeepSpeedCPUAdam class)": "dslaunch.ops.adam:DeepSpeedCPUAdam"}
# The JIT-built extension behind each DeepSpeed class (torch's extension cache).
PEER_OPS = {"FusedAdam": "fused_adam", "DeepSpeedCPUAdam": "cpu_adam", "DeepSpeedCPULion": "cpu_lion",
            "DeepSpeedCPUAdagrad": "cpu_adagrad"}


def _peer_built(case: str) -> bool:
    """Whether the DeepSpeed op is already compiled (a first build takes minutes per op)."""
    from torch.utils.cpp_extension import get_default_build_root

    op = PEER_OPS[CASES[case][1].split(":")[1]]
    return any(Path(get_default_build_root()).glob(f"*/{op}/{op}.so"))
TORCH_REFERENCE = "torch AdamW (foreach)"
TORCH_FUSED = "torch AdamW (fused=True)"


def _type_of(case: str) -> str:
    return case.split(" ")[0]


def _build(contender: str, case: str, param):
    import importlib

    import torch

    params = dict(CASES[case][0])
    if contender == "dslaunch" and case not in OUR_CLASS:
        from dslaunch.runtime.optim.registry import build_optimizer, validate_optimizer

        return build_optimizer(validate_optimizer(_type_of(case), params), [param])
    if contender == "torch":
        return torch.optim.AdamW([param], foreach=True, **params)
    if contender == "torch-fused":
        return torch.optim.AdamW([param], fused=True, **params)
    module, name = (OUR_CLASS[case] if contender == "dslaunch" else CASES[case][1]).split(":")
    cls = getattr(importlib.import_module(module), name)
    if name == "DeepSpeedCPUAdam":
        params["adamw_mode"] = params.pop("adam_w_mode", True)
    return cls([param], **params)


def _measure(case: str, numel: int, with_peer: bool, rounds: int = 9, steps: int = 5) -> dict:
    """Runs in a child process: ms per step of each contender (median of interleaved rounds)."""
    import torch

    torch.set_num_threads(1)
    contenders = ["dslaunch"] + (["deepspeed"] if with_peer and CASES[case][1] else [])
    contenders += ["torch"] if case == "AdamW" else ["torch-fused"] if case in OUR_CLASS else []
    results: dict = {}
    optimizers, params = {}, {}
    for name in contenders:
        param = params[name] = torch.zeros(numel, requires_grad=True)
        param.grad = torch.randn(numel, generator=torch.Generator().manual_seed(0))
        try:
            optimizers[name] = _build(name, case, param)
        except Exception as exc:  # a peer that does not build here: report, keep measuring ours
            results[name] = {"error": f"{type(exc).__name__}: {str(exc)[:100]}"}
    for opt in optimizers.values():
        for _ in range(2):
            opt.step()
    times: dict[str, list[float]] = {name: [] for name in optimizers}
    for _ in range(rounds):
        for name, opt in optimizers.items():
            t0 = time.perf_counter()
            for _ in range(steps):
                opt.step()
            times[name].append((time.perf_counter() - t0) / steps * 1e3)
    for name, opt in optimizers.items():
        results[name] = {"ms": statistics.median(times[name]), "rounds_ms": times[name],
                         "impl": type(opt).__module__ + "." + type(opt).__name__}
    if "deepspeed" in optimizers:  # every contender took the same steps from the same start
        diff = (params["dslaunch"] - params["deepspeed"]).abs().max().item()
        results["dslaunch"]["max_abs_diff_vs_deepspeed"] = diff
    return results


def _ratios(case: str, res: dict) -> str:
    """One line: each peer's time over dslaunch's (paired rounds) and the parameters' difference."""
    ours = res["dslaunch"]
    parts = [f"{name} / dslaunch {_paired(peer, ours)}" for name, peer in res.items()
             if name != "dslaunch" and "ms" in peer and "ms" in ours]
    if "max_abs_diff_vs_deepspeed" in ours:
        parts.append(f"max |dslaunch - deepspeed| {ours['max_abs_diff_vs_deepspeed']:.1e}")
    return f"{case}: " + ", ".join(parts)


def _in_child(case: str, args: argparse.Namespace) -> dict:
    peer = CASES[case][1] is not None and (args.build_peers or _peer_built(case))
    cmd = [sys.executable, __file__, "--child", case, "--numel", str(args.numel)]
    cmd += [] if peer else ["--no-peer"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run(cmd, env=env, capture_output=True, text=True)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
    if out.returncode != 0 or not lines:
        tail = (out.stderr.strip().splitlines() or ["?"])[-1][:120]
        return {"dslaunch": {"error": f"failed: {tail}"}}
    result = json.loads(lines[-1])
    if CASES[case][1] is not None and not peer:
        result["deepspeed"] = {"error": "op not compiled (rerun with --build-peers)"}
    return result


def _paired(peer: dict, ours: dict) -> str:
    """Quartiles of the per-round ratios peer/ours (rounds are interleaved, so a load change hits
    both sides of a pair alike): the spread says whether a ratio is a tie."""
    ratios = [a / b for a, b in zip(peer["rounds_ms"], ours["rounds_ms"], strict=True)]
    q1, q2, q3 = statistics.quantiles(ratios, n=4)
    return f"{q2:.2f}x ({q1:.2f}-{q3:.2f})"


def _table(results: dict, numel: int) -> str:
    rows = ["| optimizer.type | dslaunch ms/step | DeepSpeed ms/step | DeepSpeed / dslaunch (paired rounds: "
            "median, quartiles) | implementations |",
            "| --- | ---: | ---: | ---: | --- |"]
    for case, res in results.items():
        ours, peer = res.get("dslaunch", {"error": "n/a"}), res.get("deepspeed")
        ours_ms = f"{ours['ms']:.1f}" if "ms" in ours else ours.get("error", "n/a")
        if peer is None:
            peer_ms, ratio, peer_impl = "n/a (CUDA-only)", "", "-"
        elif "ms" in peer:
            peer_ms, peer_impl = f"{peer['ms']:.1f}", peer["impl"]
            ratio = _paired(peer, ours) if "ms" in ours else ""
        else:
            peer_ms, ratio, peer_impl = peer["error"], "", "-"
        rows.append(f"| {case} | {ours_ms} | {peer_ms} | {ratio} | {ours.get('impl', '-')} vs {peer_impl} |")
    torch_ref = results["AdamW"].get("torch", {})
    ref = f"{torch_ref['ms']:.1f} ms/step" if "ms" in torch_ref else torch_ref.get("error", "n/a")
    fused_lines = [f"{TORCH_FUSED} against `{OUR_CLASS[case].replace(':', '.')}` in the same rounds: "
                   f"{res['torch-fused']['ms']:.1f} ms/step, torch / dslaunch {_paired(res['torch-fused'], res['dslaunch'])}."
                   for case, res in results.items() if "ms" in res.get("torch-fused", {}) and "ms" in res["dslaunch"]]
    fused_lines += [f"{case}: after the run's identical steps, max |dslaunch - DeepSpeed| of the parameters "
                    f"{res['dslaunch']['max_abs_diff_vs_deepspeed']:.1e}."
                    for case, res in results.items() if "max_abs_diff_vs_deepspeed" in res["dslaunch"]]
    return "\n".join([
        "## Optimizer step on CPU (`scripts/bench/optimizer_bench.py`)", "",
        f"One flat fp32 tensor of {numel / 1e6:.0f}M elements, 1 thread; per type one process in which "
        "the contenders take turns (9 rounds of 5 steps, median round). Shared 2-core machine: "
        "timings are noisy, compare ratios.", "", *rows, "",
        f"Reference: {TORCH_REFERENCE}: {ref}. Ratios > 1 mean dslaunch is faster.", "", *fused_lines,
        f"Load average {os.getloadavg()[0]:.1f} when the table was written.", ""])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=int, default=20_000_000)
    parser.add_argument("--build-peers", action="store_true",
                        help="JIT-compile DeepSpeed's CPU ops that are missing (minutes each)")
    parser.add_argument("--case", action="append", choices=list(CASES), metavar="CASE",
                        help="run only this case (repeatable); the results files are written only by a "
                             f"run of all cases. Cases: {', '.join(CASES)}")
    parser.add_argument("--child", metavar="CASE", help=argparse.SUPPRESS)
    parser.add_argument("--no-peer", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(_measure(args.child, args.numel, with_peer=not args.no_peer)))
        return
    results: dict = {}
    for case in args.case or CASES:
        results[case] = _in_child(case, args)
        print(case, {k: v.get("ms", v.get("error")) for k, v in results[case].items()}, flush=True)
    if args.case:
        for case, res in results.items():
            print(_ratios(case, res), f"load average {os.getloadavg()[0]:.1f}")
        return
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "optimizer_bench.json").write_text(json.dumps({"numel": args.numel, "results": results}, indent=2))
    table = _table(results, args.numel)
    (RESULTS / "optimizer_bench.md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
