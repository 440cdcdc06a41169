"""DeepSpeed's ``deepspeed.runtime.fp16.loss_scaler``: its loss-scaler classes, on dslaunch's rules.

Scripts import these for two things. Some drive a scaler by hand (``scale_loss``, ``backward``,
``update_scale(overflow)``, ``cur_scale``). Many only list them for ``torch.load(weights_only=True)``:
DeepSpeed pickles its ``LossScaler`` into every ZeRO optimizer file, so loading one needs
``torch.serialization.add_safe_globals([LossScaler, ZeroStageEnum, fragment_address])``. torch
matches an allowed class by its module and name, so these classes carry DeepSpeed's module name
(``deepspeed.runtime.fp16.loss_scaler``) and read DeepSpeed's pickled attributes (``__setstate__``);
pickling one writes DeepSpeed's attributes under DeepSpeed's name, as DeepSpeed's files do.

The scaling rules are dslaunch's (``runtime/precision/loss_scaler.py``, DeepSpeed's rules): these
classes only add DeepSpeed's constructor signatures and attribute names.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

from dslaunch.runtime.precision import loss_scaler as rules
from dslaunch.runtime.utils import grads_overflow

__all__ = ["LossScalerBase", "LossScaler", "DynamicLossScaler", "CreateLossScaler", "to_python_float",
           "INITIAL_LOSS_SCALE", "SCALE_WINDOW", "DELAYED_SHIFT", "CONSECUTIVE_HYSTERESIS", "MIN_LOSS_SCALE"]

# the keys of DeepSpeed's ``dynamic_loss_args`` (``engine.dynamic_loss_scale_args()``)
INITIAL_LOSS_SCALE, SCALE_WINDOW, DELAYED_SHIFT = "init_scale", "scale_window", "delayed_shift"
CONSECUTIVE_HYSTERESIS, MIN_LOSS_SCALE = "consecutive_hysteresis", "min_scale"

_DEEPSPEED_MODULE = "deepspeed.runtime.fp16.loss_scaler"


def to_python_float(t: Any) -> float:
    """A one-element tensor (or sequence) as a Python number."""
    return t.item() if hasattr(t, "item") else t[0]


class LossScalerBase(rules.LossScaler):
    """DeepSpeed's base: ``cur_scale`` (dslaunch's scalers have it), ``dynamic`` (the class's, or a
    loaded file's), ``scale_loss``, ``backward``, ``update_scale``."""

    def scale_gradient(self, module: Any, grad_in: tuple, grad_out: tuple) -> tuple:
        """A backward hook's answer: every input gradient times the scale."""
        return tuple(self.loss_scale * g for g in grad_in)

    def scale_loss(self, loss: Any) -> Any:
        return loss * self.loss_scale

    def backward(self, loss: torch.Tensor, retain_graph: bool = False) -> None:
        self.scale_loss(loss).backward(retain_graph=retain_graph)

    def update_scale(self, overflow: bool) -> None:
        self.update(overflow)

    def __getstate__(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self._DEEPSPEED_ATTRIBUTES}

    def __setstate__(self, state: Mapping[str, Any]) -> None:
        # DeepSpeed's attribute names; properties map the ones dslaunch stores under its own
        for name, value in state.items():
            setattr(self, name, value)

    _DEEPSPEED_ATTRIBUTES: tuple[str, ...] = ("cur_scale", "dynamic")


class LossScaler(LossScalerBase):
    """DeepSpeed's static scaler: ``LossScaler(scale=1)``; it never sees an overflow."""

    def __init__(self, scale: float = 1):
        super().__init__(scale)

    def has_overflow(self, params: Iterable[torch.nn.Parameter]) -> bool:
        return False


class DynamicLossScaler(LossScalerBase, rules.DynamicLossScaler):
    """DeepSpeed's dynamic scaler, with its signature (``delayed_shift`` is the hysteresis)."""

    def __init__(self, init_scale: float, scale_window: int, min_scale: float, delayed_shift: int,
                 consecutive_hysteresis: bool, raise_error_at_min_scale: bool = True,
                 dtype: torch.dtype = torch.half):
        rules.DynamicLossScaler.__init__(self, init_scale=init_scale, scale_window=scale_window,
                                         hysteresis=delayed_shift, consecutive_hysteresis=consecutive_hysteresis,
                                         min_scale=min_scale, raise_error_at_min_scale=raise_error_at_min_scale)
        self.dtype = dtype

    @property
    def delayed_shift(self) -> int:
        return self.hysteresis

    @delayed_shift.setter
    def delayed_shift(self, value: int) -> None:
        self.hysteresis = value

    def has_overflow_serial(self, params: Iterable[torch.nn.Parameter]) -> bool:
        """``grads_overflow``: whether any gradient holds an inf or a NaN (this rank's only)."""
        return grads_overflow(params)

    _DEEPSPEED_ATTRIBUTES = ("cur_scale", "dynamic", "cur_iter", "last_overflow_iter", "scale_factor",
                             "scale_window", "min_scale", "delayed_shift", "cur_hysteresis",
                             "consecutive_hysteresis", "raise_error_at_min_scale", "dtype")


def CreateLossScaler(dtype: torch.dtype, static_loss_scale: float, dynamic_scaling: bool,  # noqa: N802 (DeepSpeed's)
                     dynamic_loss_args: Mapping[str, Any] | None) -> LossScalerBase:
    """DeepSpeed's factory: dynamic for fp16 with ``dynamic_scaling``, else static (1 unless fp16)."""
    if dtype == torch.half and dynamic_scaling:
        if dynamic_loss_args is None:
            raise ValueError("CreateLossScaler: dynamic loss scaling needs dynamic_loss_args "
                             "(init_scale, scale_window, min_scale, delayed_shift, consecutive_hysteresis)")
        return DynamicLossScaler(dtype=dtype, **dynamic_loss_args)
    return LossScaler(scale=static_loss_scale if dtype == torch.half else 1.0)


for _cls in (LossScalerBase, LossScaler, DynamicLossScaler):
    _cls.__module__ = _DEEPSPEED_MODULE  # torch's add_safe_globals matches DeepSpeed's files by this name
