"""Loss scaling for mixed precision, as a strategy the engine picks once.

Owns the three policies (the overflow itself is detected by the ZeRO strategy's step, below):

- ``DynamicLossScaler`` (``fp16`` with ``loss_scale: 0``): DeepSpeed's dynamic rules. Starts at
  ``2**initial_scale_power``. An overflowing step is skipped; it consumes one unit of hysteresis,
  and once hysteresis is down to 1 each overflow halves the scale (never below
  ``min_loss_scale``). After ``loss_scale_window`` consecutive clean updates the scale doubles
  and hysteresis is refilled. With ``consecutive_hysteresis`` every clean update refills it, so
  only *consecutive* overflows count against it. At ZeRO stage 0 the rules are those of DeepSpeed's
  stage-0 fp16 wrappers (``FP16_Optimizer``, ``FP16_UnfusedOptimizer``), which keep their own
  scale: every overflow halves it (``hysteresis`` and ``consecutive_hysteresis`` do not apply),
  down to ``min_loss_scale``, where the steps go on being skipped without an error.
- ``StaticLossScaler`` (``fp16.loss_scale > 0``): a fixed scale; overflowing steps are skipped.
- ``NoLossScaler`` (bf16, fp32): scale 1, nothing to do.

The engine multiplies the loss by ``loss_scale`` before backward; the ZeRO strategy's step divides
the gradients by it and reports an overflow (a non-finite global gradient norm, the same on every
rank); the engine calls ``update(overflow)`` once per optimizer step (boundary), skipping the step
when it overflowed. ``build_loss_scaler`` takes the ``fp16`` section parsed by ``load_config``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from dslaunch.runtime.config.sections import Fp16Config

__all__ = ["LossScaler", "DynamicLossScaler", "StaticLossScaler", "NoLossScaler", "LossScaleAtMinimumError",
           "build_loss_scaler"]


class LossScaleAtMinimumError(FloatingPointError):
    """Gradients still overflow at the minimum dynamic loss scale: training has diverged."""


class LossScaler:
    """The strategy interface: a scale, how to apply it, how it reacts to overflow."""

    #: True when the scale reacts to overflows (only then does a skipped step change it).
    dynamic: bool = False

    def __init__(self, scale: float = 1.0):
        self._scale = float(scale)

    @property
    def loss_scale(self) -> float:
        return self._scale

    @property
    def cur_scale(self) -> float:
        """The scale, under DeepSpeed's name (``engine.optimizer.cur_scale`` reads it)."""
        return self._scale

    @cur_scale.setter
    def cur_scale(self, value: float) -> None:
        self._scale = float(value)

    @property
    def dynamic_loss_scale(self) -> bool:
        """``dynamic`` under the name DeepSpeed's fp16 wrappers' ``loss_scale_config`` gives it."""
        return self.dynamic

    def scale_loss(self, loss: Any) -> Any:
        """``loss * loss_scale`` (the loss itself when the scale is 1, keeping the graph small)."""
        return loss if self._scale == 1.0 else loss * self._scale

    def update(self, overflow: bool) -> None:
        """Record one optimizer step's outcome (``overflow``: the step was skipped)."""

    def state_dict(self) -> dict[str, Any]:
        return {"cur_scale": self._scale}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self._scale = float(state["cur_scale"])

    def __repr__(self) -> str:
        return f"{type(self).__name__}(loss_scale={self._scale:g})"


class NoLossScaler(LossScaler):
    """bf16 and fp32: no scaling (scale 1.0)."""

    def __init__(self) -> None:
        super().__init__(1.0)


class StaticLossScaler(LossScaler):
    """A fixed scale (``fp16.loss_scale > 0``); overflowing steps are skipped, the scale stays."""

    def __init__(self, scale: float):
        if scale <= 0:
            raise ValueError(f"a static loss scale must be > 0, got {scale}")
        super().__init__(scale)


