"""build_job: slots -> ranks, the env contract, CUDA_VISIBLE_DEVICES, argv, launcher choice."""

from __future__ import annotations

import os
import re
import sys
from dataclasses import replace

import pytest

from dslaunch.errors import HostfileError, UsageError
from dslaunch.launcher.gpus import Accelerators
from dslaunch.launcher.plan import LaunchConfig, build_job

pytestmark = pytest.mark.timeout(30)

CPU = lambda: Accelerators("cpu", 2, reason="no NVIDIA driver found")  # noqa: E731
GPU4 = lambda: Accelerators("cuda", 4, (16 << 30,) * 4)  # noqa: E731


@pytest.mark.parametrize("flags, words", [
    ({"grace": float("inf")}, "--grace_period inf: expected seconds from 0 to 3600"),
    ({"grace": float("nan")}, "--grace_period nan: expected seconds from 0 to 3600"),
    ({"grace": -1.0}, "--grace_period -1: expected seconds from 0 to 3600"),
    ({"grace": 3601.0}, "--grace_period 3601: expected seconds from 0 to 3600"),
    ({"master_port": 0}, "--master_port 0 is not a TCP port (1-65535)"),
    ({"ssh_port": 65536}, "--ssh_port 65536 is not a TCP port (1-65535)"),
    ({"master_addr": "-oProxyCommand=x"}, "--master_addr '-oProxyCommand=x': expected labels"),
    ({"master_addr": "a b"}, "--master_addr 'a b': expected labels"),
    ({"master_addr": "m" * 1000}, "--master_addr 'mmmm"),
])
def test_every_number_and_the_master_address_are_checked_before_anything(tmp_path, flags, words):
    with pytest.raises(UsageError) as info:
        build_job(_cfg(tmp_path, "a slots=2\n", **flags), CPU)
    assert str(info.value).startswith(words) and len(str(info.value)) < 200, str(info.value)


def test_valid_edges_of_the_ranges(tmp_path):
    job = build_job(_cfg(tmp_path, num_gpus=4096, grace=0.0, master_port=65535), CPU).job
    assert job.world_size == 4096 and job.nodes[0].grace == 0.0
    given = build_job(_cfg(tmp_path, "a slots=1\n", grace=3600.0, master_addr="fe80::1"), CPU).job
    assert given.master_addr == "fe80::1" and given.master_given


def test_localhost_in_capitals_is_still_this_machine(tmp_path):
    assert build_job(_cfg(tmp_path, "LocalHost slots=2\n"), CPU).job.launcher == "local"


def _cfg(tmp_path, hostfile: str | None = None, **kw) -> LaunchConfig:
    path = tmp_path / "hostfile"
    if hostfile is not None:
        path.write_text(hostfile)
    return LaunchConfig(user_script="train.py", user_args=("--lr", "1"), hostfile=str(path),
                        hostfile_explicit=hostfile is not None, **kw)


def test_no_hostfile_no_gpu_num_gpus_means_cpu_workers(tmp_path):
    plan = build_job(_cfg(tmp_path, num_gpus=3), CPU)
    (node,) = plan.job.nodes
    assert plan.job.launcher == "local" and plan.job.world_size == 3
    assert [w.global_rank for w in node.workers] == [0, 1, 2]
    assert "CUDA_VISIBLE_DEVICES" not in node.env
    assert "3 CPU worker processes" in plan.notes[0] and "no NVIDIA driver" in plan.notes[0]


def test_no_hostfile_no_gpu_no_flag_starts_one_worker_and_says_so(tmp_path):
    plan = build_job(_cfg(tmp_path), CPU)
    assert plan.job.world_size == 1 and "1 CPU worker" in plan.notes[0]


