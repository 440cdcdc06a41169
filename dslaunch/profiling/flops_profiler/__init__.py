"""``deepspeed.profiling.flops_profiler`` under dslaunch's name.

``FlopsProfiler``, ``get_model_profile`` and the number formatters (DeepSpeed's names), defined
in ``profiler.py`` / ``report.py``; the counting is ``counter.py``'s (aten operators), achieved
FLOP/s and MFU ``mfu.py``'s (``throughput``), the engine's ``flops_profiler`` block
``observer.py``'s. Importing this module imports torch; ``FlopsProfiler`` and
``get_model_profile`` are imported when first used: their counter pulls in torch's flop formulas
(~1 s), which the engine's live MFU (``mfu.py`` only) should not pay at every start.
"""

from typing import Any

from dslaunch.profiling.flops_profiler.mfu import Throughput, peak_flops, throughput
from dslaunch.profiling.flops_profiler.report import (
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
