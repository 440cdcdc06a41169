"""Runners start node agents on hosts: one module per transport (local, ssh, slurm)."""
