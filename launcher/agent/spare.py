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

The hand-off is a small protocol, because whether a send succeeded says nothing about whether the
spare has the message: a spare may read the whole assignment and close its end before the
agent's next send, which then fails with a broken pipe although the spare holds the worker (the
cause of the hand-offs that fell back to a fresh spawn while a second copy of the rank was
starting in the spare). So: (1) the agent sends the assignment, addressed to the spare's token
(given to it at start) with a fresh nonce, and its fds in the same message; (2) the spare checks
that it is the addressee and that the message and all its fds arrived, and answers with the
nonce (or ``refused: why``); (3) only on the right answer does the agent send ``go``, the one
byte the spare waits for before it runs anything. A spare the agent gives up on (no answer
within ``ANSWER_TIMEOUT_S``, a wrong answer, end of file, a failed send) is SIGKILLed and reaped
before the worker is spawned fresh: it never ran any of the worker, so a rank never runs twice.
A spare answers from a thread of its own, also while it is still importing torch.

Limitations (why a worker is spawned fresh instead): only ``python -u script`` and
``python -u -m module`` with the interpreter the spares run (not ``--no_python``); interpreter
options read at start-up (``PYTHONHASHSEED``, ``-X``, ``PYTHONSAFEPATH``) are the spare's, while
``PYTHONPATH`` entries are added to ``sys.path``. A spare costs the memory of an imported torch
and ``torch._dynamo`` (about 370 MB resident) for as long as the job runs, and the CPU of one
import, taken at idle priority (``SCHED_IDLE``) where the spare may leave it again (root, or an
``RLIMIT_NICE`` that allows it), else at normal priority after ``delay_s``. A host too busy to leave any CPU idle
starves an idle-priority import (measured here at a load of 18 on 2 cores: 0.1 s of CPU in 12 s,
short of the ~1.5 s an import of torch takes): ``promote`` puts the spares back to normal
priority from outside (from inside, the thread that would do it waits for the GIL that the
starving import holds).

No torch in this module's agent half (``SparePool``, ``Spare``): the spare half imports it.
"""

from __future__ import annotations

import importlib
import io
import json
import os
import resource
import runpy
import secrets
import select
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from types import TracebackType

from dslaunch.launcher.agent.procs import child_setup
from dslaunch.launcher.workerenv import monitor_env

__all__ = ["Assignment", "Spare", "SpareLost", "SparePool", "runnable"]

WARM_IMPORTS = ("torch", "torch.distributed", "torch._dynamo")
"""``torch._dynamo``: the first ``torch.optim`` optimizer a script builds imports it (its
``__init__`` is wrapped in ``_disable_dynamo``): ~1 s on an idle core, 8 s at a load of 26 here,
and ~150 MB resident that the worker would hold after its first step anyway."""
ANSWER_TIMEOUT_S = 15.0
"""How long the agent waits for a spare to confirm an assignment (it answers in milliseconds, from
a thread that does not wait for its import): past it, the worker is spawned fresh."""
_HEADER = struct.Struct("!Q")
_FDS = 4  # stdout, stderr, heartbeat pipe, stack pipe
_GO = b"g"
IDLE_AUTOGROUP_NICE = 19


class SpareLost(Exception):
    """A spare did not take its assignment; it is dead and reaped (nothing of the worker ran)."""


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
    """The agent's handle on one spare: its process, our end of its socket, and its token."""

    def __init__(self, proc: subprocess.Popen, sock: socket.socket, token: str) -> None:
        self.proc, self._sock, self.token = proc, sock, token

    def ready(self) -> bool:
        return self.proc.poll() is None

    def assign(self, work: Assignment, fds: Sequence[int], timeout: float = ANSWER_TIMEOUT_S) -> None:
        """Hand the spare its worker (the protocol in the module docstring); returns once the spare
        confirmed it and was told to run it. ``fds`` = (stdout, stderr, heartbeat, stack) write
        ends, which the caller still closes.

        Raises:
            SpareLost: it did not take the worker; it is dead and reaped, so the caller may spawn
                the worker fresh.
        """
        nonce = secrets.token_hex(8)
        message = _frame({"to": self.token, "nonce": nonce, **asdict(work)})
        try:
            _normal_policy(self.proc.pid)  # its answer must not wait for an idle-priority import
            sent = socket.send_fds(self._sock, [message], list(fds))
            if sent < len(message):  # never a send of nothing: the spare may have closed its end
                self._sock.sendall(message[sent:])
            answer = _answer(self._sock, timeout)
            if answer != nonce:
                raise SpareLost(answer or "it exited before answering")
            self._sock.sendall(_GO)  # it waits for this byte: it cannot have closed its end yet
        except OSError as err:
            self.discard()
            raise SpareLost(f"hand-off failed: {err.strerror or err}") from None
        except SpareLost:
            self.discard()
            raise
        finally:
            self._sock.close()

    def discard(self) -> None:
        """End an unused spare: EOF on its socket (it exits 0), SIGKILL if it is still importing;
        reaped before this returns."""
        self._sock.close()
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


