"""DeepSpeed's ``deepspeed.runtime.zero.offload_config`` path (``runtime/zero/config.py`` owns the names)."""

from dslaunch.runtime.zero.config import (
    DeepSpeedZeroOffloadOptimizerConfig,
    DeepSpeedZeroOffloadParamConfig,
    OffloadDeviceEnum,
    OffloadStateTypeEnum,
)

__all__ = ["DeepSpeedZeroOffloadOptimizerConfig", "DeepSpeedZeroOffloadParamConfig", "OffloadDeviceEnum",
           "OffloadStateTypeEnum"]
