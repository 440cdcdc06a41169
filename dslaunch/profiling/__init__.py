"""``deepspeed.profiling``: the flops profiler (``dslaunch.profiling.flops_profiler``)."""
