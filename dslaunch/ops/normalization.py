"""DeepSpeed's ``deepspeed.ops`` path of the fused LayerNorm and RMSNorm (apex's class names),
implemented in ``dslaunch.kernels.normalization``."""

from dslaunch.kernels.normalization import (
    FUSED_MIN_FEATURES,
    FusedLayerNorm,
    FusedRMSNorm,
    layer_norm,
    rms_norm,
)

__all__ = ["layer_norm", "rms_norm", "FusedLayerNorm", "FusedRMSNorm", "FUSED_MIN_FEATURES"]
