"""The SLURM allocation this process runs in, read from the variables SLURM sets.

``SLURM_JOB_ID`` says we are inside an allocation (``sbatch``'s batch script, ``salloc``'s shell);
``SLURM_JOB_NODELIST`` names its nodes in hostlist syntax; the slots per node come from
``SLURM_GPUS_ON_NODE`` (GPUs allocated on each node), else ``SLURM_NTASKS_PER_NODE``
(``--ntasks-per-node``); ``SLURM_JOB_CPUS_PER_NODE`` (``72(x2),36``) gives each node's CPUs, so
that the node agent's step may use all of them; ``SLURM_RESTART_COUNT`` how often the job was
requeued. Standard library only.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from dslaunch.errors import UsageError, quote
from dslaunch.launcher.hostfile import Pool, apply_filter, parse_filter
from dslaunch.utils.hostlist import expand

__all__ = ["Allocation", "from_env", "slurm_pool", "SLOT_VARIABLES"]

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
    requeues: int = 0
    """How many times SLURM requeued the job (``SLURM_RESTART_COUNT``): the workers' restart count."""


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
    restarts = env.get("SLURM_RESTART_COUNT", "0")
    return Allocation(job_id, hosts, slots, slots_from, per_node, int(restarts) if restarts.isdigit() else 0)


def slurm_pool(alloc: Allocation, include: str, exclude: str, num_gpus: int, notes: list[str]) -> Pool:
    """The allocation's nodes, each with ``num_gpus`` slots (``--num_gpus``), else as many as SLURM
    says (``SLOT_VARIABLES``), else 1; include/exclude pick whole nodes. Notes go to ``notes``.

    Raises:
        UsageError: a slot list in include/exclude, or more GPUs than the allocation has per node.
        HostfileError: include/exclude name a node outside the allocation.
    """
    for flag, text in (("--include", include), ("--exclude", exclude)):
        if text and any(slots is not None for slots in parse_filter(text, flag).values()):
            raise UsageError(f"{flag} {quote(text)}: under SLURM, include/exclude select whole nodes "
                             "(e.g. 'node1@node2'); SLURM gives each node's step its devices")
    if num_gpus > 0:
        if alloc.slots is not None and num_gpus > alloc.slots and alloc.slots_from == "SLURM_GPUS_ON_NODE":
            raise UsageError(f"--num_gpus {num_gpus}: the allocation has {alloc.slots} GPUs per node "
                             "(SLURM_GPUS_ON_NODE)")
        count = num_gpus
    elif alloc.slots is not None:
        count = alloc.slots
        notes.append(f"{count} workers per node ({alloc.slots_from}={count})")
    else:
        count = 1
        notes.append("1 worker per node: the allocation names no GPUs or tasks per node "
                     "(pass --num_gpus N, or sbatch --gpus-per-node/--ntasks-per-node)")
    return apply_filter({h: count for h in alloc.hosts}, include, exclude)
