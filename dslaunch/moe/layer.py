"""``deepspeed.moe.layer``: ``MoE`` imports fine and refuses to be built (``dslaunch.runtime.moe``)."""

from dslaunch.runtime.moe import MoE

__all__ = ["MoE"]
