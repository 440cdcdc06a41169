"""The GPU check's time budget (``scripts/gpu/steps.sh``, ``check.sh``) and what it leaves when a part
is stuck or the deadline comes: each step's limit is capped by the check's deadline, a part past its
limit is recorded as timed out, one the deadline leaves no time is recorded as skipped, and the
report (``scripts/gpu/report.py``) still writes the table of what ran and the targets, measured or
not. Also the targets' verdicts from the benchmarks' results, and the benchmarks' results from a run
stopped part way (``peer_bench``'s table, ``gpu_engine_bench``'s files)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tarfile
import time
from pathlib import Path
from types import ModuleType

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


def _script(name: str) -> ModuleType:
    """scripts/gpu/NAME.py as a module of its own name (tests/conformance imports another ``report``)."""
    spec = importlib.util.spec_from_file_location(f"gpu_check_{name}", ROOT / "scripts" / "gpu" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


peer_bench, report = _script("peer_bench"), _script("report")


def _steps(out: Path, deadline: int, script: str, **env_vars: str) -> tuple[subprocess.CompletedProcess, list[dict]]:
    env = {**os.environ, "RESULT_DIR": str(out), "STEPS": str(out / "steps.jsonl"), "CHECK_DEADLINE_S": str(deadline),
           "CHECK_MIN_S": "1", **env_vars}
    done = subprocess.run(["bash", "-c", f'export CHECK_START=$(date +%s%N); source scripts/gpu/steps.sh; {script}'],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    return done, [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines()]


@pytest.mark.timeout(60)
def test_a_stuck_step_costs_its_limit_and_the_deadline_skips_the_rest(tmp_path: Path) -> None:
    start = time.monotonic()
    done, steps = _steps(tmp_path, 3, 'step quick 5 60 echo hi; echo "rc $?"; step stuck 1 60 sleep 30; echo "rc $?"; '
                                      'step late 1 60 echo never; echo "rc $?"; sleep 0.2 & wait_for bg $!')
    assert time.monotonic() - start < 10  # the stuck step's limit was the deadline's 3 s, not its own 60
    assert [(s["step"], s["rc"]) for s in steps] == [("quick", 0), ("stuck", 124), ("late", None), ("wait_bg", 0)]
    quick, stuck, late, _ = steps
    assert stuck["limit"] <= 3 and 2 <= stuck["ms"] / 1000 <= 5 and stuck["budget"] == 1
    assert "deadline" in late["skipped"] and "end_s" not in late
    assert quick["start_s"] <= quick["end_s"] <= stuck["start_s"] < stuck["end_s"] <= late["start_s"]
    assert "rc 0\n" in done.stdout and "rc 124\n" in done.stdout and "rc 125\n" in done.stdout
    assert "stuck rc=124 in" in done.stdout and "OVER its budget, TIMED OUT at its limit" in done.stdout
    assert "late skipped: " in done.stdout and (tmp_path / "quick.log").read_text() == "hi\n"


def test_under_the_device_tool_each_step_packs_the_results_into_8_files_at_most(tmp_path: Path) -> None:
    work, out = tmp_path / "work", tmp_path / "out"
    (work / "engine" / "nvme").mkdir(parents=True)
    out.mkdir()
    (work / "engine" / "nvme" / "swap.bin").write_bytes(b"\0" * 4096)  # the NVMe offload's: not carried back
    (work / "engine" / "z0.gpu.json").write_text("{}")
    _steps(work, 30, 'step one 5 30 echo first; echo \'{"rows": []}\' >"$RESULT_DIR/peer_bench.json"; '
                     'step two 5 30 echo second', PACK_DIR=str(out))
    assert sorted(p.name for p in out.iterdir()) == ["gpu-check-files.tar.gz", "peer_bench.json", "steps.jsonl"]
    assert len((out / "steps.jsonl").read_text().splitlines()) == 2  # packed after the second step too
    with tarfile.open(out / "gpu-check-files.tar.gz") as tar:
        names = {Path(n).as_posix().removeprefix("./") for n in tar.getnames()}
    assert {"one.log", "two.log", "steps.jsonl", "engine/z0.gpu.json"} <= names and not any("nvme" in n for n in names)
    packed = subprocess.run(["bash", "-c", "source scripts/gpu/steps.sh; echo $PACKED"], cwd=ROOT,
                            capture_output=True, text=True, timeout=30).stdout
    assert len(packed.split()) + 1 <= 8  # the files of their own and the archive


@pytest.mark.slow
@pytest.mark.timeout(90)
@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here: run scripts/gpu/check.sh itself")
def test_the_check_past_its_deadline_still_writes_the_table_of_what_ran(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHON": sys.executable, "GPU_CHECK_DEADLINE_S": "8", "DSLAUNCH_DEEPSPEED_PYTHON": ""}
    env.pop("OUT", None)
    start = time.monotonic()
    done = subprocess.run(["bash", str(ROOT / "scripts/gpu/check.sh"), str(tmp_path)], capture_output=True, text=True,
                          env=env, timeout=80, cwd=ROOT)
    took = time.monotonic() - start
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    steps = [json.loads(line) for line in (tmp_path / "steps.jsonl").read_text().splitlines()]
    skipped = [s["step"] for s in steps if s["rc"] is None]
    assert {"engine_z3_offload", "bench_gpu_kernels"} <= set(skipped), steps
    assert all(s["end_s"] <= 8 + 6 for s in steps if "end_s" in s), steps  # a limit never reaches past the deadline
    table = (tmp_path / "gpu-check.md").read_text()
    assert "| bench_gpu_kernels | skipped (" in table and "| offloaded step beyond" in table
    assert "gpu-check: FAILED: " in done.stdout and took < 60, took


def _peer_line(case: str, speedup: float, peak: float) -> dict:
    return {"case": case, "speedup": speedup, "peak_ratio": peak}


def test_the_targets_are_met_or_not_from_the_benchmarks_results(tmp_path: Path) -> None:
    (tmp_path / "peer_bench.json").write_text(json.dumps({"rows": [
        _peer_line("z2", 1.25, 0.9), _peer_line("z3", 1.05, 0.8), _peer_line("z2_offload", 1.3, 1.02)]}))
    (tmp_path / "gpu_engine_bench.json").write_text(json.dumps({"rows": [
        {"case": "z0", "step_ms": 70.0, "fwd_bwd_ms": 55.0}, {"case": "z2", "step_ms": 70.6, "fwd_bwd_ms": 56.0},
        {"case": "z3", "step_ms": 71.0, "fwd_bwd_ms": 57.0},
        {"case": "z2_offload", "step_ms": 340.0, "fwd_bwd_ms": 60.0, "cpu_update_ms": 263.0}]}))
    (tmp_path / "env.json").write_text(json.dumps({"gpu": "NVIDIA H100 80GB HBM3", "driver": "580"}))
    verdicts = {t["target"]: t["met"] for t in report.targets(tmp_path)}
    assert verdicts == {
        "z2: dslaunch / DeepSpeed tokens/s": True, "z2: dslaunch / DeepSpeed peak memory": True,
        "z3: dslaunch / DeepSpeed tokens/s": False, "z3: dslaunch / DeepSpeed peak memory": True,
        "z2_offload: dslaunch / DeepSpeed tokens/s": True, "z2_offload: dslaunch / DeepSpeed peak memory": False,
        "ZeRO-3 at world size 1 / ZeRO-0 tokens/s": True,  # 70 / 71 = 0.986
        # 340 - 56 (ZeRO-2's forward + backward, not the offloaded run's 60) - 263 = 21 ms
        "offloaded step beyond fwd+bwd and the CPU update": True}
    block = report.targets_block(tmp_path)
    assert block.startswith("### On NVIDIA H100 80GB HBM3 (`scripts/gpu/check.sh`)")
    assert "| z3: dslaunch / DeepSpeed tokens/s | >= 1.1x | 1.05x | NOT met |" in block
    assert "| offloaded step beyond fwd+bwd and the CPU update | <= 30 ms | 21.0 ms (step 340.0, update 263.0) | met |" in block
    (tmp_path / "gpu_engine_bench.json").unlink()  # the engine benchmark did not run: its targets are not measured
    assert [t["met"] for t in report.targets(tmp_path)][-2:] == [None, None]


def test_a_peer_run_stopped_part_way_leaves_the_table_of_what_finished(tmp_path: Path) -> None:
    run = {"side": "dslaunch", "case": "z2", "version": "0.1.0", "device": "cpu", "backend": "gloo", "params": 10,
           "tokens": 64, "tokens_per_s": 100.0, "peak_gib": None, "host_peak_gib": 0.4, "losses": [4.9], "startup_s": 5.0}
    rows = [run, {**run, "side": "deepspeed", "version": "0.19.8", "tokens_per_s": 80.0, "startup_s": 8.0},
            {**run, "case": "z3"}]  # DeepSpeed's z3 had not run when the check's deadline came
    text = peer_bench._write(tmp_path, rows, "torch", 2)
    lines = json.loads((tmp_path / "peer_bench.json").read_text())["rows"]
    assert [(line["case"], line.get("speedup"), line.get("startup_ratio")) for line in lines] == [
        ("z2", 1.25, 0.625), ("z3", None, None)]
    assert "| z2 | 100 | 80 | 1.25x |" in text and "| z3 | | | | | | | | deepspeed: not run |" in text
    assert "| z2 | 5.0 / 8.0 | 0.62 | - / - |" in text


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_the_engine_benchmark_leaves_each_finished_case_and_its_target_for_the_report(tmp_path: Path) -> None:
    # the second case fails at once: the first one's result is there all the same, and the report reads it
    done = subprocess.run([sys.executable, str(ROOT / "scripts/bench/gpu_engine_bench.py"), "--smoke", "--steps", "1",
                           "--cases", "z2_offload,nonesuch", "--out", str(tmp_path)], capture_output=True, text=True,
                          timeout=110, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 1, done.stdout[-2000:] + done.stderr[-2000:]
    offload, failed = json.loads((tmp_path / "gpu_engine_bench.json").read_text())["rows"]
    assert offload["case"] == "z2_offload" and offload["step_ms"] > 0 and offload["cpu_update_ms"] > 0, offload
    assert failed["case"] == "nonesuch" and "invalid choice" in failed["error"], failed
    assert "| nonesuch | " in (tmp_path / "gpu_engine_bench.md").read_text()
    found = {t["target"]: t for t in report.targets(tmp_path)}
    beyond = found["offloaded step beyond fwd+bwd and the CPU update"]
    assert beyond["met"] in (True, False) and beyond["value"].endswith(f"update {offload['cpu_update_ms']:.1f})"), beyond
    assert found["ZeRO-3 at world size 1 / ZeRO-0 tokens/s"]["met"] is None  # no z0, no z3 in this run

