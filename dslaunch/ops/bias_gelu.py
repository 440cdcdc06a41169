"""DeepSpeed's ``deepspeed.ops`` path of the fused bias + GeLU (+ dropout): ``bias_gelu`` and
``BiasGeLU``, implemented in ``dslaunch.kernels.bias_gelu``."""

from dslaunch.kernels.bias_gelu import BiasGeLU, bias_gelu

__all__ = ["bias_gelu", "BiasGeLU"]
