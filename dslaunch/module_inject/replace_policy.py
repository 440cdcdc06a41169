"""``deepspeed.module_inject.replace_policy``: DeepSpeed's per-architecture kernel-injection
policies, refused on use. dslaunch's ``init_inference`` finds the layers to shard itself
(``injection_policy`` takes layer names, ``dslaunch.runtime.tensor_parallel.auto_tp``)."""

from dslaunch.utils.refused import Refusal, refuse

KERNEL_INJECTION = Refusal(
    "DeepSpeed's per-architecture kernel injection (replace policies, replace_transformer_layer)",
    "use deepspeed.init_inference(model, tensor_parallel=..., replace_with_kernel_inject=...) on the model")

_REFUSED = ("HFGPT2LayerPolicy", "HFBertLayerPolicy", "HFGPTJLayerPolicy", "HFGPTNEOLayerPolicy",
            "GPTNEOXLayerPolicy", "HFOPTLayerPolicy", "MegatronLayerPolicy", "BLOOMLayerPolicy",
            "LLAMALayerPolicy", "DSPolicy", "TransformerPolicy")
globals().update(refuse(__name__, _REFUSED, KERNEL_INJECTION))

__all__ = ["KERNEL_INJECTION", *_REFUSED]
