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


def test_set_accelerator_picks_the_kind_for_this_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """DeepSpeed's ``set_accelerator(CPU_Accelerator())`` (its MoE test utilities call it):
    later ``get_accelerator()`` calls answer that kind, here and in processes started after it;
    anything but one of dslaunch's accelerators is refused in one line."""
    from dslaunch.accelerator import set_accelerator
    from dslaunch.accelerator.cpu_accelerator import CPU_Accelerator
    from dslaunch.accelerator.cuda_accelerator import CUDA_Accelerator
    from dslaunch.errors import UsageError

    monkeypatch.delenv("DS_ACCELERATOR", raising=False)
    set_accelerator(CUDA_Accelerator())  # no GPU needed to choose it; using it would need one
    assert get_accelerator()._name == "cuda" and get_accelerator().communication_backend_name() == "nccl"
    set_accelerator(CPU_Accelerator())
    assert get_accelerator()._name == "cpu" and get_accelerator().device_name() == "cpu"
    child = subprocess.run([sys.executable, "-c", "from dslaunch.accelerator import get_accelerator as g; "
                            "print(g()._name)"], capture_output=True, text=True, check=True, timeout=60)
    assert child.stdout.strip() == "cpu"
    with pytest.raises(UsageError, match="dslaunch drives only its CPU and CUDA accelerators"):
        set_accelerator(object())  # type: ignore[arg-type]
    monkeypatch.delenv("DS_ACCELERATOR")
    get_accelerator.cache_clear()  # later tests detect the hardware again
