"""DeepSpeed's runner classes (``deepspeed.launcher.multinode_runner``) as command builders, on a
2-host pool: the commands they build, include/exclude, ``--launcher_args``, and their refusals.
The pdsh command's per-node part is run for real (``--dry-run``): it is dslaunch's agent."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from dslaunch.launcher import multinode_runner as mn
from dslaunch.launcher.runner import encode_world_info, parse_args, parse_resource_filter

pytestmark = pytest.mark.timeout(60)

POOL = {"worker-0": 4, "worker-1": 4}


@pytest.fixture
def hostfile(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("")
    path = tmp_path / "hosts"
    path.write_text("worker-0 slots=4\nworker-1 slots=4\n")
    return str(path)


def _runner(cls, flags, pool=POOL):
    args = parse_args([*flags, "train.py", "--msg", "a b"])
    return cls(args, encode_world_info(pool)) if cls is mn.PDSHRunner else cls(args, encode_world_info(pool), pool)


def test_pdsh_starts_dslaunchs_agent_on_each_selected_host(hostfile):
    active = parse_resource_filter({h: list(range(n)) for h, n in POOL.items()}, exclude_str="worker-0:1,2")
    runner = _runner(mn.PDSHRunner, ["-H", hostfile, "--master_addr", "127.0.0.1", "--ssh_port", "2222"])
    runner.add_export("NCCL_DEBUG", "INFO")
    cmd, kill, env = runner.get_cmd({}, active)
    assert cmd[:6] == ["pdsh", "-S", "-f", "1024", "-w", "worker-0,worker-1"]
    assert env == {"PDSH_RCMD_TYPE": "ssh", "PDSH_SSH_ARGS_APPEND": "-p 2222"}
    assert cmd[6].startswith("export NCCL_DEBUG=INFO; cd ")
    assert "--include=worker-0:0,3@worker-1:0,1,2,3" in cmd and "--node_rank=%n" in cmd
    assert cmd[-3:] == ["train.py", "--msg", "'a b'"]  # quoted: pdsh runs one shell line per host
    assert kill[:6] == cmd[:6] and kill[-1].startswith("pkill -f '[d]slaunch.launcher.cli --no_ssh --node_rank=%n")
    # what pdsh runs on worker-1 (%n = 1), with --dry-run: its 4 slots are ranks 2-5 of 6
    node = [a.replace("%n", "1") for a in cmd[cmd.index(sys.executable):]]
    node.insert(node.index("train.py"), "--dry-run")
    out = subprocess.run(node, capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    assert "starting node 1 of 2 (worker-1: ranks 2-5 of 6)" in out.stderr
    assert out.stdout.count("WORLD_SIZE=6") == 4


def test_openmpi_uses_the_hostfile_and_eth0_unless_launcher_args_name_the_nic(hostfile):
    cmd = _runner(mn.OpenMPIRunner, ["-H", hostfile]).get_cmd({}, POOL)
    assert cmd[:8] == ["mpirun", "-n", "8", "-hostfile", hostfile, "--mca", "btl", "^openib"]
    assert cmd[8:11] == ["--mca", "btl_tcp_if_include", "eth0"] and ["-x", "UCX_TLS=tcp"] == cmd[11:13]
    assert cmd[13:] == [sys.executable, "-u", "train.py", "--msg", "a b"]
    for dashes in ("-mca", "--mca"):  # DeepSpeed's abbreviation --launcher_arg is accepted here
        cmd = _runner(mn.OpenMPIRunner, ["-H", hostfile, "--launcher_arg", f"{dashes} btl_tcp_if_include eth1"]
                      ).get_cmd({}, POOL)
        assert "eth0" not in cmd and cmd[8:11] == [dashes, "btl_tcp_if_include", "eth1"]


def test_mpich_impi_mvapich_start_the_same_ranks_on_every_host(hostfile):
    cmd = _runner(mn.MPICHRunner, ["-H", hostfile, "--module"]).get_cmd({}, POOL)
    assert cmd[:5] == ["mpirun", "-n", "8", "-ppn", "4"]
    assert cmd[cmd.index("MASTER_ADDR") - 1:cmd.index("MASTER_ADDR") + 2] == ["-genv", "MASTER_ADDR", "worker-0"]
    assert cmd[cmd.index("-hosts") + 1] == "worker-0,worker-1" and cmd[-5:-3] == ["-u", "-m"]
    impi = _runner(mn.IMPIRunner, ["-H", hostfile, "--no_python"]).get_cmd({}, POOL)
    sections = " ".join(impi).split(" : ")
    assert len(sections) == 8 and sections[5].endswith("-n 1 -env RANK 5 -env LOCAL_RANK 1 train.py --msg a b")
    mv = _runner(mn.MVAPICHRunner, ["-H", hostfile]).get_cmd({}, POOL)
    assert mv[:7] == ["mpirun", "-np", "8", "-ppn", "4", "-hosts", "worker-0,worker-1"]
    assert mv[mv.index("MV2_SMP_USE_CMA") - 1:mv.index("MV2_SMP_USE_CMA") + 2] == ["-env", "MV2_SMP_USE_CMA", "0"]
    with pytest.raises(ValueError, match=r"same number of ranks on every host; the hostfile has worker-0=4, w=2"):
        _runner(mn.MPICHRunner, ["-H", hostfile], {"worker-0": 4, "w": 2}).get_cmd({}, {})


@pytest.mark.parametrize("cls", [mn.OpenMPIRunner, mn.MPICHRunner, mn.IMPIRunner, mn.MVAPICHRunner])
@pytest.mark.parametrize("flags, words", [(["-i", "worker-1"], "--include/--exclude"),
                                          (["--num_gpus", "2"], "--num_nodes/--num_gpus")])
def test_mpi_runners_refuse_flags_that_pick_slots(hostfile, cls, flags, words):
    with pytest.raises(ValueError, match=f"starts every slot of the hostfile: {words} cannot be used"):
        _runner(cls, ["-H", hostfile, *flags])


def test_slurm_picks_nodes_for_include_and_exclude(hostfile):
    cmd = _runner(mn.SlurmRunner, ["-H", hostfile, "-i", "worker-1", "--launcher_args", "-p gpu"]).get_cmd({}, POOL)
    assert cmd[:7] == ["srun", "-n", "8", "-p", "gpu", "--nodelist", "worker-1"]
    runner = _runner(mn.SlurmRunner, ["-H", hostfile, "-e", "worker-0", "--num_gpus", "2"])
    runner.add_export("NCCL_IB_HCA", "mlx5_0 mlx5_1")
    cmd = runner.get_cmd({}, POOL)
    assert ["--exclude", "worker-0", "--gpus", "2", '--export=ALL,NCCL_IB_HCA="mlx5_0 mlx5_1"'] == cmd[3:8]
    with pytest.raises(ValueError, match="srun picks nodes, not slots"):
        _runner(mn.SlurmRunner, ["-H", hostfile, "-i", "worker-1:0"])


@pytest.mark.parametrize("cls, tool", [(mn.PDSHRunner, "pdsh"), (mn.OpenMPIRunner, "ompi_info"),
                                       (mn.MPICHRunner, "mpirun"), (mn.SlurmRunner, "sinfo")])
def test_backend_exists_looks_for_the_tool(hostfile, cls, tool):
    runner = _runner(cls, ["-H", hostfile])
    assert runner.backend_exists() is (shutil.which(tool) is not None)
    assert runner.name == {"pdsh": "pdsh", "ompi_info": "openmpi", "mpirun": "mpich", "sinfo": "slurm"}[tool]
