"""The flops profiler and MFU (DeepSpeed's ``deepspeed.profiling.flops_profiler`` re-exports it).

``counter.py`` (flops of the aten operators a step ran, attributed to modules), ``formulas.py``
(each operator's flops from its recorded shapes), ``profiler.py`` (``FlopsProfiler``,
``get_model_profile``), ``report.py`` (the profile's tables and number formatters), ``mfu.py``
(achieved FLOP/s and MFU against the device's peak), ``observer.py`` (the engine's
``flops_profiler`` block). Importing this package imports nothing: ``counter.py`` pulls in
torch's flop formulas (~1 s), which the engine's live MFU (``mfu.py`` only) should not pay at
every start.
"""
