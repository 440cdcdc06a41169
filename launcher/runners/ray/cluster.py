"""The Ray cluster a ``--launcher ray`` job runs on: its alive nodes and their slots.

``connect(address)`` joins a running cluster (``--ray_address ADDR`` or ``auto``) or, without an
address, starts a local one for the job (it ends with the controller); it returns a ``RayCluster``
snapshot that the plan turns into hosts like a hostfile: one host per Ray node, named by its
address (with the node id's first 8 digits where several nodes share an address, as nodes started
on one machine do), head node first. Slots per node: ``--num_gpus`` N, else the node's GPUs, else
its CPUs (``ray start --num-cpus``): a CPU-only cluster runs one worker per CPU Ray offers.

Like SLURM, Ray gives each node's actor its own ``CUDA_VISIBLE_DEVICES`` (the GPUs of its bundle):
the plan leaves that variable alone and workers use ``LOCAL_RANK`` within it.
"""

from __future__ import annotations

from dataclasses import dataclass

from dslaunch.errors import UsageError
from dslaunch.launcher.hostfile import Pool, apply_filter

__all__ = ["RayNode", "RayCluster", "connect", "ray_pool", "import_ray", "RAY_HEAD"]

RAY_HEAD = "node:__internal_head__"
"""The resource Ray gives its head node only."""


@dataclass(frozen=True)
class RayNode:
    """One alive Ray node as the plan sees it."""

    node_id: str
    address: str
    """``NodeManagerAddress``: where its processes listen (the rendezvous address when it hosts rank 0)."""
    cpus: int
    gpus: int
    host: str
    """The name the job uses for it (messages, include/exclude, elastic drops)."""


@dataclass(frozen=True)
class RayCluster:
    """The cluster's alive nodes when the job was planned, head first."""

    address: str
    """What ``--ray_address`` said (``local``: a cluster started for this job)."""
    nodes: tuple[RayNode, ...]

    def node(self, host: str) -> RayNode:
        return next(n for n in self.nodes if n.host == host)


def import_ray():
    """The ``ray`` module. Raises UsageError naming the extra when Ray is not installed."""
    try:
        import ray
    except ImportError:
        raise UsageError("--launcher ray needs Ray: pip install 'dslaunch[ray]' (or 'ray[train]') into "
                         "the interpreter of the controller and of every Ray node") from None
    return ray


def connect(address: str | None) -> RayCluster:
    """Join the Ray cluster at ``address`` (``auto``: the one ``ray start`` made on this machine),
    or start a local one when ``address`` is None; read its alive nodes.

    Raises:
        UsageError: Ray not installed, no cluster at ``address``, or no alive node.
    """
    ray = import_ray()
    if not ray.is_initialized():
        try:
            # Our agents' output comes back through their own pipes, not Ray's log relay.
            ray.init(address=address, include_dashboard=False, log_to_driver=False, logging_level="warning",
                     configure_logging=True)
        except (ConnectionError, RuntimeError, ValueError) as exc:
            raise UsageError(f"--ray_address {address}: cannot join the Ray cluster ({str(exc).splitlines()[0]}); "
                             "give the head's address (host:6379), 'auto' on a cluster node, or leave the "
                             "flag out to start a local cluster") from None
    nodes = ray.nodes()
    if not any(n.get("Alive") for n in nodes):
        raise UsageError(f"the Ray cluster at {address or 'local'} has no alive node")
    return RayCluster(address or "local", _named(nodes))


def _named(nodes: list[dict]) -> tuple[RayNode, ...]:
    """The alive nodes, head first, then by address and node id (a stable order: ranks follow it).
    Names are made over every node Ray knows, dead ones too, so that a node keeps its name when
    another one on its address dies."""
    addresses = [n["NodeManagerAddress"] for n in nodes]
    nodes = sorted((n for n in nodes if n.get("Alive")),
                   key=lambda n: (RAY_HEAD not in n["Resources"], n["NodeManagerAddress"], n["NodeID"]))
    named = []
    for n in nodes:
        shared = addresses.count(n["NodeManagerAddress"]) > 1
        host = f"{n['NodeManagerAddress']}-{n['NodeID'][:8]}" if shared else n["NodeManagerAddress"]
        res = n["Resources"]
        named.append(RayNode(n["NodeID"], n["NodeManagerAddress"], int(res.get("CPU", 0)), int(res.get("GPU", 0)),
                             host))
    return tuple(named)


def ray_pool(cluster: RayCluster, include: str, exclude: str, num_gpus: int, notes: list[str]) -> Pool:
    """One host per node with its slots (see the module docstring); nodes with fewer than
    ``num_gpus`` GPUs (or, on CPU nodes, CPUs) are left out with a note.

    Raises:
        UsageError: no node has room for the workers asked for.
        HostfileError: include/exclude name a node that is not in the cluster.
    """
    pool: dict[str, int] = {}
    for n in cluster.nodes:
        have, what = (n.gpus, "GPUs") if n.gpus else (n.cpus, "CPUs")
        count = num_gpus if num_gpus > 0 else have
        if count > have or count == 0:
            notes.append(f"Ray node {n.host} left out: {have} {what}, {count or 'some'} needed per node")
            continue
        pool[n.host] = count
    if not pool:
        raise UsageError(f"no node of the Ray cluster at {cluster.address} has room for "
                         f"{num_gpus if num_gpus > 0 else 'one'} worker(s): "
                         + ", ".join(f"{n.host} ({n.gpus} GPUs, {n.cpus} CPUs)" for n in cluster.nodes))
    return apply_filter(pool, include, exclude)
