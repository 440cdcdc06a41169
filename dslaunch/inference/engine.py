"""DeepSpeed's ``deepspeed.inference.engine``: ``InferenceEngine``, which lives in
``dslaunch.runtime.inference.engine``."""

from dslaunch.runtime.inference.engine import InferenceEngine, init_inference

__all__ = ["InferenceEngine", "init_inference"]