def _frame(fields: dict) -> bytes:
    body = json.dumps(fields).encode()
    return _HEADER.pack(len(body)) + body


def _answer(sock: socket.socket, timeout: float) -> str:
    """The spare's one-line answer ('' at end of file). Raises SpareLost after ``timeout``."""
    data = b""
    deadline = time.monotonic() + timeout
    while not data.endswith(b"\n"):
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([sock], [], [], left)[0]:
            raise SpareLost(f"no answer within {timeout:g} s")
        chunk = sock.recv(256)
        if not chunk:
            return ""
        data += chunk
    return data.decode(errors="replace").strip()


def _normal_policy(pid: int) -> None:
    """Every thread of ``pid`` back to SCHED_OTHER, its autogroup to nice 0 (a spare may be
    importing at idle priority; the thread holding its GIL must run for its answering thread to
    run)."""
    _autogroup_nice(pid, 0)
    try:
        tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        return
    for tid in tids:
        try:
            if os.sched_getscheduler(tid) == os.SCHED_IDLE:
                os.sched_setscheduler(tid, os.SCHED_OTHER, os.sched_param(0))
        except OSError:  # gone, or not ours to change: the spare restores itself too
            pass


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
        # Held while a spare starts: a child process that is not listed yet must not look like an
        # orphan to ``held`` (whose caller kills and reaps every other child).
        self._lock = threading.Lock()

    def fill(self, count: int) -> None:
        """Start spares until ``count`` are ready."""
        with self._lock:
            for gone in [s for s in self._ready if not s.ready()]:
                gone.discard()
                self._ready.remove(gone)
            while len(self._ready) < count:
                self._ready.append(self._start())

    def take(self, argv: Sequence[str]) -> Spare | None:
        """A ready spare for a worker running ``argv``, or None (spawn it fresh). A spare is taken
        once: it leaves the pool here."""
        if not runnable(argv):
            return None
        with self._lock:
            while self._ready:
                spare = self._ready.pop()
                if spare.ready():
                    return spare
                spare.discard()
        return None

    def promote(self) -> None:
        """Every ready spare to normal priority (one still importing goes on at full speed)."""
        with self._lock:
            for spare in self._ready:
                if spare.ready():
                    _normal_policy(spare.proc.pid)

    def pids(self) -> set[int]:
        with self._lock:
            return {s.proc.pid for s in self._ready}

    @contextmanager
    def held(self) -> Iterator[set[int]]:
        """The spares' pids, with no spare starting until the block ends: for a caller that kills
        and reaps every other child (``procs.kill_adopted``). A spare reaped by someone else would
        leave its ``Popen`` asking ``waitpid`` about a pid the kernel may give to another child."""
        with self._lock:
            yield {s.proc.pid for s in self._ready}

    def close(self) -> None:
        with self._lock:
            for spare in self._ready:
                spare.discard()
            self._ready = []

    def _start(self) -> Spare:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        token = secrets.token_hex(8)
        try:
            proc = subprocess.Popen(
                [sys.executable, "-m", "dslaunch.launcher.agent.spare", str(theirs.fileno()), str(self._delay),
                 token],
                env=self._env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                preexec_fn=child_setup(), pass_fds=[theirs.fileno()])
        finally:
            theirs.close()
        return Spare(proc, ours, token)


# -- the spare's side -----------------------------------------------------------------------------

def _receive(sock: socket.socket) -> tuple[dict, list[int]] | None:
    """An assignment's fields and the fds that came with it; None when the pool closed the socket."""
    data, fds, _flags, _addr = socket.recv_fds(sock, 1 << 16, _FDS)
    while data and not _complete(data):
        more = sock.recv(1 << 16)
        if not more:
            break
        data += more
    if not _complete(data):
        _close(fds)
        return None
    return json.loads(data[_HEADER.size:]), fds


def _complete(data: bytes) -> bool:
    return len(data) >= _HEADER.size and len(data) >= _HEADER.size + _HEADER.unpack_from(data)[0]


