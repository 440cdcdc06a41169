#!/usr/bin/env python3
"""Run a torch.distributed job directly on the test cluster's hosts: ``per_host`` ranks in each host's
network namespace (``ip netns exec``), without SSH or the launcher, for tests and benchmarks whose
subject is the traffic between hosts (ZeRO++'s, ``tests/runtime/zero/test_zeropp_cluster.py``,
``scripts/bench/comm_bench.py``).

Ranks get torch's environment contract plus dslaunch's topology (``NODE_RANK``, ``LOCAL_RANK``,
``LOCAL_WORLD_SIZE``); rank 0's host is the master; ``GLOO_SOCKET_IFNAME`` names the host's
interface (gloo would otherwise pick one from the machine's host name: FACTS.md). Ranks on one host
talk over its loopback, ranks on two hosts through their (possibly shaped) links.

Standard library only. Callers hold ``/tmp/dslaunch-cluster.lock`` (the cluster is shared).
"""

from __future__ import annotations

import json
import os
import random
import subprocess
from dataclasses import dataclass
from types import ModuleType

__all__ = ["RankResult", "run_on_hosts", "first_hosts"]


@dataclass(frozen=True)
class RankResult:
    rank: int
    returncode: int | None  # None: killed at the timeout
    stdout: str
    stderr: str


def first_hosts(cluster: ModuleType, n: int) -> list[dict]:
    """Hosts 1..n of the test cluster (``cluster``: the ``cluster.py`` module), brought up only if
    they are not (a cluster another session built, maybe with more hosts, is used as it is)."""
    state = cluster.state_dir_default()
    names = [f"{cluster.PREFIX}node{k}" for k in range(1, n + 1)]
    answering = cluster.status(state)["sshd"]
    if not all(answering.get(name) for name in names):
        cluster.up(n, state)
    info = json.loads((state / "state.json").read_text())
    return [h for h in info["hosts"] if h["name"] in names]


def run_on_hosts(hosts: list[dict], per_host: int, argv: list[str], timeout: float,
                 env: dict[str, str] | None = None) -> list[RankResult]:
    """Start ``argv`` as ranks 0..len(hosts)*per_host-1 (rank = host index * per_host + local rank)
    on the hosts of ``state.json`` (dicts with ``name``, ``addr``, ``iface``); wait for all.

    A rank still running at ``timeout`` seconds is killed with the rest (returncode None).
    """
    world = len(hosts) * per_host
    port = random.randrange(20_000, 40_000)  # the master's namespace has its own ports: none in use
    procs = []
    for r in range(world):
        host = hosts[r // per_host]
        rank_env = {**os.environ, **(env or {}), "RANK": str(r), "WORLD_SIZE": str(world),
                    "LOCAL_RANK": str(r % per_host), "LOCAL_WORLD_SIZE": str(per_host),
                    "NODE_RANK": str(r // per_host), "MASTER_ADDR": hosts[0]["addr"], "MASTER_PORT": str(port),
                    "GLOO_SOCKET_IFNAME": host["iface"], "OMP_NUM_THREADS": "1"}
        procs.append(subprocess.Popen(["ip", "netns", "exec", host["name"], *argv], env=rank_env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    results = []
    for r, p in enumerate(procs):
        try:
            out, err = p.communicate(timeout=timeout)
            results.append(RankResult(r, p.returncode, out, err))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            out, err = p.communicate()
            results.append(RankResult(r, None, out, err))
    return results
