"""DeepSpeed's ``deepspeed.profiling.flops_profiler.profiler``: ``FlopsProfiler``,
``get_model_profile`` and the number formatters, which live in ``dslaunch.runtime.profiling``."""

from dslaunch.runtime.profiling.profiler import FlopsProfiler, get_model_profile
from dslaunch.runtime.profiling.report import (
    duration_to_string,
    flops_to_string,
    macs_to_string,
    number_to_string,
    params_to_string,
)

__all__ = ["FlopsProfiler", "get_model_profile", "number_to_string", "flops_to_string", "macs_to_string",
           "params_to_string", "duration_to_string"]
