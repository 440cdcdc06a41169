"""The launcher: from the ``dslaunch`` command line to workers running on every node.

Owns ``cli/`` (one module per command), ``plan`` (command line + hostfile -> ``JobSpec``),
``spec`` (the frozen job, node and worker specs), ``hostfile``, ``envfile``, ``gpus``,
``ports``, ``workerenv`` (every variable a worker gets, decided in one place), ``agent/`` (starts
and stops one node's workers), ``monitor/`` (job policy: the gang loop) and ``runners/``
(transports: local, ssh).
"""
