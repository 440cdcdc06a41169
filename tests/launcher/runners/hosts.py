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
from typing import IO

import pytest

ROOT = Path(__file__).resolve().parents[3]
CLUSTER_LOCK = "/tmp/dslaunch-cluster.lock"


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
    ``CLUSTER_LOCK`` (the cluster is shared; already held where an ancestor holds it), with the
    ``cluster.py`` and ``netns_ranks.py`` modules; skips the test where no cluster can exist."""
    cluster = load_script("cluster")
    why = cluster.missing_facilities()
    if why and (os.geteuid() != 0 or "ip netns" in why):
        pytest.skip(f"test cluster unavailable: {why}")
    ranks = load_script("netns_ranks")
    with open(CLUSTER_LOCK, "w") as lock:
        if not held_by_an_ancestor(lock):
            fcntl.flock(lock, fcntl.LOCK_EX)
        yield cluster, ranks, ranks.first_hosts(cluster, n)


def lock_holders(lock: IO) -> set[int]:
    """The processes holding an flock on ``lock``'s file (``/proc/locks``; blocked waiters left out)."""
    st = os.fstat(lock.fileno())
    inode = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    rows = (line.split() for line in Path("/proc/locks").read_text().splitlines())
    # "7: FLOCK  ADVISORY  WRITE 32558 00:1f:2146316 0 EOF"; a waiter's row has "->" after the number
    return {int(row[4]) for row in rows if len(row) > 5 and row[1] == "FLOCK" and row[5] == inode}


def held_by_an_ancestor(lock: IO) -> bool:
    """Whether a process this one descends from holds the cluster lock: ``flock CLUSTER_LOCK pytest
    ...``, as the cluster conftests ask. Its child inherits that lock through the descriptor, not
    through this new open, so taking it here would wait on itself until the test's timeout (it
    did: test_onebit_cluster sat 10 min in a run of the cluster files under flock)."""
    me = os.getpid()
    return any(descends(me, holder) for holder in lock_holders(lock))


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
