"""``get_accelerator()`` on a machine without GPUs: DeepSpeed's CPU accelerator answers."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from dslaunch.accelerator import get_accelerator


def test_cpu_accelerator_answers_as_deepspeeds(monkeypatch: pytest.MonkeyPatch) -> None:
    if torch.cuda.is_available():
        pytest.skip("a GPU machine: the accelerator is CUDA")
    monkeypatch.setenv("LOCAL_RANK", "1")
    acc = get_accelerator()
    assert acc is get_accelerator()  # one per process, as DeepSpeed's
    assert acc.device_name() == acc.device_name(3) == acc.current_device_name() == "cpu"
    assert acc.current_device() == "1"  # DeepSpeed's CPU accelerator returns LOCAL_RANK as is
    assert acc.communication_backend_name() == "gloo" and acc.is_bf16_supported()
    assert acc.is_available() and acc.is_synchronized_device() and acc.Stream is None
    acc.synchronize()
    acc.empty_cache()
    big = torch.ones(8 << 20)  # 32 MiB more resident memory
    assert acc.max_memory_allocated() >= acc.memory_allocated() > big.numel()
    assert acc.total_memory() >= acc.available_memory() > 0
    assert acc.on_accelerator(big) and acc.FloatTensor is torch.FloatTensor
    assert torch.float32 in acc.supported_dtypes() and torch.bfloat16 in acc.supported_dtypes()
    assert acc.get_op_builder("CPUAdamBuilder") is None
    acc.manual_seed(3)
    assert acc.initial_seed() == 3


def test_unsupported_ds_accelerator_is_one_line() -> None:
    code = "from dslaunch.accelerator import get_accelerator; get_accelerator()"
    proc = subprocess.run([sys.executable, "-c", code], env={"DS_ACCELERATOR": "xpu", "PATH": ""},
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    assert "DS_ACCELERATOR='xpu': dslaunch drives only cpu and cuda" in proc.stderr
