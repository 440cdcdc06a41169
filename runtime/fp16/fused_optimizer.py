"""``deepspeed.runtime.fp16.fused_optimizer``: ``FP16_Optimizer``, ``engine.optimizer`` at ZeRO stage 0
with fp16 over a fused Adam (``runtime/zero/optimizer_view.py``); making one by hand is refused."""

from dslaunch.runtime.zero.optimizer_view import FP16_Optimizer

__all__ = ["FP16_Optimizer"]
