"""DeepSpeed's ``deepspeed.runtime.zero.offload_config`` path (``runtime/zero/config.py`` owns the names)."""

from dslaunch.runtime.zero.config import (
    DeepSpeedZeroOffloadOptimizerConfig,
    DeepSpeedZeroOffloadParamConfig,
    OffloadDeviceEnum,
)

__all__ = ["DeepSpeedZeroOffloadOptimizerConfig", "DeepSpeedZeroOffloadParamConfig", "OffloadDeviceEnum"]
