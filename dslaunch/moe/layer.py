"""``deepspeed.moe.layer``: ``MoE``, the mixture-of-experts layer (``dslaunch.runtime.moe.layer``)."""

from dslaunch.runtime.moe.layer import MoE

__all__ = ["MoE"]
