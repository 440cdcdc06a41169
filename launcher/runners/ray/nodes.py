"""The job's hold on its Ray nodes: one placement group, one agent actor per node, kept across runs.

A restart after a lost node keeps what the surviving nodes already have: their bundles in the
placement group and their actors (each with a standby agent and warm spare workers when the job
may restart, ``actor.AgentProcess``), so the new run starts agents, not Ray workers. Only an
actor that is gone (its node lost, or torn down by the monitor: ``forget``) is made again, in its
node's bundle. A run on nodes the placement group does not hold (a node of another size) gets a
new placement group and new actors.

``RayNodes`` belongs to the job (the CLI closes it when the job ends): ``close`` ends every actor
(each agent then finds its stdin closed) and frees the placement group.
"""

from __future__ import annotations

from dslaunch.launcher.runners.preflight import PROBE_TIMEOUT
from dslaunch.launcher.runners.ray.actor import AgentProcess
from dslaunch.launcher.runners.ray.cluster import RayCluster, import_ray
from dslaunch.launcher.spec import JobSpec, NodeSpec

__all__ = ["RayNodes", "bundle", "NoRoom"]

# A threaded actor: one read in flight per stream, one write, and the control calls.
_ACTOR_THREADS = 4


class NoRoom(Exception):
    """The cluster did not reserve the bundles in time: ``bundles`` (host -> resources)."""

    def __init__(self, bundles: dict[str, dict[str, float]]) -> None:
        super().__init__("placement group not ready")
        self.bundles = bundles


def bundle(node: NodeSpec, gpus: int) -> dict[str, float]:
    """The resources one node's bundle (and actor) holds: its workers' GPUs, else CPUs."""
    return {"GPU": float(len(node.workers))} if gpus else {"CPU": float(len(node.workers))}


class RayNodes:
    """The placement group and the actors of one job (see the module docstring).

    Args:
        restarts: how many restarts the job may make; while one is left, each node's actor keeps
            a standby agent with one warm spare per worker for the next run (0: none).
    """

    def __init__(self, restarts: int = 0) -> None:
        self._restarts = restarts
        self._runs = 0
        self._pg = None
        self._bundles: dict[str, tuple[int, dict[str, float]]] = {}  # host -> (index, resources)
        self._actors: dict[str, object] = {}

    def actors(self, job: JobSpec, cluster: RayCluster) -> dict[str, object]:
        """An actor per node of ``job`` (host -> actor handle), reusing those the job already has.

        Raises:
            NoRoom: a new placement group was not reserved within ``PROBE_TIMEOUT``.
        """
        ray = import_ray()
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self._runs += 1
        alive = {n.host: n for n in cluster.nodes}
        wanted = {n.host: bundle(n, alive[n.host].gpus) for n in job.nodes}
        if any(self._bundles.get(h, (0, None))[1] != res for h, res in wanted.items()):
            self.close()
            self._reserve(job, wanted, alive)
        remote = ray.remote(max_concurrency=_ACTOR_THREADS)(AgentProcess)
        for node in job.nodes:
            if node.host not in self._actors:
                index, res = self._bundles[node.host]
                self._actors[node.host] = remote.options(
                    num_cpus=res.get("CPU", 0), num_gpus=res.get("GPU", 0), max_restarts=0,
                    scheduling_strategy=PlacementGroupSchedulingStrategy(self._pg, index),
                ).remote()
        return {n.host: self._actors[n.host] for n in job.nodes}

    def spares(self, node: NodeSpec) -> int:
        """Warm spares for ``node``'s standby agent: one per worker while the job has a restart
        left after the run ``actors`` was last called for."""
        return len(node.workers) if self._runs <= self._restarts else 0

    def _reserve(self, job: JobSpec, wanted: dict[str, dict[str, float]], alive: dict) -> None:
        """One placement group, ``STRICT_SPREAD``, each bundle tied to its node by the
        ``ray.io/node-id`` label: Ray reserves all of them or none."""
        ray = import_ray()
        hosts = [n.host for n in job.nodes]
        pg = ray.util.placement_group([wanted[h] for h in hosts], strategy="STRICT_SPREAD",
                                      bundle_label_selector=[{"ray.io/node-id": alive[h].node_id} for h in hosts])
        ready, _ = ray.wait([pg.ready()], timeout=PROBE_TIMEOUT)
        if not ready:
            ray.util.remove_placement_group(pg)
            raise NoRoom(wanted)
        self._pg = pg
        self._bundles = {h: (i, wanted[h]) for i, h in enumerate(hosts)}

    def forget(self, host: str) -> None:
        """``host``'s actor is gone or torn down: the next run makes a new one there."""
        actor = self._actors.pop(host, None)
        if actor is not None:
            ray = import_ray()
            try:
                ray.kill(actor, no_restart=True)
            except ray.exceptions.RayError:
                pass

    def close(self) -> None:
        """End every actor and free the placement group."""
        for host in list(self._actors):
            self.forget(host)
        if self._pg is not None:
            import_ray().util.remove_placement_group(self._pg)
            self._pg = None
        self._bundles = {}
