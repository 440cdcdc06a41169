"""--launcher openmpi across two namespace hosts: Open MPI's mpirun (its rsh agent is ssh with the
cluster's config) starts each host's agent; the job trains as the same 4 ranks on one host."""

from __future__ import annotations

import shutil

import pytest

from tests.launcher.runners.ssh.helpers import Lines
from tests.launcher.runners.ssh.test_train import TRAIN, _losses

pytestmark = [pytest.mark.cluster, pytest.mark.slow,
              pytest.mark.skipif(shutil.which("mpirun") is None, reason="no mpirun (make system-deps installs Open MPI)")]


@pytest.mark.timeout(150)
def test_zero2_through_mpirun_on_two_hosts_matches_one_host(cluster, free_port, tmp_path, local_losses_world4):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("".join(f"{h} slots=2\n" for h in cluster.hosts[:2]))
    rsh = f"--mca plm_rsh_agent 'ssh -F {cluster.ssh_config}'"
    mpi = Lines(cluster.dslaunch("--launcher", "openmpi", "--master_port", str(free_port), *TRAIN,
                                 hostfile=str(hostfile), launcher_args=rsh))
    assert mpi.finish(120) == 0, mpi.text("err")[-3000:]
    assert cluster.wait_no_job_processes(5) == {}
    got = _losses(mpi.text("out"))
    assert [s for s, _ in got] == [10, 20] and got[1][1] < got[0][1]
    # as test_train's ssh job against one host: same ranks, gloo's sums may round apart
    assert [v for _, v in got] == pytest.approx([v for _, v in local_losses_world4], abs=1e-4)
    assert f"{cluster.hosts[0]}: [rank0] world_size=4 zero_stage=2" in mpi.text("out")
