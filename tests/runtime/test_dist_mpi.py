"""The rank environment of a process a site's own ``mpirun``/``mpiexec`` started (no dslaunch
launcher): from the MPI launcher's variables, as DeepSpeed's ``auto_mpi_discovery`` finds it."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import pytest

from dslaunch.errors import UsageError
from dslaunch.runtime.dist import discovered_env, mpi_env

pytestmark = pytest.mark.timeout(60)

OPEN_MPI = {"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
            "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}
MPICH = {"PMI_RANK": "3", "PMI_SIZE": "4", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "4"}
MVAPICH = {"MV2_COMM_WORLD_RANK": "3", "MV2_COMM_WORLD_SIZE": "4", "MV2_COMM_WORLD_LOCAL_RANK": "1",
           "MV2_COMM_WORLD_LOCAL_SIZE": "4"}


@pytest.mark.parametrize("env", [MPICH, MVAPICH], ids=["mpich", "mvapich2"])
def test_one_host_jobs_of_each_flavour_get_rank_world_local_rank_and_loopback(env):
    assert mpi_env(env) == {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "MASTER_ADDR": "127.0.0.1"}


def test_across_hosts_a_given_master_addr_is_kept_else_one_line_says_what_to_set():
    assert "MASTER_ADDR" not in mpi_env({**OPEN_MPI, "MASTER_ADDR": "10.0.0.1"})
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        with pytest.raises(UsageError, match=r"Open MPI.*MASTER_ADDR is not set.*mpirun -x MASTER_ADDR"):
            mpi_env(OPEN_MPI)


@pytest.mark.parametrize("env", [{}, {**MPICH, "RANK": "0"}], ids=["no-mpi", "launcher-set"])
def test_nothing_without_mpi_or_under_a_launcher(env):
    assert mpi_env(env) == {}


def test_srun_wins_and_auto_mpi_discovery_false_reads_no_mpi():
    slurm = {"SLURM_JOB_ID": "7", "SLURM_STEP_ID": "0", "SLURM_PROCID": "2", "SLURM_NTASKS": "4"}
    assert discovered_env({**MPICH, **slurm})["RANK"] == "2"
    assert discovered_env(MPICH, mpi=False) == {}


SCRIPT = """
import os, torch, torch.distributed as dist
import dslaunch as deepspeed
deepspeed.init_distributed()
t = torch.tensor([float(dist.get_rank())])
dist.all_reduce(t)
print(f"rank={dist.get_rank()} world={dist.get_world_size()} local={os.environ['LOCAL_RANK']} sum={t.item():.0f}",
      flush=True)
dist.destroy_process_group()
"""


@pytest.mark.skipif(shutil.which("mpirun") is None, reason="no mpirun (make system-deps installs Open MPI)")
def test_a_script_started_by_a_bare_mpirun_finds_its_rank(tmp_path):
    """Open MPI's own launcher, no dslaunch command: init_distributed() forms the world of 2."""
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                            "MASTER_PORT")}
    from dslaunch.utils.ports import free_port

    root = ["--allow-run-as-root"] if os.geteuid() == 0 else []
    out = subprocess.run(["mpirun", "-n", "2", *root, "--oversubscribe", "--bind-to", "none",
                          "-x", f"MASTER_PORT={free_port()}", "-x", "PYTHONPATH", sys.executable, str(script)],
                         env={**env, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.getcwd()},
                         capture_output=True, text=True, timeout=50)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    # mpirun forwards both ranks' output through one pipe and may join their lines (seen once)
    lines = sorted(re.findall(r"rank=\d+ world=\d+ local=\d+ sum=\d+", out.stdout))
    assert lines == ["rank=0 world=2 local=0 sum=1", "rank=1 world=2 local=1 sum=1"]