def _accept(sock: socket.socket, token: str) -> tuple[Assignment, list[int]] | None:
    """Steps 2 and 3 of the hand-off (module docstring): check and confirm the assignment, wait for
    ``go``. The worker to become, or None (the pool closed, the assignment was refused, or the
    agent gave up on this spare and kills it)."""
    got = _receive(sock)
    if got is None:
        return None
    fields, fds = got
    if fields.get("to") != token or len(fds) != _FDS:
        why = "addressed to another spare" if fields.get("to") != token else f"{len(fds)} of {_FDS} fds arrived"
        _close(fds)
        sock.sendall(f"refused: {why}\n".encode())
        return None
    sock.sendall(f"{fields['nonce']}\n".encode())
    if sock.recv(1) != _GO:
        _close(fds)
        return None
    work = Assignment(argv=tuple(fields["argv"]), env=fields["env"], cwd=fields["cwd"],
                      cores=tuple(fields["cores"]))
    return work, fds


def _close(fds: list[int]) -> None:
    for fd in fds:
        os.close(fd)


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


def _warm(sock: socket.socket, token: str, delay: float) -> tuple[Assignment, list[int]] | None:
    """Import torch while a thread waits for the assignment (``_accept``); return what it
    accepted (None: nothing, exit).

    The import runs at idle priority where this process may leave it again, so that warming up
    never slows the run that is starting, else at normal priority after ``delay`` seconds (or at
    once when work comes). The waiting thread answers the agent at once, mid-import if need be,
    and restores the normal policy (so does the agent).
    """
    accepted: list[tuple[Assignment, list[int]] | None] = []
    done = threading.Event()

    def wait_for_work() -> None:
        try:
            accepted.append(_accept(sock, token))
        except (OSError, ValueError, KeyError, TypeError):  # a broken message: the agent gives up on us
            accepted.append(None)
        finally:
            _set_policy(os.SCHED_OTHER)
            done.set()

    # Started before the main thread turns idle: a thread inherits its creator's policy, and an
    # idle one could starve on a busy host instead of answering.
    threading.Thread(target=wait_for_work, daemon=True, name="spare-wake").start()
    idle = _may_leave_idle() and _set_policy(os.SCHED_IDLE)
    if not idle:  # warming at normal priority: let the starting run go first
        done.wait(delay)
    for name in WARM_IMPORTS:
        importlib.import_module(name)
    if idle:
        _set_policy(os.SCHED_OTHER)
    done.wait()
    return accepted[0]


def _may_leave_idle() -> bool:
    """Whether this process may return from SCHED_IDLE to SCHED_OTHER (Linux: CAP_SYS_NICE, or an
    RLIMIT_NICE that allows its nice value); a spare never risks running a worker at idle priority."""
    if os.geteuid() == 0:
        return True
    return resource.getrlimit(resource.RLIMIT_NICE)[0] >= 20 - os.getpriority(os.PRIO_PROCESS, 0)


def _set_policy(policy: int) -> bool:
    """Set the main thread's scheduling policy (its thread id is the pid), from any thread, and
    its session's autogroup weight to match (``_autogroup_nice``)."""
    try:
        os.sched_setscheduler(os.getpid(), policy, os.sched_param(0))
    except OSError:
        return False
    if os.getsid(0) == os.getpid():  # its own session's group only, never its parent's
        _autogroup_nice(os.getpid(), IDLE_AUTOGROUP_NICE if policy == os.SCHED_IDLE else 0)
    return True


def _autogroup_nice(pid: int, nice: int) -> None:
    """Set the nice value of ``pid``'s autogroup (Linux with ``sched_autogroup_enabled``).

    A spare leads its own session (as a worker does), hence its own autogroup, and the kernel
    shares the CPU between autogroups first: alone in its group, a SCHED_IDLE task gets a whole
    group's share, so two warming spares made the workers' own torch import 1.8x slower (2.9 s
    instead of 1.6 s). Nice 19 on the group makes it yield as SCHED_IDLE means to; 0 is what a
    new session's group (a fresh worker's) has."""
    try:
        with open(f"/proc/{pid}/autogroup", "w") as f:
            f.write(str(nice))
    except OSError:  # no autogroups here, or not ours to change
        pass


def main(args: list[str]) -> int:
    sock = socket.socket(fileno=int(args[0]))
    got = _warm(sock, token=args[2], delay=float(args[1]))
    sock.close()
    if got is None:
        return 0  # the job ended without needing this spare, or it was given up on
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
