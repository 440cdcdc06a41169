"""The watchdog: a helper process that SIGKILLs every worker process group if the agent dies.

``PR_SET_PDEATHSIG`` kills a worker when the agent dies, but not the worker's children; the
watchdog outlives a SIGKILLed agent just long enough to ``killpg`` every worker group (children
included) and to remove the agent's ``--save_pid`` file.

Why a fresh interpreter (``python -m dslaunch.launcher.agent.watchdog FD ...``) rather than a
fork: the local runner's agent runs inside the controller, which already has threads when a
restart starts the next run's agent (the last run's output pumps, the monitor's timers). A child
forked from a threaded process inherits locks some other thread may have held at the fork (the
import lock, an allocator's, a logging handler's) and can deadlock on its first use of one.
``subprocess`` execs right after its fork, which is safe from any thread. The cost, one small
interpreter start (~50 ms of one core here, nothing the agent waits for), is paid while the workers
import their own modules.

Standard library only (and ``procs``/``dslaunch.safe_write``, which are): it runs on every launch.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Sequence

from dslaunch.launcher.agent.procs import signal_group
from dslaunch.safe_write import FileId, remove_own

__all__ = ["Watchdog", "main"]


class Watchdog:
    """The agent's end: it writes each worker's pgid into a pipe the watchdog reads; a normal
    ``release()`` tells the watchdog to exit quietly. If the pipe closes without ``release()``
    (the agent SIGKILLed), the watchdog kills every group it was told about and removes the files
    given to ``start``."""

    def __init__(self) -> None:
        self._fd: int | None = None
        self._proc: subprocess.Popen | None = None

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    def start(self, remove: Sequence[tuple[str, FileId]] = ()) -> None:
        """Start the watchdog; ``remove``: (path, file id) to unlink if the owner dies (``safe_write.remove_own``)."""
        read_fd, write_fd = os.pipe()
        try:
            args = [str(read_fd)] + [f"{dev}:{ino}:{path}" for path, (dev, ino) in remove]
            # Its own session: Ctrl-C at the terminal reaches the foreground group, not the watchdog
            # (which must outlive the agent); no stdio of ours held open (a pipe reader would hang).
            self._proc = subprocess.Popen(
                [sys.executable, "-I", "-m", "dslaunch.launcher.agent.watchdog", *args],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                pass_fds=(read_fd,), start_new_session=True)
        except BaseException:
            os.close(write_fd)
            raise
        finally:
            os.close(read_fd)
        os.set_inheritable(write_fd, False)
        self._fd = write_fd

    def add(self, pgid: int) -> None:
        self._send(b"P%d\n" % pgid)

    def release(self) -> None:
        """The owner cleaned up itself: let the watchdog exit without killing anything."""
        self._send(b"D\n")
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if self._proc is not None:  # it exits on EOF: reap it, leave no zombie
            self._proc.wait()
            self._proc = None

    def _send(self, data: bytes) -> None:
        if self._fd is not None:
            try:
                os.write(self._fd, data)
            except OSError:  # watchdog gone (killed from outside): nothing more it can do for us
                pass


def main(argv: Sequence[str]) -> None:
    """``FD [DEV:INO:PATH ...]``: read pgids from FD until EOF; kill them unless told ``D``."""
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)  # only the pipe's EOF ends it
    read_fd = int(argv[0])
    remove = []
    for spec in argv[1:]:
        dev, ino, path = spec.split(":", 2)
        remove.append((path, (int(dev), int(ino))))
    data = b""
    while chunk := os.read(read_fd, 4096):
        data += chunk
    lines = data.split(b"\n")
    if b"D" not in lines:
        for line in lines:
            if line.startswith(b"P"):
                signal_group(int(line[1:]), signal.SIGKILL)
        for path, ident in remove:
            remove_own(path, ident)


if __name__ == "__main__":
    main(sys.argv[1:])