def test_local_gpus_cuda_visible_devices_follow_selected_slots(tmp_path):
    plan = build_job(_cfg(tmp_path, include="localhost:1,3"), GPU4)
    (node,) = plan.job.nodes
    assert node.env["CUDA_VISIBLE_DEVICES"] == "1,3" and plan.job.world_size == 2
    assert build_job(_cfg(tmp_path, num_gpus=2), GPU4).job.nodes[0].env["CUDA_VISIBLE_DEVICES"] == "0,1"
    with pytest.raises(UsageError, match="has 4 GPUs"):
        build_job(_cfg(tmp_path, num_gpus=5), GPU4)


def test_env_contract_and_argv_like_deepspeed(tmp_path):
    job = build_job(_cfg(tmp_path, "a slots=2\nb slots=3\n", exclude="a:0", master_port=1234), CPU).job
    assert job.launcher == "ssh" and job.master_addr == "a" and job.world_size == 4
    assert not job.master_given  # the plan's default: the runner may resolve it
    a, b = job.nodes
    assert a.env["CUDA_VISIBLE_DEVICES"] == "1" and b.env["CUDA_VISIBLE_DEVICES"] == "0,1,2"
    w = b.workers[2]
    env = {**b.env, **w.env}
    keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "NODE_RANK", "CROSS_RANK", "CROSS_SIZE",
            "MASTER_ADDR", "MASTER_PORT")
    assert {k: env[k] for k in keys} == {
        "RANK": "3", "LOCAL_RANK": "2", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "3", "NODE_RANK": "1",
        "CROSS_RANK": "1", "CROSS_SIZE": "2", "MASTER_ADDR": "a", "MASTER_PORT": "1234"}
    assert w.argv == (sys.executable, "-u", "train.py", "--local_rank=2", "--lr", "1")
    # one controller started every node: the ranks check their store is this run's of this job
    assert a.env["DSLAUNCH_RENDEZVOUS_ID"] == b.env["DSLAUNCH_RENDEZVOUS_ID"] == f"{a.env['DSLAUNCH_JOB_ID']}/0"


@pytest.mark.parametrize("flags, head", [
    ({"module": True}, (sys.executable, "-u", "-m", "train.py", "--local_rank=0")),
    ({"no_python": True}, ("train.py", "--local_rank=0")),
    ({"no_local_rank": True}, (sys.executable, "-u", "train.py")),
])
def test_argv_variants(tmp_path, flags, head):
    argv = build_job(_cfg(tmp_path, num_gpus=1, **flags), CPU).job.nodes[0].workers[0].argv
    assert argv == head + ("--lr", "1")


def test_num_nodes_and_num_gpus_take_the_first_hosts_and_slots(tmp_path):
    job = build_job(_cfg(tmp_path, "a slots=4\nb slots=4\nc slots=4\n", num_nodes=2, num_gpus=2), CPU).job
    assert job.hosts == ("a", "b") and [n.env["CUDA_VISIBLE_DEVICES"] for n in job.nodes] == ["0,1", "0,1"]
    with pytest.raises(HostfileError, match="only 3 hosts"):
        build_job(_cfg(tmp_path, "a slots=4\nb slots=4\nc slots=4\n", num_nodes=4), CPU)
    with pytest.raises(HostfileError, match="host 'b' has only 1 slots"):
        build_job(_cfg(tmp_path, "a slots=4\nb slots=1\n", num_gpus=2), CPU)
    with pytest.raises(UsageError, match="cannot be combined"):
        build_job(_cfg(tmp_path, "a slots=4\n", num_gpus=2, include="a"), CPU)


def test_launcher_choice(tmp_path):
    assert build_job(_cfg(tmp_path, "localhost slots=2\n"), CPU).job.launcher == "local"
    assert build_job(_cfg(tmp_path, "localhost slots=2\n", force_multi=True), CPU).job.launcher == "ssh"
    assert build_job(_cfg(tmp_path, "localhost slots=2\nnode1 slots=2\n", include="localhost"),
                     CPU).job.launcher == "local"


