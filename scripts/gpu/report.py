"""The bookkeeping of ``scripts/gpu/check.sh``: the machine's description, and the summary.

    report.py --env FILE          the GPU's name, driver, torch/CUDA/triton versions as JSON
    report.py --summarize DIR [--results RESULTS]
                                  DIR/gpu-check.json and gpu-check.md from what check.sh left in DIR
                                  (also RESULTS/gpu_check.json and .md, for BENCHMARKS.md); exit 1
                                  when a step failed or was skipped, or an engine run disagreed with CPU
    report.py --targets DIR       the block BENCHMARKS.md records from a GPU call: the GPU's name,
                                  dslaunch beside DeepSpeed, and each target met / not met

The targets (issue 43), from ``peer_bench.json`` and ``gpu_engine_bench.json`` in DIR:
dslaunch >= 1.1x DeepSpeed's tokens/s in each of ZeRO-2, ZeRO-3, ZeRO-2 + offload, at no more
peak memory; ZeRO-3 at world size 1 >= 0.98x ZeRO-0's tokens/s; the offloaded step <= the CPU
update + 30 ms, i.e. what it spends beyond ZeRO-2's forward + backward and ``DeepSpeedCPUAdam``
alone on as many elements is at most 30 ms. A target whose runs are missing is "not measured".

An engine configuration passes when its CUDA run's losses match the CPU (gloo) run's (relative to
max(1, |loss|)) and the resumed run repeats the losses after the checkpoint exactly (same device,
same data: any difference is state lost in the checkpoint). Two bounds against CPU: the first
``EARLY`` losses tightly, all of them loosely. Adam divides each update by sqrt(v), so a gradient
component that is rounding noise on both devices (first seen on the H200: 1e-7 at step 2) moves
its weight by ~lr either way, and the losses drift apart by 1e-5..1e-4 within 8 steps in fp32.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

# CPU vs CUDA, (first EARLY losses, all losses): fp32 differs by accumulation order only; bf16/fp16
# round the activations on both devices in different orders.
EARLY = 6  # 3 optimizer steps of 2 micro-batches
TOLERANCE = {"fp32": (1e-6, 1e-3), "bf16": (1e-2, 3e-2), "fp16": (5e-3, 1e-2)}
RESUME_TOLERANCE = 1e-6


def _version(name: str) -> str:
    try:
        return version(name)
    except PackageNotFoundError:
        return "not installed"


def environment() -> dict[str, Any]:
    import torch

    env: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__,
                           "cuda": torch.version.cuda, "triton": _version("triton"),
                           "transformers": _version("transformers"), "gpu": None}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        env.update(gpu=props.name, gpu_memory_gib=round(props.total_memory / 2**30, 1),
                   capability=f"{props.major}.{props.minor}", multiprocessors=props.multi_processor_count,
                   nccl=".".join(map(str, torch.cuda.nccl.version())))
        try:
            env["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                           capture_output=True, text=True, timeout=20).stdout.strip()
        except (OSError, subprocess.TimeoutExpired) as err:
            env["driver"] = f"unknown ({err})"
    return env


def _precision(cfg: dict[str, Any]) -> str:
    return "bf16" if cfg.get("bf16", {}).get("enabled") else "fp16" if cfg.get("fp16", {}).get("enabled") else "fp32"


def _rel(a: list[float], b: list[float]) -> float:
    if len(a) != len(b) or not a:
        return float("inf")
    return max(abs(x - y) / max(1.0, abs(y)) for x, y in zip(a, b, strict=True))


def engine_row(cfg_file: Path) -> dict[str, Any]:
    """One configuration's verdict from its ``.gpu.json`` and ``.cpu.json`` results."""
    name = cfg_file.stem
    precision = _precision(json.loads(cfg_file.read_text()))
    row: dict[str, Any] = {"config": name, "precision": precision}
    runs = {}
    for side in ("gpu", "cpu"):
        path = cfg_file.with_name(f"{name}.{side}.json")
        runs[side] = json.loads(path.read_text()) if path.exists() else None
    gpu, cpu = runs["gpu"], runs["cpu"]
    if gpu is None or cpu is None:
        missing = " and ".join(side for side, run in runs.items() if run is None)
        return {**row, "ok": False, "why": f"no result from the {missing} run (see its log)"}
    tail = gpu["losses"][len(gpu["losses"]) - len(gpu["resumed"]):]
    row.update(device=gpu["device"], backend=gpu["backend"], cpu_backend=cpu["backend"],
               early_vs_cpu=_rel(gpu["losses"][:EARLY], cpu["losses"][:EARLY]),
               vs_cpu=_rel(gpu["losses"], cpu["losses"]), resume=_rel(gpu["resumed"], tail),
               peak_mib=gpu.get("peak_mib"), final_loss=gpu["losses"][-1])
    problems = []
    early, every = TOLERANCE[precision]
    if row["early_vs_cpu"] > early:
        problems.append(f"the first {EARLY} losses differ from CPU by {row['early_vs_cpu']:.3g} (> {early:g})")
    if row["vs_cpu"] > every:
        problems.append(f"losses differ from CPU by {row['vs_cpu']:.3g} (> {every:g})")
    if row["resume"] > RESUME_TOLERANCE:
        problems.append(f"resumed losses differ by {row['resume']:.3g}")
    return {**row, "ok": not problems, "why": "; ".join(problems)}


