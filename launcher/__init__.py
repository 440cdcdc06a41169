"""The launcher: CLI, hostfile, runners (local, ssh, slurm), node agent and monitor."""
