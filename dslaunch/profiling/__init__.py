"""``deepspeed.profiling``: the flops profiler (``flops_profiler/``, implemented in
``dslaunch.runtime.profiling``).
"""
