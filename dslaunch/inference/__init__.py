"""DeepSpeed's ``deepspeed.inference``: ``init_inference``, ``InferenceEngine``, the config classes
and ``empty_init``, implemented in ``dslaunch.runtime.inference``.

DeepSpeed's module paths, thin re-exports: ``config.py``, ``engine.py``; ``auto_tp.py`` and
``layers.py`` name AutoTP's planner and sharded layers (``dslaunch.runtime.tensor_parallel``).
"""

from dslaunch.runtime.inference.config import (
    DeepSpeedInferenceConfig,
    DeepSpeedMoEConfig,
    DeepSpeedTPConfig,
    InferenceCheckpointConfig,
    QuantizationConfig,
)
from dslaunch.runtime.inference.engine import InferenceEngine, init_inference
from dslaunch.runtime.inference.loading import empty_init

__all__ = ["init_inference", "InferenceEngine", "DeepSpeedInferenceConfig", "DeepSpeedTPConfig",
           "InferenceCheckpointConfig", "QuantizationConfig", "DeepSpeedMoEConfig", "empty_init"]
