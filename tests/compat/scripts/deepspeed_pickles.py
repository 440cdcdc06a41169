"""Writes a file as DeepSpeed 0.19.8 pickles its ZeRO optimizer state, without DeepSpeed: stand-in
classes under DeepSpeed's module names with DeepSpeed's attributes, so the pickle has the same
globals and opcodes (checked against real DeepSpeed 0.19.8's pickles of the same four classes).

Usage: python deepspeed_pickles.py OUT.pt
"""

from __future__ import annotations

import dataclasses
import enum
import sys
import types

import torch


def _module(name: str, **members: object) -> None:
    parts = name.split(".")
    for i in range(1, len(parts)):  # the parents, so that pickle can import the name
        sys.modules.setdefault(".".join(parts[:i]), types.ModuleType(".".join(parts[:i])))
    module = types.ModuleType(name)
    for key, value in members.items():
        value.__module__ = name
        setattr(module, key, value)
    sys.modules[name] = module


class LossScaler:
    def __init__(self, scale: float):
        self.cur_scale, self.dynamic = scale, False


class DynamicLossScaler:
    def __init__(self, init_scale: float, scale_window: int, min_scale: float, delayed_shift: int,
                 consecutive_hysteresis: bool):
        self.cur_scale, self.cur_iter, self.last_overflow_iter, self.scale_factor = init_scale, 7, 5, 2.0
        self.scale_window, self.min_scale, self.delayed_shift, self.cur_hysteresis = scale_window, min_scale, delayed_shift, 1
        self.consecutive_hysteresis, self.raise_error_at_min_scale, self.dynamic = consecutive_hysteresis, True, True
        self.dtype = torch.half


class ZeroStageEnum(int, enum.Enum):
    disabled, optimizer_states, gradients, weights = 0, 1, 2, 3


@dataclasses.dataclass
class fragment_address:  # noqa: N801 (DeepSpeed's name)
    numel: int
    start: int


def main(out: str) -> None:
    for name in [m for m in sys.modules if m == "deepspeed" or m.startswith("deepspeed.")]:
        del sys.modules[name]  # never a real DeepSpeed's modules
    _module("deepspeed.runtime.fp16.loss_scaler", LossScaler=LossScaler, DynamicLossScaler=DynamicLossScaler)
    _module("deepspeed.runtime.zero.config", ZeroStageEnum=ZeroStageEnum)
    _module("deepspeed.utils.tensor_fragment", fragment_address=fragment_address)
    torch.save({"zero_stage": ZeroStageEnum.gradients, "loss_scaler": LossScaler(128.0),
                "dynamic": DynamicLossScaler(2.0**16, 500, 1.0, 2, True),
                "param_slice_mappings": [{"w": fragment_address(numel=3, start=4)}],
                "single_partition_of_fp32_groups": [torch.arange(4.0)]}, out)


if __name__ == "__main__":
    main(sys.argv[1])
