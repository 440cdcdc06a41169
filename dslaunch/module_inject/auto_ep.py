"""``deepspeed.module_inject.auto_ep``: ``AutoEP``, which finds and converts a Hugging Face MoE
model's blocks (``dslaunch.runtime.moe.autoep``)."""

from dslaunch.runtime.moe.autoep import AutoEP

__all__ = ["AutoEP"]
