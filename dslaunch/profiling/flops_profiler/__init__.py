"""DeepSpeed's ``deepspeed.profiling.flops_profiler``, implemented in ``dslaunch.runtime.profiling``.

``profiler.py`` is DeepSpeed's path of ``FlopsProfiler``, ``get_model_profile`` and the number
formatters. ``FlopsProfiler`` and ``get_model_profile`` are imported when first used: their
counter pulls in torch's flop formulas (~1 s), which the engine's live MFU
(``dslaunch.runtime.profiling.mfu`` only) should not pay at every start.
"""

from typing import Any

from dslaunch.runtime.profiling.mfu import Throughput, peak_flops, throughput
from dslaunch.runtime.profiling.report import (
    duration_to_string,
    flops_to_string,
    macs_to_string,
    number_to_string,
    params_to_string,
)

__all__ = ["FlopsProfiler", "get_model_profile", "throughput", "peak_flops", "Throughput", "number_to_string",
           "flops_to_string", "macs_to_string", "params_to_string", "duration_to_string"]


def __getattr__(name: str) -> Any:
    if name in ("FlopsProfiler", "get_model_profile"):
        from dslaunch.profiling.flops_profiler import profiler

        return getattr(profiler, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
