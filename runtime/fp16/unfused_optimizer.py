"""``deepspeed.runtime.fp16.unfused_optimizer``: ``FP16_UnfusedOptimizer``, ``engine.optimizer`` at ZeRO
stage 0 with fp16 over any other optimizer (``runtime/zero/optimizer_view.py``); making one by hand is
refused."""

from dslaunch.runtime.zero.optimizer_view import FP16_UnfusedOptimizer

__all__ = ["FP16_UnfusedOptimizer"]
