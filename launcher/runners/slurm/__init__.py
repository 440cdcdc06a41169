"""The SLURM transport: hosts from the allocation, one node agent per node through ``srun``.

``allocation.py`` reads the allocation from SLURM's variables (the hostlist syntax itself is
``dslaunch.utils.hostlist``, shared with the runtime); ``runner.py`` is ``--launcher slurm`` (one
agent per node through srun); ``preemption.py`` turns SLURM's warning signal into a checkpoint
request and a requeue; ``gres.py`` tells ``dslaunch sbatch`` whether a partition has GPUs.

Nothing heavy is imported here: the launcher imports only what a SLURM launch needs.
"""
