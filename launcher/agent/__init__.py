"""The node agent: starts one node's workers, streams their output, stops them as a gang.

Mechanism only, for any transport: ``node`` (the ``Agent`` and its worker states), ``procs``
(process groups, PDEATHSIG, the watchdog), ``output`` (prefixed worker output), pid
and rank-log files (created by ``dslaunch.safe_write``); ``remote``, the agent as its own process, and ``wire``, the
lines it reports through; ``bootstrap``, the command a transport starts on a host (look around
for the preflight, then become the agent). What a failure means for the job is
decided by ``dslaunch.launcher.monitor``.

Nothing is imported here: the bootstrap must answer before the agent's modules load.
"""
