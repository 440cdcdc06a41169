"""The SLURM transport: hosts from the allocation, one node agent per node through ``srun``.

Owns SLURM's hostlist syntax (``hostlist``: ``n[01-04,07],gpu-a[1-2]`` to and from host names).
The runner itself and ``dslaunch sbatch`` are issue 11's remaining work.

Nothing heavy is imported here: the launcher imports only what a SLURM launch needs.
"""
