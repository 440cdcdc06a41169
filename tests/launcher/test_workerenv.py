"""The worker environment's layers (workerenv): which value wins where two layers set a variable."""

from __future__ import annotations

from dslaunch.launcher.spec import NodeSpec, WorkerSpec
from dslaunch.launcher.workerenv import node_env, process_env, remote_node, worker_env


def _node(**env: str) -> NodeSpec:
    worker = WorkerSpec(3, 1, ("python", "t.py"), worker_env(3, 1))
    return NodeSpec(1, "b", (worker, worker), env={**node_env("a", 1234, 4, 1, 2, (0, 2), True), **env})


def test_node_and_worker_layers():
    assert node_env("a", 1234, 4, 1, 2, (0, 2), False) == {
        "MASTER_ADDR": "a", "MASTER_PORT": "1234", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2",
        "LOCAL_SIZE": "2", "NODE_RANK": "1", "CROSS_RANK": "1", "CROSS_SIZE": "2"}
    assert node_env("a", 1234, 4, 1, 2, (0, 2), True)["CUDA_VISIBLE_DEVICES"] == "0,2"
    assert worker_env(3, 1) == {"RANK": "3", "LOCAL_RANK": "1"}


def test_remote_node_exported_below_the_plan_and_the_resolved_master_on_top():
    exported = {"NCCL_SOCKET_IFNAME": "ib0", "WORLD_SIZE": "99", "CUDA_HOME": "/cuda"}
    env = remote_node(_node(), "10.0.0.1", exported, "eth1").env
    assert env["GLOO_SOCKET_IFNAME"] == "eth1" and env["NCCL_SOCKET_IFNAME"] == "ib0"  # the user's wins
    assert env["WORLD_SIZE"] == "4" and env["CUDA_HOME"] == "/cuda" and env["MASTER_ADDR"] == "10.0.0.1"
    assert "GLOO_SOCKET_IFNAME" not in remote_node(_node(), "x", {}, "lo").env


def test_process_env_worker_over_node_over_inherited_and_omp_threads():
    node = _node()
    env = process_env({"RANK": "0", "PATH": "/bin"}, node, node.workers[0], (4, 5, 6))
    assert (env["RANK"], env["PATH"], env["OMP_NUM_THREADS"]) == ("3", "/bin", "3")
    assert process_env({"OMP_NUM_THREADS": "7"}, node, node.workers[0], ())["OMP_NUM_THREADS"] == "7"
    assert int(process_env({}, node, node.workers[0], ())["OMP_NUM_THREADS"]) >= 1