def test_node_spec_json_round_trip(tmp_path):
    job = build_job(_cfg(tmp_path, "a slots=2\nb slots=2\n", each_rank_log="logs", bind_cores_to_rank=True,
                         bind_core_list=(0, 1)), CPU).job
    from dslaunch.launcher.spec import NodeSpec

    for node in job.nodes:
        line = node.to_json()
        assert "\n" not in line and NodeSpec.from_json(line) == node


@pytest.mark.parametrize("flags, words", [
    ({"num_nodes": -5}, "--num_nodes -5: expected 1 to 65536 hosts (or -1, the default: all)"),
    ({"num_nodes": 0}, "--num_nodes 0: expected 1 to 65536 hosts"),
    ({"num_nodes": 65537}, "--num_nodes 65537: expected 1 to 65536 hosts"),
    ({"num_gpus": 0}, "--num_gpus 0: expected 1 to 4096 workers per host"),
    ({"num_gpus": -2}, "--num_gpus -2: expected 1 to 4096 workers per host"),
    ({"num_gpus": 100000}, "--num_gpus 100000: expected 1 to 4096 workers per host (or -1, the default: all)"),
    ({"num_gpus": 999999999999999999}, "--num_gpus 999999999999999999: expected 1 to 4096"),
])
def test_counts_are_positive_or_minus_one_for_all(tmp_path, flags, words):
    with pytest.raises(UsageError, match=re.escape(words)):
        build_job(_cfg(tmp_path, "a slots=2\nb slots=2\n", **flags), CPU)
    with pytest.raises(UsageError, match=re.escape(words)):  # no hostfile: same check, before detection
        build_job(_cfg(tmp_path, **flags), CPU)
    job = build_job(_cfg(tmp_path, "a slots=2\nb slots=2\n", num_nodes=-1, num_gpus=-1), CPU).job
    assert job.hosts == ("a", "b") and job.world_size == 4


def test_local_launcher_with_several_hosts_is_an_error_at_plan_time(tmp_path):
    with pytest.raises(UsageError, match=r"the local launcher runs one node, but 2 hosts are selected \(a, b\)"):
        build_job(_cfg(tmp_path, "a slots=2\nb slots=2\n", launcher="local"), CPU)
    with pytest.raises(UsageError, match="2 hosts are selected"):  # both local: chosen automatically
        build_job(_cfg(tmp_path, "localhost slots=1\n127.0.0.1 slots=1\n"), CPU)
    assert build_job(_cfg(tmp_path, "a slots=2\nb slots=2\n", launcher="local", num_nodes=1), CPU).job.hosts == ("a",)


def test_cuda_visible_devices_picks_the_local_gpus_in_its_order(tmp_path):
    plan = build_job(_cfg(tmp_path, visible_devices="3,1"), GPU4)
    (node,) = plan.job.nodes
    assert node.env["CUDA_VISIBLE_DEVICES"] == "3,1" and plan.job.world_size == 2
    assert [w.local_rank for w in node.workers] == [0, 1]
    assert plan.notes == ("CUDA_VISIBLE_DEVICES=3,1: using GPUs 3,1",)
    job = build_job(_cfg(tmp_path, visible_devices="2,0,3", num_gpus=2), GPU4).job  # the first N listed
    assert job.nodes[0].env["CUDA_VISIBLE_DEVICES"] == "2,0"
    with pytest.raises(UsageError, match="--num_gpus 3: CUDA_VISIBLE_DEVICES=1,3 lists 2 GPUs"):
        build_job(_cfg(tmp_path, visible_devices="1,3", num_gpus=3), GPU4)


def test_cuda_visible_devices_gives_way_to_include_and_to_a_hostfile(tmp_path):
    plan = build_job(_cfg(tmp_path, visible_devices="3", include="localhost:0,1"), GPU4)
    assert plan.job.nodes[0].env["CUDA_VISIBLE_DEVICES"] == "0,1"
    assert plan.notes == ("CUDA_VISIBLE_DEVICES=3 ignored: --include/--exclude choose the GPUs",)
    job = build_job(_cfg(tmp_path, "a slots=2\n", visible_devices="1"), GPU4).job  # remote slots: the hostfile's
    assert job.nodes[0].env["CUDA_VISIBLE_DEVICES"] == "0,1"


