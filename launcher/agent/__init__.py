"""The node agent: starts one node's workers, streams their output, stops them as a gang.

Mechanism only, for any transport: ``node.py`` (the ``Agent`` and its worker states),
``procs.py`` (child setup, process groups, PDEATHSIG, exit codes), ``watchdog.py`` (a helper
process that kills every worker group if the agent dies), ``output.py`` (prefixed worker output,
pid and rank-log files created by ``dslaunch.safe_write``), ``channels.py`` (each worker's monitor
pipes: latest beat, stack text on request), ``spare.py`` (warm spare interpreters for restarts);
``remote.py``, the agent as its own process (``__main__.py``: ``python -m
dslaunch.launcher.agent``), and ``wire.py``, the lines it reports through; ``bootstrap.py``, the
command a transport starts on a host (look around for the preflight, then become the agent). What
a failure means for the job is decided by ``dslaunch.launcher.monitor``.

Nothing is imported here: the bootstrap must answer before the agent's modules load.
"""
