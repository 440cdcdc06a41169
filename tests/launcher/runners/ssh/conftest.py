"""The test cluster: 3 network-namespace hosts with one sshd each, built once per test session.

``scripts/cluster/cluster.py`` builds it (see there); this fixture brings it up, hands the tests a
``Cluster`` (hosts, ssh config, hostfile, per-host process listing) and tears it down at the end,
unless it was already up before the session (then it is left as found). Skips only where such a
cluster cannot exist: not root, or no working ``ip netns``.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.launcher.runners.hosts import load_script, namespace_processes, wait_until_clean

ROOT = Path(__file__).resolve().parents[4]
N_HOSTS = 3


@dataclass(frozen=True)
class Cluster:
    """What the tests need to know about the running cluster."""

    state_dir: Path
    hosts: tuple[str, ...]
    addrs: tuple[str, ...]
    ssh_config: str
    known_hosts: str
    identity: str
    hostfile: str
    launched: list = field(default_factory=list)
    """``dslaunch`` processes started by the current test (killed after it, whatever happened)."""

    @property
    def launcher_args(self) -> str:
        return f"-F {self.ssh_config}"

    def sshd_pid(self, host: str) -> int:
        return int((self.state_dir / host / "sshd.pid").read_text().split()[0])

    def job_processes(self, host: str) -> list[str]:
        """Every process in ``host``'s network namespace except its daemons (the listening sshd, and
        the slurmd of ``scripts/cluster/slurm.py`` when the test SLURM is up): 'pid args'."""
        sshd = self.sshd_pid(host)
        return namespace_processes(host, lambda pid, args: pid == sshd or args.startswith("/usr/sbin/slurmd "))

    def wait_no_job_processes(self, timeout: float) -> dict[str, list[str]]:
        """Poll until no host has job processes left; return what is left (empty dict = clean)."""
        return wait_until_clean(self.hosts, self.job_processes, timeout)

    @contextlib.contextmanager
    def link_cut(self, host: str) -> Iterator[float]:
        """``host``'s cable out for the block, in again afterwards whatever happened (``cluster.py``
        ``set_link``, which also clears what the cut left in the hosts' neighbour tables); yields
        the time of the cut."""
        module = load_script("cluster")
        module.set_link(host, False)
        try:
            yield time.time()
        finally:
            module.set_link(host, True)

    def dslaunch(self, *args: str, hostfile: str | None = None, launcher_args: str | None = None,
                 **kwargs) -> subprocess.Popen:
        """Start ``dslaunch --hostfile H --launcher_args '-F config' ARGS`` (stdout/stderr piped)."""
        cmd = [sys.executable, "-m", "dslaunch.launcher.cli", "--hostfile", hostfile or self.hostfile,
               "--launcher_args", launcher_args or self.launcher_args, *args]
        env = {**os.environ, "OMP_NUM_THREADS": "1", **kwargs.pop("env", {})}
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env=env, cwd=kwargs.pop("cwd", ROOT), **kwargs)
        self.launched.append(proc)
        return proc


@pytest.fixture(scope="session")
def cluster() -> Cluster:
    module = load_script("cluster")
    why = module.missing_facilities()
    if why and (os.geteuid() != 0 or "ip netns" in why):
        pytest.skip(f"test cluster unavailable: {why}")
    if why:  # root with namespaces but no sshd/ssh-keygen: a setup mistake, not a skip
        pytest.fail(f"test cluster cannot be built: {why}")
    state = module.state_dir_default()
    was_up = all(module.status(state)["sshd"].get(f"{module.PREFIX}node{k}") for k in range(1, N_HOSTS + 1))
    info = module.up(N_HOSTS, state)
    try:
        yield Cluster(
            state_dir=state, hosts=tuple(h["name"] for h in info["hosts"]),
            addrs=tuple(h["addr"] for h in info["hosts"]), ssh_config=info["ssh_config"],
            known_hosts=info["known_hosts"], identity=info["identity"], hostfile=info["hostfile"],
        )
    finally:
        if not was_up:
            module.down(state)


@pytest.fixture(autouse=True)
def _no_launch_outlives_its_test(request):
    """A failing test must not leave a hanging job behind for the next one."""
    yield
    if "cluster" not in request.fixturenames:
        return
    cluster = request.getfixturevalue("cluster")
    for proc in cluster.launched:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    cluster.launched.clear()


@pytest.fixture(scope="session")
def local_losses_world4() -> list[tuple[int, float]]:
    """The example ZeRO-2 job's (step, loss) lines at 4 ranks on this host (``test_train.TRAIN``):
    the reference every 2-host x 2-rank transport (mpirun, pods) must reproduce."""
    from tests.distributed import free_port
    from tests.launcher.runners.ssh.test_train import TRAIN, _losses

    local = subprocess.run([sys.executable, "-m", "dslaunch.launcher.cli", "--num_gpus", "4", "--master_port",
                            str(free_port()), *TRAIN], capture_output=True, text=True, cwd=ROOT, timeout=120,
                           env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert local.returncode == 0, local.stderr[-3000:]
    return _losses(local.stdout)
