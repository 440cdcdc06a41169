"""The SLURM allocation this process runs in, read from the variables SLURM sets.

``SLURM_JOB_ID`` says we are inside an allocation (``sbatch``'s batch script, ``salloc``'s shell);
``SLURM_JOB_NODELIST`` names its nodes in hostlist syntax; the slots per node come from
``SLURM_GPUS_ON_NODE`` (GPUs allocated on each node), else ``SLURM_NTASKS_PER_NODE``
(``--ntasks-per-node``); ``SLURM_JOB_CPUS_PER_NODE`` (``72(x2),36``) gives each node's CPUs, so
that the node agent's step may use all of them. Standard library only.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from dslaunch.errors import UsageError, quote
from dslaunch.utils.hostlist import expand

__all__ = ["Allocation", "from_env", "SLOT_VARIABLES"]

SLOT_VARIABLES = ("SLURM_GPUS_ON_NODE", "SLURM_NTASKS_PER_NODE")
"""Where the slots per node come from without ``--num_gpus``, first found wins."""

_COUNT = re.compile(r"(\d{1,6})(?:\(x(\d{1,6})\))?")


@dataclass(frozen=True)
class Allocation:
    """A SLURM job's nodes as this process sees them."""

    job_id: str
    hosts: tuple[str, ...]
    """``SLURM_JOB_NODELIST``, expanded, in SLURM's order."""
    slots: int | None = None
    """Workers per node SLURM asked for (``slots_from``), None when it says nothing."""
    slots_from: str | None = None
    cpus: tuple[int, ...] = ()
    """Each host's CPUs (``SLURM_JOB_CPUS_PER_NODE``); empty when unset."""


def _counts(text: str, name: str) -> list[int]:
    """``72(x2),36`` -> [72, 72, 36] (SLURM's run-length form of per-node numbers)."""
    counts: list[int] = []
    for part in text.split(","):
        m = _COUNT.fullmatch(part.strip())
        if m is None:
            raise UsageError(f"{name}={quote(text)}: {quote(part)} is not a count like '2' or '2(x3)'")
        counts.extend([int(m[1])] * int(m[2] or 1))
    return counts


def from_env(env: Mapping[str, str]) -> Allocation | None:
    """The allocation ``env`` describes; None outside SLURM (no ``SLURM_JOB_ID``).

    Raises:
        UsageError: ``SLURM_JOB_ID`` without a readable ``SLURM_JOB_NODELIST``, or an unreadable
            count, each naming the variable.
    """
    job_id = env.get("SLURM_JOB_ID")
    if not job_id:
        return None
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if not nodelist:
        raise UsageError(f"SLURM_JOB_ID={quote(job_id)} is set but SLURM_JOB_NODELIST is not: run inside "
                         "sbatch or salloc, or pass a hostfile (-H)")
    hosts = tuple(expand(nodelist, "SLURM_JOB_NODELIST"))
    slots = slots_from = None
    for name in SLOT_VARIABLES:
        if env.get(name):
            slots, slots_from = _counts(env[name], name)[0], name
            break
    cpus = env.get("SLURM_JOB_CPUS_PER_NODE")
    per_node = tuple(_counts(cpus, "SLURM_JOB_CPUS_PER_NODE")) if cpus else ()
    if per_node and len(per_node) != len(hosts):
        per_node = ()  # inconsistent: let srun pick the step's CPUs
    return Allocation(job_id, hosts, slots, slots_from, per_node)