class DynamicLossScaler(LossScaler):
    """DeepSpeed's dynamic loss scaling (see the module docstring for the rules).

    Args:
        init_scale: first scale, ``2**initial_scale_power``.
        scale_window: clean updates between doublings (``loss_scale_window``).
        hysteresis: overflows absorbed before the scale is halved (``hysteresis``; DeepSpeed's
            ``delayed_shift``).
        consecutive_hysteresis: refill hysteresis after every clean update.
        min_scale: the scale is never halved below this (``min_loss_scale``).
        scale_factor: multiplier for growth and shrinkage (2).
        raise_error_at_min_scale: raise ``LossScaleAtMinimumError`` when an overflow would halve a
            scale already at ``min_scale`` (DeepSpeed's behaviour); otherwise keep skipping.
    """

    dynamic = True

    def __init__(self, init_scale: float = 2.0**16, scale_window: int = 1000, hysteresis: int = 2,
                 consecutive_hysteresis: bool = False, min_scale: float = 1.0, scale_factor: float = 2.0,
                 raise_error_at_min_scale: bool = True):
        if init_scale <= 0 or min_scale <= 0 or scale_window < 1 or hysteresis < 1 or scale_factor <= 1:
            raise ValueError("DynamicLossScaler needs init_scale > 0, min_scale > 0, scale_window >= 1, "
                             "hysteresis >= 1, scale_factor > 1")
        super().__init__(init_scale)
        self.scale_window = scale_window
        self.hysteresis = hysteresis
        self.consecutive_hysteresis = consecutive_hysteresis
        self.min_scale = float(min_scale)
        self.scale_factor = float(scale_factor)
        self.raise_error_at_min_scale = raise_error_at_min_scale
        self.cur_iter = 0
        self.last_overflow_iter = -1
        self.cur_hysteresis = hysteresis

    def update(self, overflow: bool) -> None:
        if overflow:
            self._on_overflow()
            self.last_overflow_iter = self.cur_iter
        else:
            self._on_clean_step()
        self.cur_iter += 1

    def _on_overflow(self) -> None:
        if self.cur_hysteresis > 1:  # absorb it, keep the scale
            self.cur_hysteresis -= 1
            return
        if self._scale <= self.min_scale and self.raise_error_at_min_scale:
            raise LossScaleAtMinimumError(
                f"gradients overflow (inf/nan) even at the minimum loss scale {self.min_scale:g} "
                "(fp16.min_loss_scale): the run has diverged; lower the learning rate, check the data, "
                "or use bf16")
        # min(): an initial scale already below the floor is never raised by an overflow.
        self._scale = max(self._scale / self.scale_factor, min(self.min_scale, self._scale))

    def _on_clean_step(self) -> None:
        if self.consecutive_hysteresis:
            self.cur_hysteresis = self.hysteresis
        # Clean updates since the last overflow, not counting this one.
        stable = self.cur_iter - self.last_overflow_iter - 1
        if stable > 0 and stable % self.scale_window == 0:
            self.cur_hysteresis = self.hysteresis
            self._scale *= self.scale_factor

    def state_dict(self) -> dict[str, Any]:
        return {"cur_scale": self._scale, "cur_iter": self.cur_iter, "last_overflow_iter": self.last_overflow_iter,
                "cur_hysteresis": self.cur_hysteresis}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        super().load_state_dict(state)
        self.cur_iter = int(state.get("cur_iter", 0))
        self.last_overflow_iter = int(state.get("last_overflow_iter", -1))
        self.cur_hysteresis = int(state.get("cur_hysteresis", self.hysteresis))


def build_loss_scaler(fp16: Fp16Config | None = None, stage0: bool = False) -> LossScaler:
    """The loss scaler for the parsed ``fp16`` section (``config.load_config`` validated it).

    Args:
        fp16: the ``fp16`` section; ``None`` (bf16/fp32) or ``enabled: false`` -> ``NoLossScaler``.
        stage0: ZeRO stage 0, where DeepSpeed's fp16 wrappers halve the scale at every overflow
            and never raise at ``min_loss_scale`` (module docstring).

    Returns:
        ``StaticLossScaler(loss_scale)`` when ``loss_scale > 0``, else a ``DynamicLossScaler`` from
        the section's values (its defaults are DeepSpeed's: initial_scale_power 16,
        loss_scale_window 1000, hysteresis 2, consecutive_hysteresis false, min_loss_scale 1).
    """
    if fp16 is None or not fp16.enabled:
        return NoLossScaler()
    if fp16.loss_scale > 0:
        return StaticLossScaler(fp16.loss_scale)
    return DynamicLossScaler(init_scale=2.0**fp16.initial_scale_power, scale_window=fp16.loss_scale_window,
                             hysteresis=1 if stage0 else fp16.hysteresis,
                             consecutive_hysteresis=fp16.consecutive_hysteresis and not stage0,
                             min_scale=fp16.min_loss_scale, raise_error_at_min_scale=not stage0)
