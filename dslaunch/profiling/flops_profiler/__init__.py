"""``deepspeed.profiling.flops_profiler`` under dslaunch's name.

``FlopsProfiler``, ``get_model_profile`` and the number formatters (DeepSpeed's names), defined
in ``profiler.py`` / ``report.py``; the counting is ``counter.py``'s (aten operators), achieved
FLOP/s and MFU ``mfu.py``'s (``throughput``), the engine's ``flops_profiler`` block
``observer.py``'s. Importing this module imports torch.
"""

from dslaunch.profiling.flops_profiler.mfu import Throughput, peak_flops, throughput
from dslaunch.profiling.flops_profiler.profiler import FlopsProfiler, get_model_profile
from dslaunch.profiling.flops_profiler.report import (
    duration_to_string,
    flops_to_string,
    macs_to_string,
    number_to_string,
    params_to_string,
)

__all__ = ["FlopsProfiler", "get_model_profile", "throughput", "peak_flops", "Throughput", "number_to_string",
           "flops_to_string", "macs_to_string", "params_to_string", "duration_to_string"]
