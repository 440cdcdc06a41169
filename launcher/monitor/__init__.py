"""Job policy: what the nodes' news mean for the job.

Owns the gang loop (``gang.py``: the first failure anywhere stops every node; stop, then
force-kill after the grace period; the root cause and the job's exit code); the monitor of one
run, which the gang loop consults (``job.py``): ``health.py`` (heartbeats, the hang rule, who is
behind), ``failures.py`` (what a death's cause is, OOM remedies), ``events.py`` (the job's
``events.jsonl``, error and stack files) in the log directory ``logdir.py`` keeps safe,
``status.py`` (the live status line, ``dslaunch status``); the restart policy (``restart.py``:
restart, stop, or leave a lost host out; a pure ``decide`` over how each run ended) and the job
loop that applies it (``loop.py``: run, decide, re-plan with a fresh port and the restart count,
run again), and freeing the job's in-memory checkpoint stores when it ends (``memory_store.py``).
Runners and the agent only start, poll and stop.
"""
