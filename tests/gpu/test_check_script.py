"""``scripts/gpu/check.sh`` on a machine without a GPU (CI): it says so in one line, runs its setup,
its steps on its timeline (DeepSpeed's venv in the background, the timed parts after it), the
comparison with real DeepSpeed on a tiny model with gloo (where one is at hand: the wheels of
``scripts/gpu/wheels.sh``, ``DSLAUNCH_DEEPSPEED_PYTHON`` or ``.venv-conformance``) with each side's
start-up and checkpoint, one engine configuration on CPU, and its report with the targets, so that the script does not rot between the sessions
that have a GPU. On a GPU machine the script itself is the test."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.slow, pytest.mark.timeout(480),
              pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here: run scripts/gpu/check.sh itself")]


def _deepspeed_at_hand() -> bool:
    """check.sh's own rule for where a real DeepSpeed comes from."""
    return bool(os.environ.get("DSLAUNCH_DEEPSPEED_PYTHON") or list((ROOT / ".whl" / "deepspeed").glob("deepspeed-*.whl"))
                or (ROOT / ".venv-conformance" / "deepspeed" / "bin" / "python").exists())


def test_without_a_gpu_the_check_runs_its_bookkeeping_on_cpu(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHON": sys.executable}
    env.pop("OUT", None)
    done = subprocess.run(["bash", str(ROOT / "scripts/gpu/check.sh"), str(tmp_path)], capture_output=True,
                          text=True, env=env, timeout=460, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert done.stdout.count("no CUDA device here") == 1
    steps = [json.loads(line) for line in (tmp_path / "steps.jsonl").read_text().splitlines()]
    peer = _deepspeed_at_hand()
    # DeepSpeed's venv installs in the background beside the untimed parts; the timed ones wait for it
    names = [s["step"] for s in steps]
    assert [n for n in names if n != "deepspeed_setup"] == [
        "env", "setup", "pytest_gpu", "engine_z3_offload", "wait_deepspeed", *(["bench_peer"] if peer else []),
        "bench_gpu_kernels"], names
    at = {s["step"]: s for s in steps}
    assert at["env"]["end_s"] <= at["setup"]["start_s"] <= at["setup"]["end_s"] <= at["deepspeed_setup"]["start_s"], steps
    assert at["engine_z3_offload"]["end_s"] <= at["wait_deepspeed"]["start_s"], steps  # the untimed parts first
    assert at["deepspeed_setup"]["end_s"] <= at["wait_deepspeed"]["end_s"] <= at["bench_gpu_kernels"]["start_s"], steps
    assert all(s["rc"] == 0 and s["ms"] >= 0 and s["start_s"] <= s["end_s"] for s in steps), steps
    # each part's start and end, in seconds since the check began, printed as it ran
    assert re.search(r"\[ +[0-9.]+s\] == pytest_gpu \(budget \d+s, limit \d+s\)", done.stdout), done.stdout
    assert re.search(r"\[ +[0-9.]+s\]    pytest_gpu rc=0 in [0-9.]+s", done.stdout), done.stdout
    result = json.loads((tmp_path / "gpu-check.json").read_text())
    assert result["env"]["gpu"] is None and result["env"]["torch"] == torch.__version__
    assert [(r["config"], r["backend"], r["ok"]) for r in result["engine"]] == [("z3_offload", "gloo", True)]
    # both runs on CPU (their thread counts may differ: rounding only); the resumed run repeats exactly
    assert all(r["vs_cpu"] < 1e-5 and r["resume"] == 0 for r in result["engine"]), result["engine"]
    table = (tmp_path / "gpu-check.md").read_text()
    assert "GPU: none (CPU-only run)" in table and "| z3_offload | fp32 | gloo |" in table
    assert " skipped" in (tmp_path / "pytest_gpu.log").read_text()
    if not peer:
        assert "no real DeepSpeed: run scripts/gpu/wheels.sh" in (tmp_path / "deepspeed_setup.log").read_text()
        return
    # the same script under dslaunch and under real DeepSpeed, on the same model and tokens
    lines = json.loads((tmp_path / "peer_bench.json").read_text())["rows"]
    assert [line["case"] for line in lines] == ["z2", "z3"]
    for line in lines:
        assert line["deepspeed"]["version"] == "0.19.8" and line["deepspeed"]["backend"] == "gloo", line["deepspeed"]
        assert line["dslaunch"]["version"] != line["deepspeed"]["version"]
        assert line["speedup"] > 0 and line["same_start"], line
        for side in ("dslaunch", "deepspeed"):  # start-up from each side's launcher, split in its parts;
            run = line[side]                    # the checkpoint saved, loaded, restored
            parts = run["launcher_s"] + run["import_s"] + run["setup_s"] + run["initialize_s"] + run["first_step_s"]
            assert run["launcher"] == side and 0 < run["launcher_s"] and 0 < run["first_step_s"], run
            assert abs(parts - run["startup_s"]) < 1e-6, run
            assert run["save_s"] > 0 and run["load_s"] > 0 and run["checkpoint_gib"] > 0, run
            assert run["load_restores"] and run["loss_after_load"] == run["loss_after_save"], run
    assert "DeepSpeed 0.19.8" in done.stdout and "| z3 | " in done.stdout
    # the targets, measured or not: the table BENCHMARKS.md takes
    assert re.search(r"\| z3: dslaunch / DeepSpeed tokens/s \| >= 1.1x \| [0-9.]+x \| (met|NOT met) \|", table), table
    assert "| ZeRO-3 at world size 1 / ZeRO-0 tokens/s | >= 0.98x | - | not measured |" in table
