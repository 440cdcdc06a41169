"""dslaunch beside real DeepSpeed on one device: the same script, model, tokens and configuration.

Each case runs twice, each time in its own process (a clean CUDA allocator for its peak): once
with ``import dslaunch as deepspeed`` in this interpreter, once with ``import deepspeed`` in the
interpreter ``--deepspeed-python`` names (a venv holding real DeepSpeed, whose ``deepspeed`` is
checked to be DeepSpeed's own distribution, not dslaunch's compatibility one). The two take turns
case by case, the one going first alternating. The model is ``gpu_engine_bench.py``'s GPT-like
model with ``nn.LayerNorm`` (the script a DeepSpeed user has: no dslaunch kernel in the model),
built from seed 0 on the device, and the tokens are the same on both sides. A process is one rank
(RANK=0, WORLD_SIZE=1 in its environment): NCCL on a GPU, gloo on CPU. Cases, bf16:

- ``z2``, ``z3``: ZeRO-2 and ZeRO-3, the config's ``AdamW`` (DeepSpeed's ``FusedAdam``, which it
  JIT-builds with nvcc, against dslaunch's), or with ``--optimizer torch`` both given
  ``torch.optim.AdamW`` (fused on CUDA) as the client optimizer, for a machine without nvcc;
- ``z2_offload``: ZeRO-2 with the optimizer on the CPU (each side's ``DeepSpeedCPUAdam``;
  DeepSpeed JIT-builds its ``cpu_adam`` op, minutes on a small CPU: not in the CPU smoke).

Per side: the median step (3 warm-up steps, then ``--steps`` timed), tokens/s, the device's peak
allocated memory, the process's peak resident memory, and the first losses (the same model on
the same tokens: they agree to bf16 rounding, or the comparison is not like for like).

    python scripts/gpu/peer_bench.py --deepspeed-python .venv-gpu-deepspeed/bin/python --out DIR
    python scripts/gpu/peer_bench.py --deepspeed-python PY --smoke    (CPU, a tiny model, gloo)
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts" / "bench"))
from gpu_engine_bench import GPT, _config, _shape, _sync  # noqa: E402

CASES = ["z2", "z3", "z2_offload"]
SIDES = ["dslaunch", "deepspeed"]
WARMUP = 3


def _deepspeed(side: str) -> Any:
    """The module a script gets as ``deepspeed`` on this side; refuses a DeepSpeed that is not real."""
    if side == "dslaunch":
        import dslaunch

        return dslaunch
    import deepspeed

    version = importlib.metadata.version("deepspeed")
    if "dslaunch" in version or deepspeed.initialize.__module__.startswith("dslaunch"):
        raise SystemExit(f"peer_bench: `import deepspeed` in {sys.executable} is dslaunch's compatibility "
                         f"package ({version}, {deepspeed.__file__}), not DeepSpeed: name a venv with real DeepSpeed")
    return deepspeed


def run_case(side: str, case: str, steps: int, smoke: bool, optimizer: str) -> dict[str, Any]:
    """One side of one case in this process: median step, peaks, first losses."""
    deepspeed = _deepspeed(side)
    shape = _shape(smoke)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    with torch.device(device):
        model = GPT(shape["d"], shape["layers"], shape["heads"], shape["vocab"], nn.LayerNorm)
    params = sum(p.numel() for p in model.parameters())  # before ZeRO-3 partitions them
    tokens = torch.randint(0, shape["vocab"], (shape["batch"], shape["seq"]),
                           generator=torch.Generator().manual_seed(1)).to(device)
    config, client = _config(case), None
    if optimizer == "torch" and case != "z2_offload":
        config = {k: v for k, v in config.items() if k != "optimizer"} | {"zero_allow_untested_optimizer": True}
        client = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01, fused=device.type == "cuda")
    if side == "deepspeed" and device.type == "cpu":
        # Its shared-memory allreduce op (a JIT build of ~6 min on 2 cores) has nothing to do at one rank.
        # (the package's own `torch` attribute is torch itself: reach the submodule by name)
        importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    deepspeed.init_distributed(dist_backend="nccl" if device.type == "cuda" else "gloo")
    engine, *_ = deepspeed.initialize(model=model, optimizer=client, model_parameters=model.parameters(),
                                      config=config)
    step_s, fwd_bwd_s, losses = [], [], []
    for i in range(WARMUP + steps):
        _sync(device)
        start = time.perf_counter()
        loss = engine(tokens)
        engine.backward(loss)
        _sync(device)
        backward_done = time.perf_counter()
        engine.step()
        _sync(device)
        losses.append(loss.item())
        if i >= WARMUP:
            step_s.append(time.perf_counter() - start)
            fwd_bwd_s.append(backward_done - start)
    step_ms = 1e3 * statistics.median(step_s)
    return {"side": side, "case": case, "version": importlib.metadata.version(side),
            "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
            "backend": torch.distributed.get_backend(), "optimizer": type(getattr(engine.optimizer, "optimizer", engine.optimizer)).__name__,
            "params": params,
            "tokens": shape["batch"] * shape["seq"], "step_ms": step_ms,
            "fwd_bwd_ms": 1e3 * statistics.median(fwd_bwd_s), "tokens_per_s": 1e3 * shape["batch"] * shape["seq"] / step_ms,
            "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None,
            "host_peak_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, "losses": losses}


def _run_side(python: str, side: str, case: str, args: argparse.Namespace) -> dict[str, Any]:
    """``run_case`` in a process of its own on ``python``: its result, or why there is none."""
    from dslaunch.utils.ports import free_port

    cuda = torch.cuda.is_available()
    # One rank, no launcher: DeepSpeed would otherwise look for MPI. PYTHONPATH emptied so that
    # the DeepSpeed side sees its venv alone (and this checkout only through sys.path above).
    env = {**os.environ, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
           "LOCAL_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
           "DS_ACCELERATOR": "cuda" if cuda else "cpu", "TORCH_EXTENSIONS_DIR": str(args.extensions_dir),
           "PYTHONPATH": "", "PATH": f"{Path(python).parent}{os.pathsep}{os.environ.get('PATH', '')}"}  # its ninja
    cmd = [python, __file__, "--run", f"{side}:{case}", "--steps", str(args.steps), "--optimizer", args.optimizer]
    try:
        done = subprocess.run(cmd + (["--smoke"] if args.smoke else []), env=env, capture_output=True, text=True,
                              timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return {"side": side, "case": case, "error": f"timed out after {args.timeout:.0f} s"}
    found = [line[len("RESULT "):] for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if found:
        return json.loads(found[-1])
    print(f"--- {side} {case}: exit status {done.returncode}, last lines:\n" + "\n".join(
        (done.stdout + done.stderr).strip().splitlines()[-30:]), flush=True)
    why = (done.stderr.strip() or done.stdout.strip() or "no output").splitlines()[-1]
    return {"side": side, "case": case, "error": f"exit status {done.returncode}: {why[:200]}"}


def compare(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One line per case: dslaunch / DeepSpeed tokens/s and peak memory, and whether both trained
    the same thing (first losses within bf16 rounding)."""
    out = []
    for case in dict.fromkeys(r["case"] for r in rows):
        ours, theirs = (next(r for r in rows if r["case"] == case and r["side"] == side) for side in SIDES)
        line: dict[str, Any] = {"case": case, "dslaunch": ours, "deepspeed": theirs}
        if "error" not in ours and "error" not in theirs:
            first = abs(ours["losses"][0] - theirs["losses"][0]) / max(1.0, abs(theirs["losses"][0]))
            line.update(speedup=ours["tokens_per_s"] / theirs["tokens_per_s"], first_loss_diff=first,
                        same_start=first < 2e-2)
            if ours["peak_gib"] is not None and theirs["peak_gib"] is not None:
                line["peak_ratio"] = ours["peak_gib"] / theirs["peak_gib"]
        out.append(line)
    return out


