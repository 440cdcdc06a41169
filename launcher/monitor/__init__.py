"""Job policy: what the nodes' news mean for the job.

Owns the gang loop today (``gang``: the first failure anywhere stops every node; stop, then
force-kill after the grace period; the root cause and the job's exit code). Health checks, a
restart budget and elastic membership belong here too: runners and the agent only start, poll
and stop.
"""
