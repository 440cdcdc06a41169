"""The launcher: from the ``dslaunch`` command line to workers running on every node.

Owns ``cli/`` (one module per command), ``plan.py`` (command line + hostfile -> ``JobSpec``),
``spec.py`` (the frozen job, node and worker specs), ``hostfile.py`` (DeepSpeed's hostfile syntax,
``--include``/``--exclude``), ``envfile.py`` (exported variables, ``.deepspeed_env``), ``gpus.py``
(local accelerators), ``ports.py`` (is the rendezvous port free), ``log_level.py`` (which of the launcher's own
lines are printed: ``--log_level``, ``-q``), ``workerenv.py`` (every variable
a worker gets, decided in one place), ``agent/`` (starts and stops one node's workers),
``monitor/`` (job policy: the gang loop, restarts), ``runners/`` (transports: local, ssh, slurm,
mpi), ``kubernetes.py`` (a pod as a ``--no_ssh`` node, ``dslaunch k8s manifest``),
``autotuning/`` (``dslaunch --autotuning``) and ``env_report.py`` (``dslaunch report``, DeepSpeed's
``ds_report``). DeepSpeed's import paths ``runner.py``, ``launch.py`` (one node of a job given by
``--world_info``) and ``multinode_runner.py`` answer from these.
"""
