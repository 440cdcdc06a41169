"""What a SLURM partition's nodes offer: their GPUs, read from the ``gpu`` GRES that ``sinfo`` shows.

``dslaunch sbatch --num_gpus N`` asks for N GPUs per node only where the partition has GPUs: on a
cluster whose nodes have no ``gpu`` GRES, SLURM refuses ``--gpus-per-node`` ("Invalid generic
resource (gres) specification"), and the job should run N CPU workers per node instead, as the
local launcher does on a machine without GPUs. Standard library only.

Limitations: the answer is sinfo's view on the login node (GRES as configured, not as free now);
a partition list (``gpu,cpu``) has GPUs when any of its partitions has.
"""

from __future__ import annotations

import re
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass

from dslaunch.errors import LaunchError, UsageError, did_you_mean, quote, shorten

__all__ = ["PartitionGpus", "gpus_in", "partition_gpus", "SINFO_TIMEOUT_S"]

SINFO_TIMEOUT_S = 15.0
"""A healthy slurmctld answers in well under a second; a missing one makes sinfo retry for a minute."""

# A GRES entry ``gpu[:type]:count[(S:sockets)]``, e.g. ``gpu:a100:4(S:0-1)`` in ``gpu:4,mps:400``.
_GPU = re.compile(r"(?:^|,)gpu(?::[^:,(]+)?:(\d+)")


@dataclass(frozen=True)
class PartitionGpus:
    """The GPUs of one partition (or partition list) as ``sinfo`` reports them."""

    partition: str
    """The partition asked about: the one given, else the cluster's default."""
    gres: tuple[str, ...]
    """Each node group's GRES as sinfo prints it (``gpu:a100:4(S:0-1)``, ``(null)`` for none)."""

    @property
    def gpus_per_node(self) -> int:
        """The most GPUs any of its nodes has (0: no node has a ``gpu`` GRES)."""
        return max((gpus_in(g) for g in self.gres), default=0)


def gpus_in(gres: str) -> int:
    """GPUs in one node's GRES string as sinfo's ``%G`` prints it: ``gpu:2,mps:200`` -> 2."""
    return sum(int(m[1]) for m in _GPU.finditer(gres))


def partition_gpus(partition: str | None, source: str = "--partition",
                   env: Mapping[str, str] | None = None) -> PartitionGpus:
    """Ask ``sinfo`` what the nodes of ``partition`` (None: the default partition) offer.
    ``source`` names where ``partition`` came from, for the error.

    Raises:
        LaunchError: SLURM cannot be asked (no ``sinfo``, no controller, no answer in time).
        UsageError: ``partition`` is not one of the cluster's (naming the ones it has).
    """
    by_partition = _sinfo_gres(env)
    default = [name for name in by_partition if name.endswith("*")]
    groups = {name.rstrip("*"): gres for name, gres in by_partition.items()}
    if partition is None:
        if not default:
            raise LaunchError("sinfo shows no default partition; name one with --partition")
        name = default[0].rstrip("*")
        return PartitionGpus(name, groups[name])
    gres: list[str] = []
    for name in partition.split(","):
        if name not in groups:
            raise UsageError(f"{source} {quote(partition)}: SLURM has no partition {quote(name)}"
                             f"{did_you_mean(name, groups)}; it has {', '.join(sorted(groups))[:300]}")
        gres.extend(groups[name])
    return PartitionGpus(partition, tuple(gres))


def _sinfo_gres(env: Mapping[str, str] | None) -> dict[str, tuple[str, ...]]:
    """Partition (``*`` marks the default) -> its node groups' GRES, from ``sinfo --all``."""
    try:
        done = subprocess.run(["sinfo", "--noheader", "--all", "--format=%P|%G"], capture_output=True,
                              text=True, timeout=SINFO_TIMEOUT_S, env=None if env is None else dict(env))
    except FileNotFoundError:
        raise LaunchError("sinfo not found (not a SLURM login node)") from None
    except subprocess.TimeoutExpired:
        raise LaunchError(f"sinfo gave no answer within {SINFO_TIMEOUT_S:g} s") from None
    if done.returncode != 0:
        why = done.stderr.strip().splitlines()[-1:] or [f"exit code {done.returncode}"]
        raise LaunchError(f"sinfo failed: {shorten(why[0], 200)}")
    found: dict[str, tuple[str, ...]] = {}
    for line in done.stdout.splitlines():
        name, _, gres = line.strip().partition("|")
        if name:
            found[name] = (*found.get(name, ()), gres)
    return found
