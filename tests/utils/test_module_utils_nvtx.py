"""``deepspeed.utils.module_utils`` (``recursive_getattr/setattr``, DeepSpeed 0.19.8's home for what
``deepspeed.compression.helper`` still exports) and ``deepspeed.utils.nvtx.instrument_w_nvtx``."""

from __future__ import annotations

import pytest
import torch


@pytest.mark.timeout(30)
def test_submodules_by_dotted_name() -> None:
    from dslaunch.compression import helper
    from dslaunch.utils import module_utils

    assert helper.recursive_getattr is module_utils.recursive_getattr  # one implementation, two paths
    net = torch.nn.Sequential(torch.nn.Sequential(torch.nn.Linear(2, 2)), torch.nn.ReLU())
    assert module_utils.recursive_getattr(net, "0.0") is net[0][0]
    new = torch.nn.Linear(2, 3)
    module_utils.recursive_setattr(net, "0.0", new)
    module_utils.recursive_setattr(net, "1", torch.nn.Tanh())
    assert net[0][0] is new and isinstance(net[1], torch.nn.Tanh)
    with pytest.raises(AttributeError):
        module_utils.recursive_getattr(net, "0.missing")


@pytest.mark.timeout(30)
def test_instrument_w_nvtx_wraps_transparently() -> None:
    import dslaunch.utils as utils

    calls = []

    @utils.instrument_w_nvtx
    def step(x: int, *, scale: int = 1) -> int:
        """doc"""
        calls.append(x)
        if x < 0:
            raise ValueError("negative")
        return x * scale

    assert step(3, scale=2) == 6 and step.__name__ == "step" and step.__doc__ == "doc"
    with pytest.raises(ValueError, match="negative"):
        step(-1)
    assert calls == [3, -1] and utils.nvtx.instrument_w_nvtx is utils.instrument_w_nvtx
