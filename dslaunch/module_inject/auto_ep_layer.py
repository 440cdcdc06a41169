"""``deepspeed.module_inject.auto_ep_layer``: ``AutoEPMoELayer``, a converted MoE block
(``dslaunch.runtime.moe.autoep.AutoEPMoE``)."""

from dslaunch.runtime.moe.autoep import AutoEPMoE as AutoEPMoELayer

__all__ = ["AutoEPMoELayer"]
