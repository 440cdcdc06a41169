"""Job policy: what the nodes' news mean for the job.

Owns the gang loop (``gang``: the first failure anywhere stops every node; stop, then force-kill
after the grace period; the root cause and the job's exit code), the restart policy
(``restart``: restart, stop, or leave a lost host out; a pure ``decide`` over how each run ended)
and the job loop that applies it (``job``: run, decide, re-plan with a fresh port and the restart
count, run again; events through ``emit``). Runners and the agent only start, poll and stop.
"""
