"""The Hugging Face side runs in ``.venv-compat`` (``make compat-venv``: dslaunch, the ``deepspeed``
compatibility distribution, transformers 5.23.0, accelerate 1.15.0, and for the fine-tuning tests
trl 1.16.0, peft 0.21.0, datasets 5.2.0; no real DeepSpeed); these tests start jobs with its
commands. Without it they skip and say why."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
VENV = ROOT / ".venv-compat"
SCRIPTS = Path(__file__).resolve().parent / "scripts"


def _venv_bin(stamp: str, failure: str, what: str) -> Path:
    """The compat venv's bin directory if ``stamp`` is there, or skip quoting ``failure``'s reason."""
    if not (VENV / stamp).exists():
        failed = VENV / failure
        why = failed.read_text().strip().splitlines()[-1:] if failed.exists() else ["not built"]
        pytest.skip(f"{what} could not be used ({' '.join(why)[:300]}); build it with `make compat-venv`")
    return VENV / "bin"


@pytest.fixture(scope="session")
def compat_bin() -> Path:
    """The compat venv's bin directory, or skip naming why it is missing."""
    return _venv_bin(".installed", "BUILD_FAILED", VENV.name)


@pytest.fixture(scope="session")
def finetune_bin(compat_bin: Path) -> Path:
    """The compat venv's bin directory with trl, peft and datasets, or skip naming why not."""
    return _venv_bin(".installed-finetune", "FINETUNE_FAILED", f"trl/peft/datasets in {VENV.name}")


def run_job(cmd: list[str], cwd: Path, timeout: float = 150) -> str:
    """Run a launcher command to its end; return its output, failing the test with it on error."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    env.pop("DS_ACCELERATOR", None)
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{' '.join(cmd[:4])} ... exited {proc.returncode}:\n{out[-4000:]}"
    return out


def tagged(out: str, tag: str) -> list:
    """The JSON after ``tag`` on rank 0's line (``[rank0] LOSSES [...]``)."""
    lines = [line for line in out.splitlines() if line.startswith(f"[rank0] {tag} ")]
    assert lines, f"no '{tag}' line from rank 0 in:\n{out[-3000:]}"
    return json.loads(lines[-1].split(f"{tag} ", 1)[1])