def test_empty_cuda_visible_devices_means_no_gpu(tmp_path):
    plan = build_job(_cfg(tmp_path, visible_devices="", num_gpus=2), GPU4)
    (node,) = plan.job.nodes
    assert "CUDA_VISIBLE_DEVICES" not in node.env and plan.job.world_size == 2
    assert plan.notes == ("no GPU (CUDA_VISIBLE_DEVICES is set and empty): starting 2 CPU worker processes "
                          "(use the gloo backend)",)


def test_cuda_visible_devices_without_gpus_is_left_alone(tmp_path):
    plan = build_job(_cfg(tmp_path, visible_devices="7"), CPU)
    assert plan.job.world_size == 1 and "CUDA_VISIBLE_DEVICES" not in plan.job.nodes[0].env


@pytest.mark.parametrize("value, words", [
    ("4", "CUDA_VISIBLE_DEVICES='4': there is no GPU 4; NVML reports 4 GPUs (0-3)"),
    ("0,0", "CUDA_VISIBLE_DEVICES='0,0': GPU 0 is listed twice"),
    ("GPU-8a1b", "CUDA_VISIBLE_DEVICES='GPU-8a1b': 'GPU-8a1b' is not a GPU index; dslaunch reads indices"),
    ("-1", "'-1' is not a GPU index"),
    ("0,,1", "'' is not a GPU index"),
    ("1_0", "'1_0' is not a GPU index"),
])
def test_bad_cuda_visible_devices_is_one_clear_error(tmp_path, value, words):
    with pytest.raises(UsageError, match=re.escape(words)):
        build_job(_cfg(tmp_path, visible_devices=value), GPU4)