def _cell(row: dict[str, Any], key: str, fmt: str) -> str:
    return "" if row.get(key) is None else format(row[key], fmt)


def table(lines: list[dict[str, Any]], optimizer: str, steps: int) -> str:
    runs = [r for line in lines for r in (line["dslaunch"], line["deepspeed"]) if "error" not in r]
    first = runs[0] if runs else {}
    versions = {r["side"]: r["version"] for r in runs}
    opt = ("each config's AdamW (dslaunch's FusedAdam, DeepSpeed's JIT-built FusedAdam; offload: each "
           "side's DeepSpeedCPUAdam)" if optimizer == "config" else
           "torch.optim.AdamW as the client optimizer on both sides (DeepSpeed's FusedAdam not built here; "
           "offload: each side's DeepSpeedCPUAdam)")
    out = [f"Device: {first.get('device', '?')}, torch {torch.__version__}, {first.get('backend', '?')}; "
           f"dslaunch {versions.get('dslaunch', '?')}, DeepSpeed {versions.get('deepspeed', '?')}. "
           f"GPT-like model, {first.get('params', 0) / 1e6:,.1f}M parameters (nn.LayerNorm), "
           f"{first.get('tokens', 0)} tokens a step, bf16; optimizer: {opt}. Median of {steps} steps after "
           f"{WARMUP} warm-up, each side in its own process, taking turns. Ratio > 1: dslaunch is faster; "
           "peak ratio < 1: dslaunch needs less.", "",
           "| config | dslaunch tokens/s | DeepSpeed tokens/s | dslaunch / DeepSpeed | dslaunch peak GiB | "
           "DeepSpeed peak GiB | peak ratio | host peak GiB (dslaunch / DeepSpeed) | first loss (dslaunch / DeepSpeed) |",
           "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    for line in lines:
        ours, theirs = line["dslaunch"], line["deepspeed"]
        if "speedup" not in line:
            errors = "; ".join(f"{r['side']}: {r['error']}" for r in (ours, theirs) if "error" in r)
            out.append(f"| {line['case']} | | | | | | | | {errors} |")
            continue
        loss = f"{ours['losses'][0]:.4f} / {theirs['losses'][0]:.4f}" + ("" if line["same_start"] else
                                                                           " (NOT the same start)")
        out.append(f"| {line['case']} | {ours['tokens_per_s']:,.0f} | {theirs['tokens_per_s']:,.0f} | "
                   f"{line['speedup']:.2f}x | {_cell(ours, 'peak_gib', '.1f')} | {_cell(theirs, 'peak_gib', '.1f')} | "
                   f"{_cell(line, 'peak_ratio', '.2f')} | {ours['host_peak_gib']:.1f} / {theirs['host_peak_gib']:.1f} | "
                   f"{loss} |")
    return "\n".join(out) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--deepspeed-python", help="the interpreter of a venv with real DeepSpeed")
    parser.add_argument("--cases", default=",".join(CASES), help="comma-separated, of: " + ", ".join(CASES))
    parser.add_argument("--steps", type=int, default=10, help="timed steps per run")
    parser.add_argument("--optimizer", choices=["config", "torch"], default="config",
                        help="config: the config's AdamW; torch: torch's AdamW as the client optimizer")
    parser.add_argument("--smoke", action="store_true", help="a tiny model (CPU, gloo)")
    parser.add_argument("--timeout", type=float, default=150, help="seconds one side of a case may take")
    parser.add_argument("--extensions-dir", type=Path, default=ROOT / ".ds-ext",
                        help="TORCH_EXTENSIONS_DIR: where DeepSpeed's JIT-built ops are kept and reused")
    parser.add_argument("--out", type=Path, help="write peer_bench.json and peer_bench.md here")
    parser.add_argument("--run", help=argparse.SUPPRESS)  # SIDE:CASE in this process (internal)
    args = parser.parse_args()
    if args.run:
        side, case = args.run.split(":")
        print("RESULT " + json.dumps(run_case(side, case, args.steps, args.smoke, args.optimizer)), flush=True)
        return 0
    if not args.deepspeed_python:
        parser.error("--deepspeed-python is required: the interpreter of a venv with real DeepSpeed")
    rows = []
    for i, case in enumerate(args.cases.split(",")):
        for side in SIDES if i % 2 == 0 else SIDES[::-1]:  # who goes first alternates
            python = sys.executable if side == "dslaunch" else args.deepspeed_python
            rows.append(_run_side(python, side, case, args))
            print(json.dumps({k: v for k, v in rows[-1].items() if k != "losses"}), flush=True)
    lines = compare(rows)
    text = table(lines, args.optimizer, args.steps)
    print(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "peer_bench.json").write_text(json.dumps({"optimizer": args.optimizer, "rows": lines}, indent=1))
        (args.out / "peer_bench.md").write_text("## dslaunch beside DeepSpeed (`scripts/gpu/peer_bench.py`)\n\n" + text)
    return 0 if all("speedup" in line for line in lines) else 1


if __name__ == "__main__":
    sys.exit(main())
