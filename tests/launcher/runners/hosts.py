"""What the SSH and SLURM cluster fixtures share: loading a ``scripts/cluster`` script as a module,
the job's processes on the namespace hosts (everything there but the hosts' daemons), and telling
which daemon started one (all hosts share PIDs); and, for tests that run ranks on the hosts directly
(``netns_ranks.py``), the locked hosts and the ranks' JSON outputs."""

from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[3]


def load_script(name: str) -> ModuleType:
    """``scripts/cluster/<name>.py`` as the module ``dsl_<name>`` (a script folder, not a package)."""
    spec = importlib.util.spec_from_file_location(f"dsl_{name}", ROOT / "scripts" / "cluster" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


@contextlib.contextmanager
def locked_hosts(n: int) -> Iterator[tuple[ModuleType, ModuleType, list[dict]]]:
    """Hosts 1..n of the namespace cluster (brought up if they are not), held under
    ``/tmp/dslaunch-cluster.lock`` (the cluster is shared), with the ``cluster.py`` and
    ``netns_ranks.py`` modules; skips the test where no cluster can exist."""
    cluster = load_script("cluster")
    why = cluster.missing_facilities()
    if why and (os.geteuid() != 0 or "ip netns" in why):
        pytest.skip(f"test cluster unavailable: {why}")
    ranks = load_script("netns_ranks")
    with open("/tmp/dslaunch-cluster.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield cluster, ranks, ranks.first_hosts(cluster, n)


def rank_outputs(results: list) -> list[dict | None]:
    """The last stdout line of every rank as JSON, None for a rank that printed nothing
    (``netns_ranks.RankResult``s); fails the test with the first failed rank's stderr."""
    failed = [r for r in results if r.returncode != 0]
    assert not failed, f"rank {failed[0].rank} exited {failed[0].returncode}: {failed[0].stderr[-3000:]}"
    return [json.loads(r.stdout.strip().splitlines()[-1]) if r.stdout.strip() else None for r in results]


def namespace_processes(host: str, is_daemon: Callable[[int, str], bool]) -> list[str]:
    """'pid args' of every process in ``host``'s network namespace that ``is_daemon`` does not name."""
    out = subprocess.run(["ip", "netns", "pids", host], capture_output=True, text=True).stdout
    found = []
    for pid in map(int, out.split()):
        try:
            args = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
        except OSError:
            continue  # exited meanwhile
        if not is_daemon(pid, args):
            found.append(f"{pid} {args}")
    return found


def wait_until_clean(hosts: Iterable[str], processes: Callable[[str], list[str]], timeout: float,
                     poll: float = 0.05) -> dict[str, list[str]]:
    """Poll until no host has job processes left; return what is left (empty dict = clean)."""
    deadline = time.monotonic() + timeout
    while True:
        left = {h: procs for h in hosts if (procs := processes(h))}
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(poll)


def ppid(pid: int) -> int:
    """``pid``'s parent (0 once it has exited)."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return 0


def descends(pid: int, ancestor: int) -> bool:
    """Whether ``ancestor`` is ``pid``'s parent, grandparent, ..."""
    while pid > 1:
        pid = ppid(pid)
        if pid == ancestor:
            return True
    return False
