"""Warm spare workers: interpreters with torch already imported, waiting to become a restarted rank.

Most of a restart is not the checkpoint: it is starting Python and importing torch in every new
worker (2 s on an idle core here, 17-27 s when the host is busy). A node that may restart keeps
one spare per local worker: a process started like a worker (own session, PDEATHSIG, by the
thread that outlives the job) that imports torch and then waits on a socket. When a run starts,
the agent hands each worker it can to a spare instead of a fresh interpreter: the worker's
argv, environment, working directory and cores, and, as file descriptors over the socket
(``SCM_RIGHTS``), its stdout, stderr and the monitor's two pipes. The spare puts them in place
and runs the script as ``python -u script`` would (``runpy``, ``__main__``, ``sys.argv``,
``sys.path[0]`` = the script's directory). Its exit code, signals and process group are the
worker's: the agent cannot tell it from a spawned one.

Limitations (why a worker is spawned fresh instead): only ``python -u script`` and
``python -u -m module`` with the interpreter the spares run (not ``--no_python``); interpreter
options read at start-up (``PYTHONHASHSEED``, ``-X``, ``PYTHONSAFEPATH``) are the spare's, while
``PYTHONPATH`` entries are added to ``sys.path``. A spare costs the memory of an imported torch
(about 250 MB resident) for as long as the job runs, and the CPU of one import, taken at idle
priority (``SCHED_IDLE``) where the spare may leave it again (root, or an ``RLIMIT_NICE`` that
allows it), else at normal priority after ``delay_s``.

No torch in this module's agent half (``SparePool``, ``Spare``): the spare half imports it.
"""

from __future__ import annotations

import importlib
import io
import json
import os
import resource
import runpy
import select
import socket
import struct
import subprocess
import sys
import threading
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from types import TracebackType

from dslaunch.launcher.agent.procs import child_setup
from dslaunch.launcher.workerenv import monitor_env

__all__ = ["Assignment", "Spare", "SparePool", "runnable"]

WARM_IMPORTS = ("torch", "torch.distributed")
_HEADER = struct.Struct("!Q")
_FDS = 4  # stdout, stderr, heartbeat pipe, stack pipe


@dataclass(frozen=True)
class Assignment:
    """What turns a spare into one worker (its file descriptors travel beside it)."""

    argv: tuple[str, ...]
    """``(python, "-u", script, *args)`` or ``(python, "-u", "-m", module, *args)``."""
    env: dict[str, str]
    """The worker's whole environment except the monitor's fds (``workerenv.process_env``)."""
    cwd: str | None
    cores: tuple[int, ...] = ()


def runnable(argv: Sequence[str], python: str = sys.executable) -> bool:
    """True when a spare can run ``argv``: ``python -u script ...`` or ``python -u -m module ...``."""
    if len(argv) < 3 or argv[0] != python or argv[1] != "-u":
        return False
    return argv[2] != "-m" or len(argv) >= 4


class Spare:
    """The agent's handle on one spare: its process and our end of its socket."""

    def __init__(self, proc: subprocess.Popen, sock: socket.socket) -> None:
        self.proc, self._sock = proc, sock

    def ready(self) -> bool:
        return self.proc.poll() is None

    def assign(self, work: Assignment, fds: Sequence[int]) -> None:
        """Hand the spare its worker; ``fds`` = (stdout, stderr, heartbeat, stack) write ends,
        which the caller still closes. Raises OSError when the spare is gone."""
        message = json.dumps(asdict(work)).encode()
        message = _HEADER.pack(len(message)) + message
        try:
            sent = socket.send_fds(self._sock, [message], list(fds))
            self._sock.sendall(message[sent:])
        finally:
            self._sock.close()

    def discard(self) -> None:
        """End an unused spare: EOF on its socket (it exits 0), SIGKILL if it is still importing."""
        self._sock.close()
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


class SparePool:
    """Spares for one node, kept by whatever outlives the runs (the local runner's job).

    ``fill`` must run on the thread that outlives the job (the main thread): a spare's
    PDEATHSIG is tied to the thread that started it, as a worker's is.

    Args:
        env: the environment spares start with (the agent's; a worker's own replaces it).
        delay_s: where a spare cannot warm up at idle priority, how long it waits before
            importing torch (an assignment before then starts it at once).
    """

    def __init__(self, env: Mapping[str, str], delay_s: float = 5.0) -> None:
        self._env, self._delay = dict(env), delay_s
        self._ready: list[Spare] = []

    def fill(self, count: int) -> None:
        """Start spares until ``count`` are ready."""
        for gone in [s for s in self._ready if not s.ready()]:
            gone.discard()
            self._ready.remove(gone)
        while len(self._ready) < count:
            self._ready.append(self._start())

    def take(self, argv: Sequence[str]) -> Spare | None:
        """A ready spare for a worker running ``argv``, or None (spawn it fresh)."""
        if not runnable(argv):
            return None
        while self._ready:
            spare = self._ready.pop()
            if spare.ready():
                return spare
            spare.discard()
        return None

    def pids(self) -> set[int]:
        return {s.proc.pid for s in self._ready}

    def close(self) -> None:
        for spare in self._ready:
            spare.discard()
        self._ready = []

    def _start(self) -> Spare:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            proc = subprocess.Popen(
                [sys.executable, "-m", "dslaunch.launcher.agent.spare", str(theirs.fileno()), str(self._delay)],
                env=self._env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                preexec_fn=child_setup(), pass_fds=[theirs.fileno()])
        finally:
            theirs.close()
        return Spare(proc, ours)


