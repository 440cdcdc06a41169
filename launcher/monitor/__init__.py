"""Job policy: what the nodes' news mean for the job.

``gang``: the loop over every node (the first failure anywhere stops every node; stop, then
force-kill after the grace period; the root cause and the job's exit code). ``job``: the monitor
of one run, which the loop consults: ``health`` (heartbeats, the hang rule, who is behind),
``failures`` (what a death's cause is, OOM remedies), ``events`` (the job's ``events.jsonl``,
error and stack files), ``status`` (the live status line, ``dslaunch status``). A restart budget
and elastic membership belong here too: runners and the agent only start, poll and stop.
"""
