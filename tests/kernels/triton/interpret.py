"""Helpers of the Triton kernel tests: load a kernel module interpreted, compare with tolerances.

The tests call the kernels directly: the dispatch point only picks them on CUDA devices.
"""

from __future__ import annotations

import importlib
from types import ModuleType

import pytest
import torch

# Max error relative to max(1, max |reference|), against torch in fp64: fp32 a few ulps of
# accumulation order; bf16/fp16 four ulps of the output's rounding (the kernels compute in fp32).
TOLERANCE = {torch.float32: 1e-5, torch.float16: 4 * 2.0**-11, torch.bfloat16: 4 * 2.0**-8}


def kernel_module(name: str) -> ModuleType:
    """``dslaunch.kernels.triton.<name>``, interpreted; skip when triton is not installed."""
    pytest.importorskip("triton", reason="triton is not installed (make setup installs the 'triton' extra)")
    from triton.runtime.interpreter import InterpretedFunction

    module = importlib.import_module(f"dslaunch.kernels.triton.{name}")
    jitted = [v for k, v in vars(module).items() if k.startswith("_") and hasattr(v, "fn")]
    assert jitted and all(isinstance(k, InterpretedFunction) for k in jitted), (
        f"{module.__name__} was imported before TRITON_INTERPRET=1 was set: its kernels are compiled for a GPU")
    return module


def max_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest absolute difference, relative to max(1, the largest |want|); 0 for empty tensors."""
    assert got.shape == want.shape, (got.shape, want.shape)
    if want.numel() == 0:
        return 0.0
    got, want = got.detach().double(), want.detach().double()
    return float((got - want).abs().max() / max(1.0, float(want.abs().max())))
