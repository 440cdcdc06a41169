"""A real local Ray cluster for the Ray tests and scripts/bench/ray_failover_bench.py: a head and two worker nodes, each its own processes
(``ray.cluster_utils.Cluster``), shared by a module; skipped without Ray (``pip install 'dslaunch[ray]'``,
which ``make test`` does).

Nodes: the head offers 2 CPUs, the others 1 each, so a job with one worker per CPU has 4 workers on
3 nodes. Ray's files go to a short private temp directory (its socket paths must stay short), never
``/tmp/ray``; each node keeps its object store at 100 MB.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from unittest import mock

import psutil

from tests.launcher.helpers import ROOT

NODE_CPUS = (2, 1, 1)
_STORE = 100 * 2**20


class RayTestCluster:
    """The cluster and what tests do to it: its address, its nodes, killing one."""

    def __init__(self, cluster, tmp: str) -> None:
        self.cluster = cluster
        self.address = cluster.address
        self.tmp = tmp
        """``RAY_TMPDIR`` of its nodes: every process they start carries it."""

    def agents(self) -> list[psutil.Process]:
        """dslaunch processes its nodes' actors started and that are alive: agents (standby ones
        too) and their warm spares."""
        found = []
        for p in psutil.process_iter(["pid"]):
            try:
                if (p.environ().get("RAY_TMPDIR") == self.tmp and p.status() != psutil.STATUS_ZOMBIE
                        and any(a.startswith("dslaunch.launcher.agent") for a in p.cmdline())):
                    found.append(p)
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue
        return found

    def worker_nodes(self) -> list:
        return list(self.cluster.worker_nodes)

    def kill_node(self, node) -> list[int]:
        """SIGKILL every process of ``node`` (its raylet and all it started: actors, the node agent
        and its workers; its other daemons): the node is gone, nothing on it can report."""
        procs = [info.process.pid for infos in node.all_processes.values() for info in infos]
        for pid in list(procs):
            try:
                procs += [c.pid for c in psutil.Process(pid).children(recursive=True)]
            except psutil.NoSuchProcess:
                pass
        for pid in procs:
            try:
                os.kill(pid, 9)
            except ProcessLookupError:
                pass
        return procs

    def replace_node(self, node) -> None:
        """Forget a killed node and start a fresh one like it (the next test sees 3 nodes)."""
        try:
            self.cluster.remove_node(node, allow_graceful=False)
        except Exception:  # noqa: BLE001 - its processes are already gone
            self.cluster.worker_nodes.discard(node)
        self.cluster.add_node(num_cpus=1, object_store_memory=_STORE)


@contextlib.contextmanager
def local_cluster() -> Iterator[RayTestCluster]:
    """Start the cluster (``NODE_CPUS``); Ray's environment variables restored afterwards."""
    from ray.cluster_utils import Cluster

    tmp = tempfile.mkdtemp(prefix="dsl-ray-", dir="/tmp")
    os.makedirs(os.path.join(tmp, "ray"))
    # RAY_TMPDIR: also where the dslaunch processes the tests start look; PYTHONPATH: Ray's
    # workers import the tests' modules.
    env = {"RAY_TMPDIR": tmp, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    cluster = None
    try:
        with mock.patch.dict(os.environ, env):
            cluster = Cluster(initialize_head=True, connect=False,
                              head_node_args={"num_cpus": NODE_CPUS[0], "object_store_memory": _STORE,
                                              "include_dashboard": False})
            for cpus in NODE_CPUS[1:]:
                cluster.add_node(num_cpus=cpus, object_store_memory=_STORE)
            cluster.wait_for_nodes()
            yield RayTestCluster(cluster, tmp)
    finally:
        if cluster is not None:
            cluster.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)
