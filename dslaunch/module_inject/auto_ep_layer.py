"""``deepspeed.module_inject.auto_ep_layer``: ``AutoEPMoELayer``, a converted MoE block
(``dslaunch.runtime.moe.autoep.AutoEPMoE``); ``dist`` is ``deepspeed.comm``, as DeepSpeed's module
binds it (tests patch ``auto_ep_layer.dist.get_rank``)."""

from dslaunch import comm as dist
from dslaunch.runtime.moe.autoep import AutoEPMoE as AutoEPMoELayer

__all__ = ["AutoEPMoELayer", "dist"]
