"""DeepSpeed's ``deepspeed.inference.config``: the ``init_inference`` configuration classes, which
live in ``dslaunch.runtime.inference.config``."""

from dslaunch.runtime.inference.config import (
    DeepSpeedInferenceConfig,
    DeepSpeedMoEConfig,
    DeepSpeedTPConfig,
    InferenceCheckpointConfig,
    QuantizationConfig,
    WeightQuantConfig,
)

__all__ = ["DeepSpeedInferenceConfig", "DeepSpeedTPConfig", "InferenceCheckpointConfig", "QuantizationConfig",
           "WeightQuantConfig", "DeepSpeedMoEConfig"]
