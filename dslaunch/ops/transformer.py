"""``deepspeed.ops.transformer``: DeepSpeed's fused training transformer layer and its config,
implemented in ``dslaunch.kernels.transformer`` and ``dslaunch.kernels.transformer_config``."""

from dslaunch.kernels.transformer import DeepSpeedTransformerLayer
from dslaunch.kernels.transformer_config import DeepSpeedTransformerConfig

__all__ = ["DeepSpeedTransformerLayer", "DeepSpeedTransformerConfig"]
