"""Exit-status stress: many 2-rank jobs under a CPU hog; count the runs whose exit code lies.

The same DeepSpeed-API training script (ZeRO 0, 1, 2 in turn, 8 steps, rank 0 saves the weights,
no ``destroy_process_group``) runs under each launcher:

- finished runs must exit 0 (a gloo abort in teardown gives 134);
- raising runs (the script raises after training) must exit 1.

A busy loop (``sh -c 'while :; do :; done'``) loads one core for the whole run: teardown races
show under load. Writes ``results/exit_stress.json`` and ``results/exit_stress.md`` (or to
``--out``). Exits 1 when any dslaunch run had the wrong exit code.

Usage: ``python scripts/bench/exit_stress.py [--runs 200] [--raising 50]
[--peer-runs 40] [--peer-raising 10] [--systems dslaunch,deepspeed] [--out DIR]``.
DeepSpeed (``pip install --no-build-isolation deepspeed``, DS_ACCELERATOR=cpu) runs only if it
imports; it gets fewer runs by default because its launcher takes ~4x longer to start.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
BIN = Path(sys.executable).parent

SCRIPT = """
import os, sys
import torch
if os.environ["STRESS_SYSTEM"] == "dslaunch":
    import dslaunch as deepspeed
else:
    import deepspeed
args = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]  # both launchers add it
stage, mode = int(args[0]), args[1]
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8))
engine, *_ = deepspeed.initialize(
    model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3),
    config={"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": stage}})
for _ in range(8):
    loss = engine(torch.randn(4, 64)).square().mean()
    engine.backward(loss)
    engine.step()
if engine.global_rank == 0:
    torch.save(model.state_dict(), os.path.join(os.path.dirname(__file__), "weights.pt"))
if mode == "raise":
    raise RuntimeError("raised after training")
"""

EXPECTED = {"finish": 0, "raise": 1}
JOB_TIMEOUT_S = 300  # a job takes 5-60 s here; past this it hangs


def _command(system: str, port: int, script: Path, stage: int, mode: str) -> list[str]:
    launcher = str(BIN / ("dslaunch" if system == "dslaunch" else "deepspeed"))
    return [launcher, "--num_gpus", "2", "--master_port", str(port), str(script), str(stage), mode]


def _one(system: str, port: int, script: Path, stage: int, mode: str) -> dict:
    env = {**os.environ, "STRESS_SYSTEM": system, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    t0 = time.monotonic()
    try:
        proc = subprocess.run(_command(system, port, script, stage, mode), env=env, capture_output=True,
                              text=True, timeout=JOB_TIMEOUT_S)
        code, output = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as hung:  # a hang is a wrong exit too: record it, go on
        code = "timeout"
        output = "".join(o.decode(errors="replace") if isinstance(o, bytes) else (o or "")
                         for o in (hung.stdout, hung.stderr))
    return {"system": system, "mode": mode, "stage": stage, "exit_code": code,
            "abort": "terminate called" in output, "seconds": round(time.monotonic() - t0, 2),
            "tail": output[-600:] if code != EXPECTED[mode] else ""}


def _has_deepspeed() -> bool:
    return subprocess.run([sys.executable, "-c", "import deepspeed"], capture_output=True,
                          env={**os.environ, "DS_ACCELERATOR": "cpu"}).returncode == 0


def run(plan: dict[str, dict[str, int]], out: Path) -> list[dict]:
    """Run every (system, mode) the plan counts, interleaved, under one CPU hog."""
    from dslaunch.utils.ports import free_port

    hog = subprocess.Popen(["sh", "-c", "while :; do :; done"])
    records: list[dict] = []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            script = Path(tmp) / "train.py"
            script.write_text(SCRIPT)
            queue = [(system, mode, i) for system, modes in plan.items() for mode, n in modes.items()
                     for i in range(n)]
            queue.sort(key=lambda job: job[2])  # interleave systems and modes over time
            for n, (system, mode, i) in enumerate(queue, 1):
                records.append(_one(system, free_port(), script, i % 3, mode))
                r = records[-1]
                if r["exit_code"] != EXPECTED[mode]:
                    print(f"[{n}/{len(queue)}] {system} {mode} stage {r['stage']}: exit {r['exit_code']}",
                          flush=True)
                _write(records, out)  # after every run: a long run stopped early still reports
    finally:
        hog.kill()
        hog.wait()
    return records


def _write(records: list[dict], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "exit_stress.json").write_text(json.dumps(records, indent=1) + "\n")
    (out / "exit_stress.md").write_text(_markdown(records))


def _markdown(records: list[dict]) -> str:
    groups: dict[tuple[str, str], list[dict]] = collections.defaultdict(list)
    for r in records:
        groups[(r["system"], r["mode"])].append(r)
    lines = ["## Exit status under load: 2-rank jobs with a CPU hog (`scripts/bench/exit_stress.py`)\n",
             "The same DeepSpeed-API script (ZeRO 0/1/2 in turn, 8 steps, rank 0 saves the weights, "
             "no `destroy_process_group`) under each launcher, interleaved, while a busy loop loads "
             "one of the 2 cores. Finished runs must exit 0, runs that raise after training must "
             "exit 1.\n",
             "| launcher | script | runs | wrong exit code | of which SIGABRT (134) | codes seen | median s |",
             "| --- | --- | ---: | ---: | ---: | --- | ---: |"]
    for (system, mode), rs in sorted(groups.items()):
        wrong = [r for r in rs if r["exit_code"] != EXPECTED[mode]]
        codes = collections.Counter(r["exit_code"] for r in rs)
        seen = ", ".join(f"{c}: {k}" for c, k in sorted(codes.items(), key=str))
        median = sorted(r["seconds"] for r in rs)[len(rs) // 2]
        lines.append(f"| {system} | {'finishes' if mode == 'finish' else 'raises'} | {len(rs)} | "
                     f"{len(wrong)} | {sum(r['exit_code'] == 134 for r in rs)} | {seen} | {median:.1f} |")
    lines.append("\nTarget: dslaunch 0 wrong of 200 finished runs and 0 of 50 raising runs.\n")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument("--raising", type=int, default=50)
    parser.add_argument("--peer-runs", type=int, default=40)
    parser.add_argument("--peer-raising", type=int, default=10)
    parser.add_argument("--systems", default="dslaunch,deepspeed")
    parser.add_argument("--out", type=Path, default=HERE / "results")
    args = parser.parse_args(argv)
    systems = args.systems.split(",")
    plan = {}
    if "dslaunch" in systems:
        plan["dslaunch"] = {"finish": args.runs, "raise": args.raising}
    if "deepspeed" in systems:
        if _has_deepspeed():
            plan["deepspeed"] = {"finish": args.peer_runs, "raise": args.peer_raising}
        else:
            print("deepspeed does not import: skipping the peer", file=sys.stderr)
    records = run(plan, args.out)
    print((args.out / "exit_stress.md").read_text())
    bad = [r for r in records if r["system"] == "dslaunch" and r["exit_code"] != EXPECTED[r["mode"]]]
    for r in bad[:3]:
        print(f"--- dslaunch {r['mode']} stage {r['stage']} exit {r['exit_code']}:\n{r['tail']}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