def test_no_ssh_keeps_only_this_nodes_workers_with_their_global_ranks(tmp_path):
    hf = "a slots=2\nb slots=3\nc slots=1\n"
    plan = build_job(_cfg(tmp_path, hf, no_ssh=True, node_rank=1, master_addr="10.0.0.1"), CPU)
    job = plan.job
    (node,) = job.nodes
    assert job.launcher == "local" and job.world_size == 6 and job.master_addr == "10.0.0.1"
    assert node.host == "b" and node.node_rank == 1 and node.env["CUDA_VISIBLE_DEVICES"] == "0,1,2"
    assert [(w.global_rank, w.local_rank) for w in node.workers] == [(2, 0), (3, 1), (4, 2)]
    assert "DSLAUNCH_RENDEZVOUS_ID" not in node.env  # each node's controller names the job itself
    assert {k: node.env[k] for k in ("NODE_RANK", "CROSS_SIZE", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR")} == {
        "NODE_RANK": "1", "CROSS_SIZE": "3", "WORLD_SIZE": "6", "LOCAL_WORLD_SIZE": "3", "MASTER_ADDR": "10.0.0.1"}
    assert plan.notes == ("--no_ssh: starting node 1 of 3 (b: ranks 2-4 of 6) here; start each other node the "
                          "same way with its own --node_rank",)
    # the selection flags apply before the node is picked, identically on every node
    job = build_job(_cfg(tmp_path, hf, no_ssh=True, node_rank=1, master_addr="a", exclude="a"), CPU).job
    assert job.nodes[0].host == "c" and job.nodes[0].workers[0].global_rank == 3 and job.world_size == 4


@pytest.mark.parametrize("flags, words", [
    ({"no_ssh": True, "master_addr": "a"}, "--no_ssh needs --node_rank N, this node's index (valid: 0-1, "),
    ({"no_ssh": True, "master_addr": "a", "node_rank": 2}, "--node_rank 2 is out of range (valid: 0-1, "),
    ({"no_ssh": True, "master_addr": "a", "node_rank": -3}, "--node_rank -3 is out of range"),
    ({"no_ssh": True, "node_rank": 0}, "--no_ssh needs --master_addr: the address of node 0 (a), reachable"),
    ({"no_ssh": True, "node_rank": 0, "master_addr": "a", "launcher": "ssh"}, "leave out --launcher ssh"),
    ({"node_rank": 1}, "--node_rank 1 is only used with --no_ssh"),
])
def test_no_ssh_errors(tmp_path, flags, words):
    with pytest.raises(UsageError, match=re.escape(words)):
        build_job(_cfg(tmp_path, "a slots=2\nb slots=2\n", **flags), CPU)


def test_no_ssh_without_hostfile_is_node_0_of_localhost(tmp_path):
    job = build_job(_cfg(tmp_path, no_ssh=True, node_rank=0, master_addr="127.0.0.1", num_gpus=2), CPU).job
    assert job.hosts == ("localhost",) and job.world_size == 2 and job.launcher == "local"
    with pytest.raises(UsageError, match=re.escape("--node_rank 1 is out of range (valid: 0, the selected")):
        build_job(_cfg(tmp_path, no_ssh=True, node_rank=1, master_addr="127.0.0.1"), CPU)


def test_elastic_batch_for_a_new_world_size_comes_from_the_scripts_ds_config(tmp_path):
    from dslaunch.errors import ConfigError
    from dslaunch.launcher.plan import elastic_batch_for

    ds = tmp_path / "ds.json"
    ds.write_text('{"elasticity": {"enabled": true, "max_train_batch_size": 16, "micro_batch_sizes": [4, 8, 16],'
                  ' "min_gpus": 4, "max_gpus": 8, "prefer_larger_batch": false}}')
    cfg = LaunchConfig(user_script="train.py", user_args=("--deepspeed_config", str(ds)))
    assert elastic_batch_for(cfg, 4) == ("train_batch_size 16 = 4 x 1 x 4 (micro batch x accumulation steps x "
                                         "world size)")
    with pytest.raises(ConfigError, match="world size 6 cannot split the elastic global batch 16"):
        elastic_batch_for(replace(cfg, user_args=(f"--deepspeed_config={ds}",)), 6)
    assert elastic_batch_for(LaunchConfig(user_script="train.py"), 6) is None


def test_a_restart_plan_leaves_lost_hosts_out_caps_elastic_nodes_and_tells_the_workers(tmp_path):
    hosts = "a slots=2\nb slots=2\nc slots=2\n"
    job = build_job(_cfg(tmp_path, hosts, drop_hosts=("b",), restart_count=2, max_restarts=3,
                         resume_from="/ck"), CPU).job
    assert job.hosts == ("a", "c") and job.world_size == 4
    assert [w.global_rank for n in job.nodes for w in n.workers] == [0, 1, 2, 3]
    env = job.nodes[1].env
    assert (env["NODE_RANK"], env["WORLD_SIZE"], env["TORCHELASTIC_RESTART_COUNT"], env["DSLAUNCH_RESTART_COUNT"],
            env["TORCHELASTIC_MAX_RESTARTS"], env["DSLAUNCH_RESUME_FROM"]) == ("1", "4", "2", "2", "3", "/ck")
    assert build_job(_cfg(tmp_path, hosts, max_nodes=2), CPU).job.hosts == ("a", "b")
    with pytest.raises(HostfileError, match="no host left: every selected host was lost"):
        build_job(_cfg(tmp_path, hosts, drop_hosts=("a", "b", "c")), CPU)


def test_the_job_directory_name_cannot_be_guessed_from_the_time_and_pid(tmp_path):
    """The job's directory must be new: a name predictable from the clock and the pid could be
    created first by another user in a shared --log_dir, and the job would refuse to start."""
    names = {os.path.basename(build_job(_cfg(tmp_path, num_gpus=1), CPU).job.monitor.log_dir) for _ in range(3)}
    assert len(names) == 3  # same second, same pid: still three names
    assert all(re.fullmatch(rf"\d{{8}}-\d{{6}}-{os.getpid()}-[0-9a-f]{{6}}", n) for n in names), names
