"""A pod of a Kubernetes training job, read as a ``--no_ssh`` node: no sshd, no MPI.

Kubeflow's PyTorchJob and Trainer (``TrainJob``) give every pod torchrun's variables:
``PET_NNODES``, ``PET_NODE_RANK``, ``PET_NPROC_PER_NODE``, ``PET_MASTER_ADDR``,
``PET_MASTER_PORT``. A plain indexed ``Job`` gives ``JOB_COMPLETION_INDEX``, the pod's index, which
stands for ``PET_NODE_RANK`` where that is unset (the manifest sets the others). Inside such a pod,
``dslaunch train.py`` without a hostfile plans the job as every node of a ``--no_ssh`` job does:
node ``PET_NODE_RANK`` of ``PET_NNODES``, node 0 at ``PET_MASTER_ADDR:PET_MASTER_PORT``, and starts
this pod's workers under its own agent and monitor. Flags given on the command line win.

Workers per pod: ``PET_NPROC_PER_NODE`` when it is a number, else the pod's GPUs, else
``--num_gpus`` CPU workers, else one. An elastic range (``PET_NNODES=1:4``) is refused in one line:
dslaunch's elasticity is ``--elastic_training`` over a hostfile or an allocation.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from dslaunch.errors import UsageError

__all__ = ["Pod", "pod_from_env"]


@dataclass(frozen=True)
class Pod:
    """What the operator told this pod."""

    nnodes: int
    node_rank: int
    master_addr: str
    master_port: int | None
    nproc_per_node: int | None
    """None: the pod's GPUs (or ``--num_gpus``)."""

    def hosts(self) -> tuple[str, ...]:
        """Names for the job's nodes: node 0 is the master address, the others by index."""
        return (self.master_addr, *(f"pod-{i}" for i in range(1, self.nnodes)))


def _number(env: Mapping[str, str], name: str, low: int) -> int:
    raw = env[name].strip()
    if not raw.isdigit() or int(raw) < low:
        why = ("an elastic range is not supported here: give the number of pods (dslaunch's elasticity is "
               "--elastic_training)") if ":" in raw else f"expected an integer >= {low}"
        raise UsageError(f"{name}={raw!r}: {why}")
    return int(raw)


def pod_from_env(env: Mapping[str, str]) -> Pod | None:
    """The pod's place in its job, from the operator's variables; None outside such a pod.

    Raises:
        UsageError: a variable that is not what the operator would set (named, one line).
    """
    if "PET_NNODES" not in env:
        return None
    nnodes = _number(env, "PET_NNODES", 1)
    rank_var = "PET_NODE_RANK" if "PET_NODE_RANK" in env else "JOB_COMPLETION_INDEX"
    if rank_var not in env:
        raise UsageError("PET_NNODES is set but neither PET_NODE_RANK nor JOB_COMPLETION_INDEX: which pod is this?")
    node_rank = _number(env, rank_var, 0)
    if node_rank >= nnodes:
        raise UsageError(f"{rank_var}={node_rank} is out of range for PET_NNODES={nnodes} (valid: 0-{nnodes - 1})")
    addr = env.get("PET_MASTER_ADDR") or env.get("MASTER_ADDR")
    if not addr:
        raise UsageError("PET_NNODES is set but PET_MASTER_ADDR is not: the address of pod 0 (e.g. its headless "
                         "service name) is needed")
    port_var = "PET_MASTER_PORT" if "PET_MASTER_PORT" in env else "MASTER_PORT" if "MASTER_PORT" in env else None
    port = _number(env, port_var, 1) if port_var else None
    nproc = env.get("PET_NPROC_PER_NODE", "auto").strip()
    return Pod(nnodes, node_rank, addr, port, _number(env, "PET_NPROC_PER_NODE", 1) if nproc.isdigit() else None)
