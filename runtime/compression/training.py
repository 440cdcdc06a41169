"""What the engine does for ``compression_training`` each step (DeepSpeed's engine does the same
inline): before the forwards of step 0 switch on what is due at step 0; after each optimizer step
quantize the scheduled weights (MoQ, when ``quantize_weight_in_forward`` is false) and, unless the
step overflowed, advance the scheduler.
"""

from __future__ import annotations

from torch import nn

from dslaunch.errors import ConfigError
from dslaunch.runtime.compression.scheduler import CompressionScheduler
from dslaunch.runtime.config.compression import CompressionConfig
from dslaunch.runtime.quantize import Quantizer

__all__ = ["CompressionTraining", "moq_quantizer"]

_IN_FORWARD = "compression_training.weight_quantization.shared_parameters.quantize_weight_in_forward"


def moq_quantizer(config: CompressionConfig, fp16: bool, zero_stage: int) -> Quantizer | None:
    """The optimizer-step quantizer the block asks for, or None.

    Raises:
        ConfigError: it is asked for without fp16 (DeepSpeed asserts the same) or at ZeRO stage 3
            (each rank holds only a shard of a weight, and the groups span whole weights).
    """
    wq = config.technique("weight_quantization")
    if not wq.enabled or wq.shared["quantize_weight_in_forward"]:
        return None
    if not fp16:
        raise ConfigError("is false, which quantizes the fp16 weights after each optimizer step (MoQ): that needs "
                          "fp16.enabled; enable fp16 or set it to true (fake-quantize in forward)", key=_IN_FORWARD)
    if zero_stage == 3:
        raise ConfigError("is false, which quantizes whole weights after each step; ZeRO stage 3 holds shards: set it "
                          "to true or use stage 0-2", key=_IN_FORWARD)
    s = wq.shared
    mixed = s["fp16_mixed_quantize"]
    return Quantizer(s["quantize_groups"], mixed["enabled"], mixed["quantize_change_ratio"], s["quantization_type"],
                     s["rounding"], s["quantize_verbose"])


class CompressionTraining:
    """The scheduler and the MoQ quantizer of one engine's module.

    Args:
        module: the engine's model (after ``init_compression``).
        config: the parsed ``compression_training`` block.
        fp16: whether the engine trains in fp16.
        zero_stage: the ZeRO stage.

    Raises:
        ConfigError: as ``moq_quantizer``.
    """

    def __init__(self, module: nn.Module, config: CompressionConfig, fp16: bool, zero_stage: int):
        self.module = module
        self.scheduler = CompressionScheduler(module, config)
        self.quantizer = moq_quantizer(config, fp16, zero_stage)

    def _quantize(self, overflow: bool) -> None:
        if self.quantizer is not None and self.scheduler.weight_quantization_enabled:
            self.quantizer.quantize([[p for p in self.module.parameters() if p.requires_grad]], overflow)

    def before_forward(self, global_steps: int) -> None:
        """Every forward before the first optimizer step (as DeepSpeed's): techniques due at step 0
        on, and their weights quantized."""
        if global_steps == 0:
            self.scheduler.step(step_zero_check=True)
            self._quantize(False)

    def resume(self, applied_steps: int) -> None:
        """After a checkpoint load: the scheduler counts on from the run's applied optimizer steps,
        and what is due by then is on (DeepSpeed's scheduler starts again from 0)."""
        self.scheduler.training_steps = applied_steps
        if applied_steps:
            self.scheduler.check_all_modules(resumed=True)

    def after_step(self, overflow: bool) -> None:
        """After an optimizer step: quantize (unless it overflowed), then count it (if applied)."""
        self._quantize(overflow)
        if not overflow:
            self.scheduler.step()
