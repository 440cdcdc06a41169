"""Kubernetes: a pod of a training job read as a ``--no_ssh`` node (no sshd, no MPI), and the
manifests that start such a job (``dslaunch k8s manifest``).

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

``manifests`` writes either a Kubeflow Trainer ``TrainJob`` (its ``torch-distributed`` runtime sets
the PET_* variables) or, for clusters without the operator, an indexed ``Job`` whose pods find pod 0
through a headless ``Service`` of the same name (``<name>-0.<name>``): the manifest sets the PET_*
variables itself and the pod's ``JOB_COMPLETION_INDEX`` is its node rank.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from dslaunch.errors import UsageError

__all__ = ["Pod", "pod_from_env", "JobShape", "manifests"]


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


@dataclass(frozen=True)
class JobShape:
    """What ``dslaunch k8s manifest`` is told: the job's name, image, size and command."""

    name: str
    image: str
    nodes: int
    command: tuple[str, ...]
    """The container's command, e.g. ``("dslaunch", "train.py", "--deepspeed", ...)``."""
    nproc_per_node: int | None = None
    """Workers per pod; None: the pod's GPUs (Trainer's ``auto``)."""
    gpus_per_node: int = 0
    namespace: str | None = None
    master_port: int = 29500
    runtime: str = "torch-distributed"
    """The Trainer runtime a ``TrainJob`` refers to."""


def _metadata(shape: JobShape) -> dict[str, Any]:
    return {"name": shape.name, **({"namespace": shape.namespace} if shape.namespace else {})}


def _resources(shape: JobShape) -> dict[str, Any]:
    return {"limits": {"nvidia.com/gpu": str(shape.gpus_per_node)}} if shape.gpus_per_node else {}


def _train_job(shape: JobShape) -> dict[str, Any]:
    trainer: dict[str, Any] = {"image": shape.image, "command": list(shape.command), "numNodes": shape.nodes}
    if shape.nproc_per_node:
        trainer["numProcPerNode"] = shape.nproc_per_node
    if shape.gpus_per_node:
        trainer["resourcesPerNode"] = _resources(shape)
    return {"apiVersion": "trainer.kubeflow.org/v1alpha1", "kind": "TrainJob", "metadata": _metadata(shape),
            "spec": {"runtimeRef": {"name": shape.runtime}, "trainer": trainer}}


def _indexed_job(shape: JobShape) -> list[dict[str, Any]]:
    """A headless Service (pods resolve as ``<name>-<index>.<name>``) and an indexed Job."""
    env = {"PET_NNODES": str(shape.nodes), "PET_MASTER_ADDR": f"{shape.name}-0.{shape.name}",
           "PET_MASTER_PORT": str(shape.master_port),
           "PET_NPROC_PER_NODE": str(shape.nproc_per_node) if shape.nproc_per_node else "auto"}
    container: dict[str, Any] = {"name": "trainer", "image": shape.image, "command": list(shape.command),
                                 "env": [{"name": k, "value": v} for k, v in env.items()],
                                 "ports": [{"containerPort": shape.master_port, "protocol": "TCP"}]}
    if shape.gpus_per_node:
        container["resources"] = _resources(shape)
    service = {"apiVersion": "v1", "kind": "Service", "metadata": _metadata(shape),
               # pods must resolve before they are ready: pod 0's store is what makes them ready
               "spec": {"clusterIP": "None", "publishNotReadyAddresses": True, "selector": {"job-name": shape.name}}}
    job = {"apiVersion": "batch/v1", "kind": "Job", "metadata": _metadata(shape),
           "spec": {"completionMode": "Indexed", "completions": shape.nodes, "parallelism": shape.nodes,
                    # one failed pod fails the job: the others' ranks already stopped (see above)
                    "backoffLimit": 0,
                    "template": {"spec": {"subdomain": shape.name, "restartPolicy": "Never",
                                          "containers": [container]}}}}
    return [service, job]


def manifests(shape: JobShape, kind: Literal["trainjob", "job"] = "trainjob") -> list[dict[str, Any]]:
    """The objects that start ``shape`` on Kubernetes (apply them in order)."""
    return [_train_job(shape)] if kind == "trainjob" else _indexed_job(shape)

