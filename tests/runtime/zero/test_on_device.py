"""``deepspeed.OnDevice``: modules built inside are made on the device, floats in the dtype."""

from __future__ import annotations

import pytest
import torch

from dslaunch.runtime.zero.partition_parameters import OnDevice

pytestmark = pytest.mark.timeout(30)


def test_modules_are_built_on_the_device_in_the_dtype_and_torch_is_restored() -> None:
    empty = torch.empty
    with OnDevice(dtype=torch.bfloat16, device="meta"):
        layer = torch.nn.Linear(1000, 1000)
        index = torch.arange(3)  # not floating point: the dtype is left alone
    assert layer.weight.device.type == "meta" and layer.weight.dtype == torch.bfloat16
    assert index.dtype == torch.int64 and index.device.type == "meta"
    assert isinstance(layer.weight, torch.nn.Parameter)
    assert torch.empty is empty and torch.nn.Linear(2, 2).weight.device.type == "cpu"


def test_disabled_is_a_no_op() -> None:
    with OnDevice(dtype=torch.float16, device="meta", enabled=False):
        layer = torch.nn.Linear(2, 2)
    assert layer.weight.device.type == "cpu" and layer.weight.dtype == torch.float32
