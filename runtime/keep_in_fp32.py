"""DeepSpeed's ``deepspeed.runtime.keep_in_fp32`` import path: the buffers a 16-bit model keeps in
fp32 (``data_types.keep_in_fp32_modules``), implemented in ``runtime/precision/keep_in_fp32.py``."""

from dslaunch.runtime.precision.keep_in_fp32 import (
    KEEP_IN_FP32_AUTO,
    buffers_to_keep_in_fp32,
    keep_buffers_in_fp32,
    keep_in_fp32_pattern,
)

__all__ = ["KEEP_IN_FP32_AUTO", "keep_in_fp32_pattern", "buffers_to_keep_in_fp32", "keep_buffers_in_fp32"]
