"""DeepSpeed's ``deepspeed.inference``: ``init_inference``, ``InferenceEngine`` and the config
classes, with AutoTP (``auto_tp``), meta-device loading (``loading``) and the shared-memory
all-reduce (``shm_allreduce``)."""

from dslaunch.inference.config import (
    DeepSpeedInferenceConfig,
    DeepSpeedMoEConfig,
    DeepSpeedTPConfig,
    InferenceCheckpointConfig,
    QuantizationConfig,
)
from dslaunch.inference.engine import InferenceEngine, init_inference
from dslaunch.inference.loading import empty_init

__all__ = ["init_inference", "InferenceEngine", "DeepSpeedInferenceConfig", "DeepSpeedTPConfig",
           "InferenceCheckpointConfig", "QuantizationConfig", "DeepSpeedMoEConfig", "empty_init"]
