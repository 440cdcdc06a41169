"""The test SLURM: slurmctld + one slurmd per namespace host, brought up once per test session.

``scripts/cluster/slurm.py`` builds it (see there) on top of the SSH test cluster; this fixture
brings it up, hands the tests a ``Slurm`` (its hosts, the environment SLURM's commands need, a
batch submitter) and takes it down at the end unless it was already up before the session (then
it is left as found). Skips only where it cannot exist: not root, no ``ip netns``, no slurm-wlm.
Run these tests under ``flock /tmp/dslaunch-cluster.lock``: the namespace hosts are shared.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass

import pytest

from tests.launcher.runners.hosts import descends, load_script, namespace_processes, wait_until_clean

N_HOSTS = 3


@dataclass(frozen=True)
class Slurm:
    """What the tests need to know about the running test SLURM."""

    conf: str
    hosts: tuple[str, ...]
    addrs: tuple[str, ...]

    def env(self, **extra: str) -> dict[str, str]:
        """The environment SLURM's commands (and jobs, which inherit it) need; one thread per rank."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
        return {**env, "SLURM_CONF": self.conf, "OMP_NUM_THREADS": "1", **extra}

    def run(self, *cmd: str, timeout: float = 60, **extra: str) -> subprocess.CompletedProcess:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=self.env(**extra))

    def job_info(self, job_id: str) -> dict[str, str]:
        """``scontrol show job``'s fields (JobState, ExitCode, NodeList, ...)."""
        out = self.run("scontrol", "-o", "show", "job", job_id).stdout
        return dict(kv.split("=", 1) for kv in out.split() if "=" in kv)

    def job_state(self, job_id: str) -> tuple[str, str]:
        """(state, exit code ``N:S``) of a job."""
        fields = self.job_info(job_id)
        return fields.get("JobState", "?"), fields.get("ExitCode", "?")

    def dslaunch(self, nodes: int, per_node: int, *args: str, timeout: float = 120,
                 **extra: str) -> subprocess.CompletedProcess:
        """``salloc -N nodes --ntasks-per-node per_node dslaunch ARGS``: dslaunch inside an allocation."""
        return self.run(*_salloc(nodes, per_node, args), timeout=timeout, **extra)

    def start_dslaunch(self, nodes: int, per_node: int, *args: str) -> subprocess.Popen:
        """``dslaunch`` as above, running: text pipes for stdout and stderr, where salloc's
        ``Granted job allocation <id>`` line comes first."""
        return subprocess.Popen(_salloc(nodes, per_node, args, quiet=False), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, env=self.env())

    def job_processes(self, host: str) -> list[str]:
        """Every process in ``host``'s network namespace except its daemons (sshd, slurmd)."""
        return namespace_processes(host, lambda pid, args: "sshd" in args or args.startswith("/usr/sbin/slurmd "))

    def step_processes(self, host: str) -> list[int]:
        """The job's own processes on ``host``: everything below a ``slurmstepd`` there (node agent,
        its workers), never SLURM's daemons themselves."""
        procs = {int(p.split()[0]): p.split(None, 1)[1] for p in self.job_processes(host)}
        stepds = [pid for pid, args in procs.items() if args.startswith("slurmstepd")]
        return [pid for pid in procs if pid not in stepds and any(descends(pid, s) for s in stepds)]

    def wait_no_job_processes(self, timeout: float) -> dict[str, list[str]]:
        """Poll until no host has job processes left; return what is left (empty dict = clean)."""
        return wait_until_clean(self.hosts, self.job_processes, timeout, poll=0.1)

    def wait_idle(self, timeout: float = 30) -> None:
        """Until no job is left in the queue (a failed test must not hold nodes for the next)."""
        deadline = time.monotonic() + timeout
        while self.run("squeue", "-h").stdout.strip() and time.monotonic() < deadline:
            time.sleep(0.2)


def _salloc(nodes: int, per_node: int, args: tuple[str, ...], quiet: bool = True) -> list[str]:
    return ["salloc", *(["--quiet"] if quiet else []), f"--nodes={nodes}", f"--ntasks-per-node={per_node}",
            sys.executable, "-m", "dslaunch.launcher.cli", *args]


@pytest.fixture(scope="session")
def slurm() -> Slurm:
    module = load_script("slurm")
    why = module.missing_facilities()
    if why and (os.geteuid() != 0 or "ip netns" in why):
        pytest.skip(f"test SLURM unavailable: {why}")
    if why:  # root with namespaces but no slurm-wlm: a setup mistake, not a skip
        pytest.fail(f"test SLURM cannot be built: {why} (make system-deps)")
    state, hosts = module.state_dir_default(), module.cluster.state_dir_default()
    st = module.status(state)
    was_up = st["slurmctld"] and len(st["nodes"]) >= N_HOSTS
    hosts_were_up = all(module.cluster.status(hosts)["sshd"].get(f"{module.cluster.PREFIX}node{k}")
                        for k in range(1, N_HOSTS + 1))
    info = module.up(N_HOSTS, state)
    try:
        yield Slurm(conf=info["slurm_conf"], hosts=tuple(info["hosts"]), addrs=tuple(info["addrs"]))
    finally:
        if not was_up:  # slurmd in the hosts would read as leftovers to the SSH tests
            module.down(state)
        if not hosts_were_up:
            module.cluster.down(hosts)


@pytest.fixture(autouse=True)
def _no_job_outlives_its_test(request):
    """A failing test must not leave a running job behind for the next one."""
    yield
    if "slurm" not in request.fixturenames:
        return
    slurm = request.getfixturevalue("slurm")
    slurm.run("scancel", "--user", "root")
    slurm.wait_idle()
