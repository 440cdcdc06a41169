"""dslaunch beside real DeepSpeed on one device: the same script, model, tokens and configuration.

Each case runs twice, each time in its own process (a clean CUDA allocator for its peak): once
with ``import dslaunch as deepspeed`` in this interpreter, once with ``import deepspeed`` in the
interpreter ``--deepspeed-python`` names (a venv holding real DeepSpeed, whose ``deepspeed`` is
checked to be DeepSpeed's own distribution, not dslaunch's compatibility one). The two take turns
case by case, the one going first alternating. The model is ``gpu_engine_bench.py``'s GPT-like
model with ``nn.LayerNorm`` (the script a DeepSpeed user has: no dslaunch kernel in the model),
built from seed 0 on the device, and the tokens are the same on both sides. A run is one rank
started by its side's launcher (``dslaunch --num_gpus 1 peer_bench.py ...``, ``deepspeed --num_gpus
1 peer_bench.py ...`` from the DeepSpeed venv), or with ``--no-launcher`` the rank's process alone
(RANK=0, WORLD_SIZE=1 in its environment): NCCL on a GPU, gloo on CPU. Cases, bf16:

- ``z2``, ``z3``: ZeRO-2 and ZeRO-3, the config's ``AdamW`` (DeepSpeed's ``FusedAdam``, which it
  JIT-builds with nvcc, against dslaunch's), or with ``--optimizer torch`` both given
  ``torch.optim.AdamW`` (fused on CUDA) as the client optimizer, for a machine without nvcc;
- ``z2_offload``: ZeRO-2 with the optimizer on the CPU (each side's ``DeepSpeedCPUAdam``;
  DeepSpeed JIT-builds its ``cpu_adam`` op, minutes on a small CPU: not in the CPU smoke).

Per side: the median step (3 warm-up steps, then ``--steps`` timed), tokens/s, the device's peak
allocated memory, the process's peak resident memory, and the first losses (the same model on
the same tokens: they agree to bf16 rounding, or the comparison is not like for like). Beside
them, what a user choosing between the two for a job also waits on:

- start-up: from the launch command to the first finished step (the launcher, the rank's
  interpreter, ``import deepspeed``, the model on the device, ``initialize``, the first step,
  whose one-time costs, allocator growth and kernel choice, land there), split into the launcher
  (until this script's first line runs), the imports, the script's setup (the model, a client
  optimizer, ``init_distributed``), ``initialize`` and the first step;
- checkpoints: ``save_checkpoint`` and ``load_checkpoint`` of the whole state (bf16 module, fp32
  master weights and Adam moments) into ``--checkpoint-dir`` and back, each side's defaults, the
  ``os.sync()`` after the save until the files are on disk (dslaunch's save fsyncs its files
  before it returns, DeepSpeed's does not), and whether the load restored it: the step after the
  load repeats the loss of the step after the save exactly (the same weights give the same
  forward).

Each run's result is appended to ``--out``'s files as it comes, so a run stopped part way leaves
the table of the cases that finished.

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
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

STARTED_AT = time.time()  # the rank's first line: the launcher's share of the start-up ends here

import torch  # noqa: E402
from torch import nn  # noqa: E402

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


def _filesystem(folder: Path) -> str:
    """The type of the filesystem ``folder`` is on (tmpfs, ext4, ...), from /proc/mounts."""
    try:
        mounts = [line.split()[1:3] for line in Path("/proc/mounts").read_text().splitlines()]
    except OSError:
        return "?"
    path = str(folder.resolve())
    found = [(len(m), kind) for m, kind in mounts if path == m or path.startswith(m.rstrip("/") + "/")]
    return max(found)[1] if found else "?"


def _checkpoint_times(engine: Any, step: Any, folder: Path) -> dict[str, Any]:
    """``save_checkpoint`` then ``load_checkpoint`` of the whole state, timed; whether the load
    restored it (the step after it repeats the loss of the step after the save); its size."""
    out: dict[str, Any] = {"checkpoint_fs": _filesystem(folder)}
    ckpt = Path(tempfile.mkdtemp(prefix="peer-ckpt-", dir=folder))
    try:
        start = time.perf_counter()
        engine.save_checkpoint(str(ckpt), tag="peer")
        out["save_s"] = time.perf_counter() - start
        start = time.perf_counter()  # then until it is on disk: a save that returned before is not yet safe
        os.sync()
        out["sync_s"] = time.perf_counter() - start
        out["checkpoint_gib"] = sum(f.stat().st_size for f in ckpt.rglob("*") if f.is_file()) / 2**30
        after_save = step()
        start = time.perf_counter()
        engine.load_checkpoint(str(ckpt), tag="peer")
        out["load_s"] = time.perf_counter() - start
        after_load = step()
        out.update(loss_after_save=after_save, loss_after_load=after_load, load_restores=after_save == after_load)
    finally:
        shutil.rmtree(ckpt, ignore_errors=True)
    return out


def run_case(side: str, case: str, steps: int, smoke: bool, optimizer: str, launched_at: float,
             checkpoint_dir: Path | None) -> dict[str, Any]:
    """One side of one case in this process: start-up, median step, peaks, first losses and, with
    ``checkpoint_dir``, the checkpoint's save and load. ``launched_at``: the wall clock (epoch
    seconds) when the command starting this process was issued."""
    deepspeed = _deepspeed(side)
    imported_at = time.time()
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
    ready_at = time.time()
    engine, *_ = deepspeed.initialize(model=model, optimizer=client, model_parameters=model.parameters(),
                                      config=config)
    initialized_at = time.time()
    step_s, fwd_bwd_s, losses = [], [], []

    def step() -> float:
        """One training step; its loss. Appends (step, forward + backward) seconds to the lists."""
        _sync(device)
        start = time.perf_counter()
        loss = engine(tokens)
        engine.backward(loss)
        _sync(device)
        backward_done = time.perf_counter()
        engine.step()
        _sync(device)
        step_s.append(time.perf_counter() - start)
        fwd_bwd_s.append(backward_done - start)
        return loss.item()

    for i in range(WARMUP + steps):
        losses.append(step())
        if i == 0:
            first_step_at = time.time()
    step_ms = 1e3 * statistics.median(step_s[WARMUP:])
    fwd_bwd_ms = 1e3 * statistics.median(fwd_bwd_s[WARMUP:])
    startup = {"startup_s": first_step_at - launched_at, "launcher_s": STARTED_AT - launched_at,
               "import_s": imported_at - STARTED_AT,
               "setup_s": ready_at - imported_at, "initialize_s": initialized_at - ready_at,
               "first_step_s": first_step_at - initialized_at}
    # the peaks of training, before the checkpoint's own buffers
    peaks = {"peak_gib": torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None,
             "host_peak_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}
    saved = _checkpoint_times(engine, step, checkpoint_dir) if checkpoint_dir is not None else {}
    return {"side": side, "case": case, "version": importlib.metadata.version(side),
            "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
            "backend": torch.distributed.get_backend(), "optimizer": type(getattr(engine.optimizer, "optimizer", engine.optimizer)).__name__,
            "params": params,
            "tokens": shape["batch"] * shape["seq"], "step_ms": step_ms,
            "fwd_bwd_ms": fwd_bwd_ms, "tokens_per_s": 1e3 * shape["batch"] * shape["seq"] / step_ms,
            "losses": losses, **peaks, **startup, **saved}


def _command(python: str, side: str, args: argparse.Namespace) -> list[str]:
    """What starts one rank: its side's launcher beside ``python`` (one GPU or, on CPU, one worker),
    or with ``--no-launcher`` the interpreter alone."""
    if args.no_launcher:
        return [python]
    from dslaunch.utils.ports import free_port

    launcher = Path(python).parent / ("dslaunch" if side == "dslaunch" else "deepspeed")
    return [str(launcher), "--num_gpus", "1", "--master_port", str(free_port())]


def _run_tree(cmd: list[str], env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
    """``subprocess.run`` that, past ``timeout``, kills the command's whole tree: a launcher's rank
    left behind would hold the GPU through the next runs. Raises ``TimeoutExpired`` then."""
    import psutil

    with subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for child in psutil.Process(proc.pid).children(recursive=True):
                child.kill()
            proc.kill()
            proc.communicate()
            raise
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def _run_side(python: str, side: str, case: str, args: argparse.Namespace) -> dict[str, Any]:
    """``run_case`` in a rank of its own started from ``python``'s side: its result, or why there is none."""
    from dslaunch.utils.ports import free_port

    cuda = torch.cuda.is_available()
    # PYTHONPATH emptied so that the DeepSpeed side sees its venv alone (and this checkout only
    # through sys.path above). Without a launcher the rank's environment is set here, as one would.
    env = {**os.environ, "DS_ACCELERATOR": "cuda" if cuda else "cpu", "TORCH_EXTENSIONS_DIR": str(args.extensions_dir),
           "PYTHONPATH": "", "PATH": f"{Path(python).parent}{os.pathsep}{os.environ.get('PATH', '')}"}  # its ninja
    if args.no_launcher:
        env.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", LOCAL_SIZE="1",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    cmd = [__file__, "--run", f"{side}:{case}", "--steps", str(args.steps), "--optimizer", args.optimizer]
    cmd += ["--smoke"] if args.smoke else []
    cmd += ["--no-checkpoint"] if args.no_checkpoint else ["--checkpoint-dir", str(args.checkpoint_dir)]
    try:
        done = _run_tree(_command(python, side, args) + cmd + ["--launched-at", repr(time.time())], env, args.timeout)
    except subprocess.TimeoutExpired:
        return {"side": side, "case": case, "error": f"timed out after {args.timeout:.0f} s"}
    # a launcher may put a prefix before the rank's lines ("[rank0] ")
    found = [line.partition("RESULT ")[2] for line in done.stdout.splitlines() if "RESULT {" in line]
    if found:
        return {**json.loads(found[-1]), "launcher": Path(_command(python, side, args)[0]).name}
    print(f"--- {side} {case}: exit status {done.returncode}, last lines:\n" + "\n".join(
        (done.stdout + done.stderr).strip().splitlines()[-30:]), flush=True)
    why = (done.stderr.strip() or done.stdout.strip() or "no output").splitlines()[-1]
    return {"side": side, "case": case, "error": f"exit status {done.returncode}: {why[:200]}"}


