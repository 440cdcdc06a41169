"""``deepspeed.module_inject.replace_policy``: DeepSpeed's per-architecture injection policies.

``HFBertLayerPolicy`` (where a BERT layer keeps the fused training layer's weights) is
``dslaunch.runtime.transformer_policy``; the other policies serve DeepSpeed's inference kernel
injection and are refused on use: dslaunch's ``init_inference`` finds the layers to shard itself
(``injection_policy`` takes layer names, ``dslaunch.runtime.tensor_parallel.auto_tp``)."""

from dslaunch.runtime.transformer_policy import HFBertLayerPolicy
from dslaunch.utils.refused import Refusal, refuse

KERNEL_INJECTION = Refusal(
    "DeepSpeed's per-architecture inference kernel injection (replace policies)",
    "use deepspeed.init_inference(model, tensor_parallel=..., replace_with_kernel_inject=...) on the model")

_REFUSED = ("HFGPT2LayerPolicy", "HFGPTJLayerPolicy", "HFGPTNEOLayerPolicy",
            "GPTNEOXLayerPolicy", "HFOPTLayerPolicy", "MegatronLayerPolicy", "BLOOMLayerPolicy",
            "LLAMALayerPolicy", "DSPolicy", "TransformerPolicy")
globals().update(refuse(__name__, _REFUSED, KERNEL_INJECTION))

__all__ = ["KERNEL_INJECTION", "HFBertLayerPolicy", *_REFUSED]
