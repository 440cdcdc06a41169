"""DeepSpeed Compression in dslaunch against DeepSpeed's own library, same model, config and seed.

``deepspeed_reference.py`` runs ``scenarios.py`` and ``moq_steps.py`` with DeepSpeed 0.19.6's
compression code (the last release with it; 0.19.8 removed it) in the DeepSpeed venv; this test
runs them with dslaunch and compares: the loss of each of 8 SGD steps with the scheduler switching
techniques on (quantization in forward, static/dynamic activation quantization, l1/topk sparse,
row, head and channel pruning), the trained weights, the output and every state shape after
``redundancy_clean`` (pruned rows, heads and channels removed), layer reduction's copied weights,
and the MoQ quantizer's bits and weights per step. Tolerance 1e-6 (relative and absolute): the
arithmetic is the same op for op. Without the venv the test skips and says why.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from dslaunch.runtime.compression.compress import init_compression, redundancy_clean, student_initialization
from dslaunch.runtime.compression.scheduler import CompressionScheduler
from dslaunch.runtime.quantize import Quantizer
from tests.deepspeed_reference import run_python
from tests.runtime.compression import moq_steps, scenarios

HERE = Path(__file__).resolve().parent
SRC = Path(os.environ.get("DSLAUNCH_DEEPSPEED_SRC", "/work/ds-src"))
TOL = 1e-6


class DslaunchApi:
    init_compression = staticmethod(init_compression)
    redundancy_clean = staticmethod(redundancy_clean)
    student_initialization = staticmethod(student_initialization)

    @staticmethod
    def scheduler(model: Any, config: dict) -> CompressionScheduler:
        return CompressionScheduler(model, config)


@pytest.fixture(scope="module")
def reference(deepspeed_python: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    python = deepspeed_python
    if not (SRC / "deepspeed" / "compression" / "compress.py").exists():
        pytest.skip(f"DeepSpeed 0.19.6's source (its compression library) is not at {SRC}: set DSLAUNCH_DEEPSPEED_SRC")
    out = tmp_path_factory.mktemp("compression") / "deepspeed.json"
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "DSLAUNCH_DEEPSPEED_SRC": str(SRC),
           "PYTHONPATH": ""}
    done = run_python(python, [str(HERE / "deepspeed_reference.py"), str(out)], env, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(out.read_text())


def _close(ours: list, theirs: list, what: str) -> None:
    assert len(ours) == len(theirs), f"{what}: {len(ours)} values, DeepSpeed {len(theirs)}"
    torch.testing.assert_close(torch.tensor(ours), torch.tensor(theirs), rtol=TOL, atol=TOL, msg=lambda m: f"{what}: {m}")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", list(scenarios.CONFIGS))
def test_training_and_clean_match_deepspeed(reference: dict, name: str) -> None:
    ours, theirs = scenarios.run(DslaunchApi, name), reference[name]
    _close(ours["losses"], theirs["losses"], f"{name} losses")
    _close(ours["before"], theirs["before"], f"{name} output before redundancy_clean")
    assert ours["shapes"] == theirs["shapes"]
    for key, value in theirs["state"].items():
        _close(ours["state"][key], value, f"{name} {key}")
    _close(ours["after"], theirs["after"], f"{name} output after redundancy_clean")


@pytest.mark.timeout(120)
def test_layer_reduction_matches_deepspeed(reference: dict) -> None:
    ours = scenarios.run_layer_reduction(DslaunchApi)["state"]
    assert ours.keys() == reference["layer_reduction"]["state"].keys()
    for key, value in reference["layer_reduction"]["state"].items():
        _close(ours[key], value, f"layer_reduction {key}")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", list(moq_steps.CASES))
def test_moq_quantizer_matches_deepspeed(reference: dict, case: str) -> None:
    ours, theirs = moq_steps.run(Quantizer)[case], reference["moq"][case]
    assert ours["bits"] == theirs["bits"] and ours["period"] == theirs["period"]
    for step, (a, b) in enumerate(zip(ours["values"], theirs["values"], strict=True)):
        _close(a, b, f"moq {case} step {step}")


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