def _status(step: dict[str, Any]) -> str:
    rc = step["rc"]
    if rc is None:
        return f"skipped ({step.get('skipped', 'no time left')})"
    return "ok" if rc == 0 else "timed out" if rc in (124, 137) else f"rc {rc}"


SPEEDUP, OVERHEAD_MS, Z3_VS_Z0 = 1.1, 30.0, 0.98


def _load(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.exists() else {}


def targets(out: Path) -> list[dict[str, Any]]:
    """Each target of issue 43: what was measured, the bound, and whether it is met (None: not measured)."""
    peer = {line["case"]: line for line in _load(out / "peer_bench.json").get("rows", [])}
    found: list[dict[str, Any]] = []
    for case in ("z2", "z3", "z2_offload"):
        line = peer.get(case, {})
        speed, peak = line.get("speedup"), line.get("peak_ratio")
        found.append({"target": f"{case}: dslaunch / DeepSpeed tokens/s", "bound": f">= {SPEEDUP}x",
                      "value": None if speed is None else f"{speed:.2f}x",
                      "met": None if speed is None else speed >= SPEEDUP})
        found.append({"target": f"{case}: dslaunch / DeepSpeed peak memory", "bound": "<= 1.00",
                      "value": None if peak is None else f"{peak:.2f}",
                      "met": None if peak is None else peak <= 1.0})
    engine = {r["case"]: r for r in _load(out / "gpu_engine_bench.json").get("rows", []) if "step_ms" in r}
    z0, z2, z3, off = (engine.get(c) for c in ("z0", "z2", "z3", "z2_offload"))
    ratio = z0["step_ms"] / z3["step_ms"] if z0 and z3 else None
    found.append({"target": "ZeRO-3 at world size 1 / ZeRO-0 tokens/s", "bound": f">= {Z3_VS_Z0}x",
                  "value": None if ratio is None else f"{ratio:.3f}x", "met": None if ratio is None else ratio >= Z3_VS_Z0})
    beyond = None
    if off and "cpu_update_ms" in off:  # against ZeRO-2's backward: work moved into the backward counts
        beyond = off["step_ms"] - (z2 or off)["fwd_bwd_ms"] - off["cpu_update_ms"]
    found.append({"target": "offloaded step beyond fwd+bwd and the CPU update", "bound": f"<= {OVERHEAD_MS:.0f} ms",
                  "value": None if beyond is None else (f"{beyond:.1f} ms (step {off['step_ms']:.1f}, update "
                                                        f"{off['cpu_update_ms']:.1f})"),
                  "met": None if beyond is None else beyond <= OVERHEAD_MS})
    return found


def targets_block(out: Path) -> str:
    """What BENCHMARKS.md records from a GPU call: the GPU, dslaunch beside DeepSpeed, the targets."""
    env = _load(out / "env.json")
    lines = [f"### On {env.get('gpu') or 'no GPU (CPU-only run)'} (`scripts/gpu/check.sh`)", "",
             f"Driver {env.get('driver', '-')}, torch {env.get('torch')}, CUDA {env.get('cuda')}, "
             f"{env.get('multiprocessors', '-')} SMs, {env.get('gpu_memory_gib', '-')} GiB.", ""]
    if (peer := out / "peer_bench.md").exists():
        lines += [peer.read_text().split("\n", 2)[-1].strip(), ""]
    lines += ["| target | bound | measured | verdict |", "| --- | --- | --- | --- |"]
    for t in targets(out):
        verdict = {True: "met", False: "NOT met", None: "not measured"}[t["met"]]
        lines.append(f"| {t['target']} | {t['bound']} | {t['value'] or '-'} | {verdict} |")
    return "\n".join(lines) + "\n"


def summarize(out: Path, results: Path | None = None) -> int:
    steps = [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines() if line.strip()]
    env = json.loads((out / "env.json").read_text()) if (out / "env.json").exists() else {}
    # the configurations check.sh ran (none when the deadline came first)
    names = (out / "engine.list").read_text().split() if (out / "engine.list").exists() else []
    engine = [engine_row(out / "engine" / f"{name}.json") for name in names]
    result = {"env": env, "steps": steps, "engine": engine}
    failed = [s["step"] for s in steps if s["rc"] != 0] + [r["config"] for r in engine if not r["ok"]]
    result["targets"] = targets(out)
    checks, block = _table(env, steps, engine), targets_block(out)
    for folder, stem in ((out, "gpu-check"), (results, "gpu_check")):
        if folder is not None:
            (folder / f"{stem}.json").write_text(json.dumps(result, indent=2))
            (folder / f"{stem}.md").write_text(checks + "\n" + block)
    # the targets block last: the device tool returns the output's end (12,000 characters)
    print(checks)
    for name in ("gpu_kernels_bench.md", "gpu_engine_bench.md"):  # peer_bench.md: in the targets block
        if (bench := out / name).exists():
            print(bench.read_text())
    print(block)
    print(f"gpu-check: {'FAILED: ' + ', '.join(failed) if failed else 'every step passed'}")
    return 1 if failed else 0


def _table(env: dict[str, Any], steps: list[dict[str, Any]], engine: list[dict[str, Any]]) -> str:
    lines = ["## GPU check (`scripts/gpu/check.sh`)", "",
             f"GPU: {env.get('gpu') or 'none (CPU-only run)'}; driver {env.get('driver', '-')}, torch {env.get('torch')}, "
             f"CUDA {env.get('cuda')}, NCCL {env.get('nccl', '-')}, triton {env.get('triton')}.", "",
             "Each part's start and end in seconds since the check began, its budget (what it should take) and "
             "its limit (its timeout, within the check's deadline); parts that overlap ran at once.", "",
             "| step | status | start s | end s | seconds | budget s | limit s |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    for s in steps:
        took = s.get("ms")
        over = " (over budget)" if took is not None and s.get("budget") and took > 1000 * s["budget"] else ""
        lines.append(f"| {s['step']} | {_status(s)}{over} | {s.get('start_s', '-')} | {s.get('end_s', '-')} | "
                     f"{'-' if took is None else f'{took / 1000:.1f}'} | {s.get('budget', '-')} | {s.get('limit', '-')} |")
    ends = [s["end_s"] for s in steps if "end_s" in s]
    lines += ["", f"Wall time to the last step's end: {max(ends, default=0):.1f} s."]
    lines += ["", f"Engine: {len(engine)} configurations, each trained 8 steps (2 micro-batches each), saved at "
              "step 4 and resumed, on CUDA and on CPU; differences relative to max(1, |loss|).", "",
              f"| config | precision | backend | first {EARLY} vs CPU | all vs CPU | resume | peak MiB | verdict |",
              "| --- | --- | --- | ---: | ---: | ---: | ---: | --- |"]
    for r in engine:
        peak = f"{r['peak_mib']:.0f}" if r.get("peak_mib") is not None else "-"
        lines.append(f"| {r['config']} | {r['precision']} | {r.get('backend', '-')} | "
                     f"{r.get('early_vs_cpu', float('nan')):.2g} | {r.get('vs_cpu', float('nan')):.2g} | "
                     f"{r.get('resume', float('nan')):.2g} | {peak} | {'ok' if r['ok'] else r['why']} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--env", type=Path, metavar="FILE")
    group.add_argument("--summarize", type=Path, metavar="DIR")
    group.add_argument("--targets", type=Path, metavar="DIR")
    parser.add_argument("--results", type=Path, metavar="RESULTS", help="also write gpu_check.{json,md} here")
    args = parser.parse_args()
    if args.env:
        env = environment()
        args.env.write_text(json.dumps(env, indent=2))
        print(json.dumps(env))
        return 0
    if args.targets:
        print(targets_block(args.targets))
        return 0
    return summarize(args.summarize, args.results)


if __name__ == "__main__":
    sys.exit(main())
