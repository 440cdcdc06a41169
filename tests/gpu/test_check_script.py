"""``scripts/gpu/check.sh`` on a machine without a GPU (CI): it says so in one line, runs its setup,
its steps, the comparison with real DeepSpeed on a tiny model with gloo (where one is at hand: the
wheels of ``scripts/gpu/wheels.sh``, ``DSLAUNCH_DEEPSPEED_PYTHON`` or ``.venv-conformance``), one
engine configuration on CPU, and its report, so that the script does not rot between the sessions
that have a GPU. On a GPU machine the script itself is the test."""

from __future__ import annotations

import json
import os
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
    assert [s["step"] for s in steps] == ["setup", "env", "deepspeed_setup", "pytest_gpu", *(["bench_peer"] if peer else []),
                                          "engine_z3_offload", "bench_gpu_kernels"]
    assert all(s["rc"] == 0 and s["ms"] > 0 for s in steps), steps
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
    assert "DeepSpeed 0.19.8" in done.stdout and "| z3 | " in done.stdout
