"""Every variable a worker gets, decided in one place.

A worker's environment is layered, lowest precedence first; each hop of a launch calls the
function here for its layer and nothing else writes the environment:

1. the environment the agent inherited (``process_env``): the controller's for a local node,
   sshd's fresh one on a remote host;
2. remote nodes only (``remote_node``): the controller's exported variables and env files
   (``envfile.collect_env``), then ``GLOO_SOCKET_IFNAME``/``NCCL_SOCKET_IFNAME`` = the interface
   that routes to the master address on that host, unless layer 2 set them;
3. the node's rendezvous variables (``node_env``, from the plan): ``MASTER_ADDR``,
   ``MASTER_PORT``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``/``LOCAL_SIZE``, ``NODE_RANK``/``CROSS_RANK``,
   ``CROSS_SIZE`` and, on GPU nodes, ``CUDA_VISIBLE_DEVICES`` = the node's selected slots. A
   remote node's ``MASTER_ADDR`` is the address the runner resolved for every host to reach;
   with them the restart variables (``dslaunch.utils.restart.restart_env``: the run's restart
   count under torchrun's and dslaunch's names, the budget, ``--resume_from``);
4. the worker's own (``worker_env``): ``RANK``, ``LOCAL_RANK``;
5. ``OMP_NUM_THREADS`` (``process_env``): the worker's core share under ``--bind_cores_to_rank``;
   otherwise, unless already set, the node's cores split among its workers;
6. the monitor's channel (``monitor_env``, set by the agent): ``DSLAUNCH_HEARTBEAT_FD`` and
   ``DSLAUNCH_STACK_FD``, the fds of the pipes the worker inherits (``dslaunch.utils.beat``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import replace

from dslaunch.launcher.spec import NodeSpec, WorkerSpec
from dslaunch.utils.beat import HEARTBEAT_FD_ENV, STACK_FD_ENV

__all__ = ["IFNAME_VARS", "node_env", "worker_env", "interface_env", "remote_node", "process_env", "monitor_env"]

IFNAME_VARS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


def node_env(master_addr: str, master_port: int, world: int, node_rank: int, num_nodes: int,
             slots: tuple[int, ...], use_gpus: bool) -> dict[str, str]:
    """Layer 3: the variables every worker of one node shares (DeepSpeed's names)."""
    env = {
        "MASTER_ADDR": master_addr, "MASTER_PORT": str(master_port), "WORLD_SIZE": str(world),
        "LOCAL_WORLD_SIZE": str(len(slots)), "LOCAL_SIZE": str(len(slots)), "NODE_RANK": str(node_rank),
        "CROSS_RANK": str(node_rank), "CROSS_SIZE": str(num_nodes),
    }
    if use_gpus:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, slots))
    return env


def worker_env(global_rank: int, local_rank: int) -> dict[str, str]:
    """Layer 4: one worker's ranks."""
    return {"RANK": str(global_rank), "LOCAL_RANK": str(local_rank)}


def interface_env(iface: str | None, given: Mapping[str, str]) -> dict[str, str]:
    """gloo's and NCCL's interface variables for ``iface`` (the host's interface toward the
    master), each only where ``given`` does not set it: the user's value wins. None or ``lo``: none."""
    if not iface or iface == "lo":
        return {}
    return {var: iface for var in IFNAME_VARS if var not in given}


def remote_node(node: NodeSpec, master_addr: str, exported: Mapping[str, str], iface: str | None) -> NodeSpec:
    """Layers 2 and 3 for a node started over a transport that does not carry the controller's
    environment: ``node`` with the exported variables under its own and the resolved master.

    Args:
        node: the plan's node.
        master_addr: the address every host reaches the master by (replaces the plan's).
        exported: ``envfile.collect_env()``.
        iface: the host's interface toward the master address, if known (``lo`` is ignored).
    """
    env = {**exported, **interface_env(iface, exported), **node.env}  # the user's value (env file) wins
    env["MASTER_ADDR"] = master_addr
    return replace(node, env=env)


def monitor_env(beat_fd: int, stack_fd: int) -> dict[str, str]:
    """Layer 6: where the worker writes its heartbeats and its stack dumps."""
    return {HEARTBEAT_FD_ENV: str(beat_fd), STACK_FD_ENV: str(stack_fd)}


def process_env(inherited: Mapping[str, str], node: NodeSpec, worker: WorkerSpec,
                cores: tuple[int, ...], monitor: Mapping[str, str] | None = None) -> dict[str, str]:
    """Layers 1 to 6: the environment a worker process starts with.

    Args:
        inherited: the agent's own environment.
        node, worker: the specs (their ``env`` are layers 2-3 and 4).
        cores: the worker's pinned cores (empty = not pinned).
        monitor: ``monitor_env`` (layer 6); None = none (inherited values are dropped: a
            nested launch must not write into its parent's pipes).
    """
    env = {k: v for k, v in inherited.items() if k not in (HEARTBEAT_FD_ENV, STACK_FD_ENV)}
    env.update({**node.env, **worker.env, **(monitor or {})})
    if cores:
        env["OMP_NUM_THREADS"] = str(len(cores))
    elif "OMP_NUM_THREADS" not in env:
        # N workers x all cores each oversubscribes the CPU; split it (the user's value wins).
        ncores = len(os.sched_getaffinity(0))
        env["OMP_NUM_THREADS"] = str(max(1, ncores // max(1, len(node.workers))))
    return env