# -- the spare's side -----------------------------------------------------------------------------

def _receive(sock: socket.socket) -> tuple[Assignment, list[int]] | None:
    """The assignment and its fds; None when the pool closed the socket first."""
    data, fds, _flags, _addr = socket.recv_fds(sock, 1 << 16, _FDS)
    if not data:
        return None
    while len(data) < _HEADER.size or len(data) < _HEADER.size + _HEADER.unpack_from(data)[0]:
        more = sock.recv(1 << 16)
        if not more:
            return None
        data += more
    fields = json.loads(data[_HEADER.size:])
    work = Assignment(argv=tuple(fields["argv"]), env=fields["env"], cwd=fields["cwd"],
                      cores=tuple(fields["cores"]))
    return work, fds


def _become(work: Assignment, fds: list[int]) -> None:
    """Put the worker's fds, environment, directory and cores in place, as ``python -u`` sets up."""
    out, err, beat, stack = fds
    for std, fd in ((1, out), (2, err)):
        os.dup2(fd, std)
        os.close(fd)
    sys.stdout = sys.__stdout__ = _unbuffered(1)
    sys.stderr = sys.__stderr__ = _unbuffered(2)
    os.environ.clear()
    os.environ.update({**work.env, **monitor_env(beat, stack)})
    if work.cwd:
        os.chdir(work.cwd)
    if work.cores:
        os.sched_setaffinity(0, work.cores)
    threads = os.environ.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0:  # torch read it (or not) before the worker's value existed
        import torch

        torch.set_num_threads(int(threads))
    extra = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p not in sys.path]
    sys.path[1:1] = extra


def _unbuffered(fd: int) -> io.TextIOWrapper:
    """A text stream as ``python -u`` makes one: no buffering below it, so lines come out as written."""
    return io.TextIOWrapper(io.FileIO(fd, "w", closefd=False), encoding="utf-8", errors="backslashreplace",
                            write_through=True)


def _run(argv: tuple[str, ...]) -> None:
    """Run the worker's script (or module) as ``__main__``, as the interpreter would."""
    if argv[2] == "-m":
        sys.argv = [argv[3], *argv[4:]]
        sys.path[0] = os.getcwd()
        runpy.run_module(argv[3], run_name="__main__", alter_sys=True)
        return
    script = argv[2]
    sys.argv = [script, *argv[3:]]
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    runpy.run_path(script, run_name="__main__")


def _warm(sock: socket.socket, idle: bool) -> None:
    """Import torch at idle priority where this process may leave it again, so that warming up
    never slows the run that is starting; an assignment (or the pool closing) restores the normal
    policy at once, mid-import if need be."""
    if idle:
        def restore_on_news() -> None:
            try:
                select.select([sock], [], [])
            except OSError:  # closed: the main thread got there first
                return
            _set_policy(os.SCHED_OTHER)

        # Started before the main thread turns idle: a thread inherits its creator's policy, and
        # an idle one could starve on a busy host instead of restoring the main thread.
        threading.Thread(target=restore_on_news, daemon=True, name="spare-wake").start()
        idle = _set_policy(os.SCHED_IDLE)
    for name in WARM_IMPORTS:
        importlib.import_module(name)
    if idle:
        _set_policy(os.SCHED_OTHER)


def _may_leave_idle() -> bool:
    """Whether this process may return from SCHED_IDLE to SCHED_OTHER (Linux: CAP_SYS_NICE, or an
    RLIMIT_NICE that allows its nice value); a spare never risks running a worker at idle priority."""
    if os.geteuid() == 0:
        return True
    return resource.getrlimit(resource.RLIMIT_NICE)[0] >= 20 - os.getpriority(os.PRIO_PROCESS, 0)


def _set_policy(policy: int) -> bool:
    """Set the main thread's scheduling policy (its thread id is the pid), from any thread."""
    try:
        os.sched_setscheduler(os.getpid(), policy, os.sched_param(0))
        return True
    except OSError:
        return False


def main(args: list[str]) -> int:
    sock = socket.socket(fileno=int(args[0]))
    idle = _may_leave_idle()
    if not idle:  # warming at normal priority: let the starting run go first
        select.select([sock], [], [], float(args[1]))
    _warm(sock, idle)
    got = _receive(sock)
    sock.close()
    if got is None:
        return 0  # the job ended without needing this spare
    work, fds = got
    _become(work, fds)
    try:
        _run(work.argv)
    except (SystemExit, KeyboardInterrupt):
        raise
    except BaseException as err:  # noqa: BLE001 - reported as the interpreter would, then exit 1
        tb = _user_frames(err.__traceback__)
        sys.excepthook(type(err), err.with_traceback(tb), tb)  # the hook shows the exception's own
        return 1
    return 0


def _user_frames(tb: TracebackType | None) -> TracebackType | None:
    """The traceback from the worker's own code on, as ``python script`` shows it: without the
    spare's and runpy's frames."""
    while tb is not None and (tb.tb_frame.f_code.co_filename in (__file__, "<frozen runpy>")):
        tb = tb.tb_next
    return tb


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
