"""Process mechanics for worker processes: child setup, group signals, exit codes, the watchdog.

Guarantees this module provides to the agent:

- every worker leads its own session, hence its own process group: one ``killpg`` reaches the
  worker and the children it spawned (unless they create their own session). A session rather
  than just a group because the kernel's scheduler autogroups follow sessions: in one shared
  session (``setpgid``) all workers of a node split one CPU share, which made two ranks per host
  1.3-2x slower than two independent processes. Workers have no controlling terminal (stdin is
  /dev/null anyway); terminal signals (Ctrl-C, hangup) reach the launcher, which forwards them;
- every worker has ``PR_SET_PDEATHSIG=SIGKILL``: if the thread that spawned it dies (agent or
  controller SIGKILLed), the kernel kills the worker;
- a ``watchdog.Watchdog`` process outlives a SIGKILLed agent just long enough to ``killpg``
  every worker group, so grandchildren (which PDEATHSIG does not reach) die too, and to remove
  the agent's ``--save_pid`` file;
- the agent is a child subreaper: descendants that left their group (``setsid`` daemons) and
  lost their parent are re-parented to the agent, which kills them when the job ends
  (``kill_adopted``). Limitation: such daemons survive a SIGKILLed agent.

No torch, no psutil: this runs on the launch path where every millisecond counts.
"""

from __future__ import annotations

import ctypes
import os
import signal
from collections.abc import Callable, Sequence

__all__ = ["exit_code_of", "child_setup", "signal_group", "become_subreaper", "kill_adopted"]

_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36
_LIBC = ctypes.CDLL(None, use_errno=True)  # loaded before fork: the child only calls into it


def exit_code_of(returncode: int) -> tuple[int, str | None]:
    """Map a ``Popen.returncode`` to (shell exit code, signal name or None).

    A death by signal N becomes 128+N (never 0), as a shell reports it.
    """
    if returncode >= 0:
        return returncode, None
    signum = -returncode
    try:
        name = signal.Signals(signum).name
    except ValueError:
        name = f"signal {signum}"
    return 128 + signum, name


def child_setup(cores: Sequence[int] = ()) -> Callable[[], None]:
    """Return a ``preexec_fn``: own session and group, PDEATHSIG=SIGKILL, optional CPU pinning.

    Note: PDEATHSIG fires when the *thread* that forked the child exits, so spawn workers from a
    thread that lives as long as the job (the main thread).
    """
    parent = os.getpid()
    cpu_set = set(cores)

    def setup() -> None:
        os.setsid()  # also a new group (pgid = pid); own autogroup, see the module docstring
        _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent:  # the parent died before prctl took effect
            os._exit(137)
        if cpu_set:
            os.sched_setaffinity(0, cpu_set)

    return setup


def signal_group(pgid: int, sig: int) -> bool:
    """Send ``sig`` to process group ``pgid``; False when the group is already gone."""
    try:
        os.killpg(pgid, sig)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def become_subreaper() -> None:
    """Orphaned descendants are re-parented to this process instead of init."""
    _LIBC.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


def kill_adopted(keep: set[int], rounds: int = 5) -> int:
    """SIGKILL and reap our children not in ``keep`` (adopted orphans); returns how many.

    Several rounds, since killing an adopted process can orphan its own children.
    """
    killed = 0
    for _ in range(rounds):
        pids = [p for p in _children() if p not in keep]
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                killed += 1
            except (ProcessLookupError, ChildProcessError):
                pass
    return killed


def _children() -> list[int]:
    pids: list[int] = []
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return pids
    for tid in tasks:
        try:
            with open(f"/proc/self/task/{tid}/children") as f:
                pids.extend(int(p) for p in f.read().split())
        except OSError:  # thread gone, or a kernel without CONFIG_PROC_CHILDREN
            continue
    return pids


def proc_stat(pid: int) -> list[str] | None:
    """The fields of ``/proc/PID/stat`` from the state on (field 3 is index 0), or None when there
    is no such process (or no ``/proc``). Split after the name, which may hold spaces and ')'."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().decode("ascii", "replace").rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
