"""The data-efficiency tests' shared fixture: what real DeepSpeed makes of ``reference_data``."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from dslaunch.utils.ports import free_port
from tests.deepspeed_reference import run_python


@pytest.fixture(scope="session")
def deepspeed_out(deepspeed_python: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """DeepSpeed's files and results (``ds_reference.py``), once per session; skips without its venv."""
    python = deepspeed_python
    out = tmp_path_factory.mktemp("deepspeed")
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port()), "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "PYTHONPATH": ""}
    done = run_python(python, [str(Path(__file__).with_name("ds_reference.py")), str(out)], env, timeout=150)
    assert done.returncode == 0, done.stderr[-3000:]
    return out