def compare(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One line per case: dslaunch / DeepSpeed tokens/s, peak memory, start-up and checkpoint
    times, and whether both trained the same thing (first losses within bf16 rounding). A side
    that has not run yet (a run stopped part way) is an error "not run"."""
    out = []
    for case in dict.fromkeys(r["case"] for r in rows):
        ours, theirs = (next((r for r in rows if r["case"] == case and r["side"] == side),
                             {"side": side, "case": case, "error": "not run"}) for side in SIDES)
        line: dict[str, Any] = {"case": case, "dslaunch": ours, "deepspeed": theirs}
        if "error" not in ours and "error" not in theirs:
            first = abs(ours["losses"][0] - theirs["losses"][0]) / max(1.0, abs(theirs["losses"][0]))
            line.update(speedup=ours["tokens_per_s"] / theirs["tokens_per_s"], first_loss_diff=first,
                        same_start=first < 2e-2, startup_ratio=ours["startup_s"] / theirs["startup_s"])
            if ours["peak_gib"] is not None and theirs["peak_gib"] is not None:
                line["peak_ratio"] = ours["peak_gib"] / theirs["peak_gib"]
        out.append(line)
    return out


def _cell(row: dict[str, Any], key: str, fmt: str) -> str:
    return "" if row.get(key) is None else format(row[key], fmt)


def _pair(ours: dict[str, Any], theirs: dict[str, Any], key: str, fmt: str) -> str:
    return f"{_cell(ours, key, fmt) or '-'} / {_cell(theirs, key, fmt) or '-'}"


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
    return "\n".join(out + ["", *_startup_table(lines, first)]) + "\n"


# start-up and checkpoint columns after the config and the start-up ratio: (key, format)
STARTUP_COLUMNS = [("launcher_s", ".1f"), ("import_s", ".1f"), ("setup_s", ".1f"), ("initialize_s", ".1f"), ("first_step_s", ".2f"),
                   ("checkpoint_gib", ".2f"), ("save_s", ".2f"), ("sync_s", ".2f"), ("load_s", ".2f")]


def _startup_table(lines: list[dict[str, Any]], first: dict[str, Any]) -> list[str]:
    launch = ("the launch command, `dslaunch --num_gpus 1` / `deepspeed --num_gpus 1`"
              if first.get("launcher") in ("dslaunch", "deepspeed") else "the rank's process started alone")
    out = [f"Start-up ({launch}, to the first finished step: the launcher until the rank's first line, its "
           "imports to `import deepspeed` done, the script's "
           "setup (the model on the device, a client optimizer if any, `init_distributed`), `initialize`, the first "
           "step) and the checkpoint of the whole state "
           "(`save_checkpoint`, `load_checkpoint`, each side's defaults; dslaunch's save returns once the files are "
           "fsynced, DeepSpeed's once torch.save has handed them to the page cache: sync s is the `os.sync()` after "
           "the save returned, until it is on disk); restored: the step after the load repeats the step after the "
           f"save. Checkpoints on {first.get('checkpoint_fs', '-')}. Seconds, dslaunch / DeepSpeed; start-up ratio < 1: dslaunch starts "
           "sooner.", "",
           "| config | start-up s | start-up ratio | launcher s | import s | script setup s | initialize s | "
           "first step s | checkpoint GiB | save s | sync s | load s | restored |",
           "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    for line in (line for line in lines if "speedup" in line):
        ours, theirs = line["dslaunch"], line["deepspeed"]
        restored = " / ".join({True: "yes", False: "NO"}.get(r.get("load_restores"), "-") for r in (ours, theirs))
        cells = [line["case"], _pair(ours, theirs, "startup_s", ".1f"), f"{line['startup_ratio']:.2f}",
                 *(_pair(ours, theirs, key, fmt) for key, fmt in STARTUP_COLUMNS), restored]
        out.append("| " + " | ".join(cells) + " |")
    return out


def _write(out: Path, rows: list[dict[str, Any]], optimizer: str, steps: int) -> str:
    """peer_bench.json and .md in ``out`` from the runs so far; the table."""
    lines = compare(rows)
    text = table(lines, optimizer, steps)
    out.mkdir(parents=True, exist_ok=True)
    (out / "peer_bench.json").write_text(json.dumps({"optimizer": optimizer, "steps": steps, "rows": lines}, indent=1))
    (out / "peer_bench.md").write_text("## dslaunch beside DeepSpeed (`scripts/gpu/peer_bench.py`)\n\n" + text)
    return text


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
    parser.add_argument("--checkpoint-dir", type=Path, default=Path(tempfile.gettempdir()),
                        help="where each run saves its checkpoint (a folder of its own, removed after the load)")
    parser.add_argument("--no-checkpoint", action="store_true", help="leave out the checkpoint's save and load")
    parser.add_argument("--no-launcher", action="store_true",
                        help="start each rank's process alone, not through its side's launcher")
    parser.add_argument("--out", type=Path, help="write peer_bench.json and peer_bench.md here, after each run")
    parser.add_argument("--run", help=argparse.SUPPRESS)  # SIDE:CASE in this process (internal)
    parser.add_argument("--launched-at", type=float, help=argparse.SUPPRESS)  # epoch seconds (internal)
    parser.add_argument("--local_rank", type=int, help=argparse.SUPPRESS)  # what both launchers pass
    args = parser.parse_args()
    if args.run:
        side, case = args.run.split(":")
        checkpoint = None if args.no_checkpoint else args.checkpoint_dir
        result = run_case(side, case, args.steps, args.smoke, args.optimizer, args.launched_at or time.time(), checkpoint)
        print("RESULT " + json.dumps(result), flush=True)
        return 0
    if not args.deepspeed_python:
        parser.error("--deepspeed-python is required: the interpreter of a venv with real DeepSpeed")
    rows = []
    for i, case in enumerate(args.cases.split(",")):
        for side in SIDES if i % 2 == 0 else SIDES[::-1]:  # who goes first alternates
            python = sys.executable if side == "dslaunch" else args.deepspeed_python
            rows.append(_run_side(python, side, case, args))
            print(json.dumps({k: v for k, v in rows[-1].items() if k != "losses"}), flush=True)
            if args.out:
                _write(args.out, rows, args.optimizer, args.steps)
    lines = compare(rows)
    print(table(lines, args.optimizer, args.steps))
    return 0 if all("speedup" in line for line in lines) else 1


if __name__ == "__main__":
    sys.exit(main())
