"""The agent's end of each worker's monitor pipes: latest beat per rank, stack text on request.

Why pipes inherited by the worker (and not a file per rank the agent polls): the agent hears
a beat the moment it is written, without polling a file system; nothing is left on disk; the
channel needs no path (the worker only learns two fd numbers); and a pipe cannot be read by
another user. One selector thread serves every worker of the node.

Mechanism only: what a silent rank means is decided by ``dslaunch.launcher.monitor``.
"""

from __future__ import annotations

import contextlib
import os
import selectors
import shutil
import signal
import subprocess
import threading
import time

from dslaunch.launcher.agent.procs import proc_stat, signal_group
from dslaunch.utils.beat import Beat

__all__ = ["Channels", "MAX_STACK_BYTES", "process_stopped"]

MAX_STACK_BYTES = 256 * 1024  # a dump of a few hundred threads; more is cut
_POLL_S = 0.1
_DRAIN_S = 0.5  # at most this long for the exited workers' last writes


class Channels:
    """Reads every worker's heartbeat and stack pipes in one daemon thread."""

    def __init__(self) -> None:
        self._sel = selectors.DefaultSelector()
        self._lock = threading.Lock()
        self._beats: dict[int, Beat] = {}
        self._pending: dict[int, bytes] = {}  # fd -> partial beat line
        self._stacks: dict[int, bytearray] = {}
        self._stack_at: dict[int, float] = {}  # rank -> monotonic time of its last stack bytes
        self._new: list[tuple[int, int, str]] = []
        self._thread: threading.Thread | None = None
        self._closed = False

    def pipes(self, rank: int) -> tuple[int, int]:
        """Create ``rank``'s two pipes; return their write ends (beat, stack) for the worker.

        The caller passes them to the worker (``pass_fds``) and closes them after the spawn.
        """
        beat_r, beat_w = os.pipe()
        stack_r, stack_w = os.pipe()
        with self._lock:
            self._new += [(beat_r, rank, "beat"), (stack_r, rank, "stack")]
            self._stacks[rank] = bytearray()
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="agent-channels", daemon=True)
            self._thread.start()
        return beat_w, stack_w

    def beats(self) -> dict[int, Beat]:
        """The latest beat of every rank that sent one."""
        with self._lock:
            return dict(self._beats)

    def dump_stacks(self, pids: dict[int, int], wait: float = 2.0) -> dict[int, dict]:
        """Freeze every rank, then take each one's Python stacks; the ranks are left frozen.

        Why frozen: a hang is declared once, and the job is then killed; nothing may train or
        save meanwhile. A rank that was stopped (SIGSTOP) must run to answer its dump signal, and
        once resumed it would train on with its peers (a pipeline stage trained 5 more steps and
        saved checkpoints after its hang was declared). So every rank's process group is stopped
        first; then the ranks that were running are resumed alone (their peers that were stopped
        stay stopped: nothing can finish a step) and the ranks that were stopped after them, each
        batch stopped again once its dumps are complete. A rank with no dump registered (it never
        beat, or beats without dslaunch's runtime) is read from outside with ``py-spy dump``
        while frozen, when py-spy is on PATH.

        Args:
            pids: rank -> pid of the ranks to dump (running ones).
            wait: at most this long per batch; a dump ends after 0.3 s of quiet at the end of a line.

        Returns:
            rank -> ``{"stopped": bool, "stack": text or None, "via": "faulthandler" or "py-spy"
            or None, "why": why there is no stack (only then)}``; ``stopped``: it was stopped
            before the freeze.
        """
        beats = self.beats()
        stopped = {rank: process_stopped(pid) for rank, pid in pids.items()}
        for pid in pids.values():  # the whole group: data-loader workers too
            signal_group(pid, signal.SIGSTOP)
        asked: dict[int, dict] = {}
        spy = shutil.which("py-spy")
        for rank, pid in pids.items():
            sig = beats[rank].stack_signal if rank in beats else None
            with self._lock:
                self._stacks[rank] = bytearray()
                self._stack_at.pop(rank, None)
            asked[rank] = {"stopped": stopped[rank], "signal": sig}
            if not sig:  # read from outside, as it is (frozen), or say why not
                asked[rank].update(_py_spy(spy, pid, wait) if spy else
                                   {"why": "no faulthandler registered (the script does not use "
                                           "dslaunch's runtime) and no py-spy on PATH"})
        for was_stopped in (False, True):
            batch = {r: pids[r] for r, a in asked.items() if a["signal"] and stopped[r] is was_stopped}
            self._dump_batch(batch, asked, wait)
        with self._lock:
            for rank, a in asked.items():
                if a.pop("signal"):
                    a["stack"] = bytes(self._stacks[rank]).decode("utf-8", "replace") or None
                    a["via"] = "faulthandler"
                    if a["stack"] is None:
                        a["why"] = a.get("why") or f"no faulthandler dump within {wait:g} s"
            return {rank: {"stack": None, "via": None, **a} for rank, a in asked.items()}

    def _dump_batch(self, batch: dict[int, int], asked: dict[int, dict], wait: float) -> None:
        """Resume the frozen ranks of ``batch`` (rank -> pid: the process, not its group) with
        their dump signal queued first, so each dumps where it was; stop them again once done."""
        for rank, pid in batch.items():
            try:
                os.kill(pid, asked[rank]["signal"])
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                asked[rank].update(signal=None, why="exited")
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and not self._settled([r for r in batch if asked[r]["signal"]]):
            time.sleep(0.05)
        for pid in batch.values():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGSTOP)

    def _settled(self, ranks: list[int]) -> bool:
        """Every rank's dump went quiet for 0.3 s on a whole line: faulthandler writes a frame's line
        in pieces, and a rank descheduled mid-line under load once ended a dump at ``  File ``."""
        now = time.monotonic()
        with self._lock:
            return all(r in self._stack_at and now - self._stack_at[r] > 0.3
                       and (self._stacks[r].endswith(b"\n") or len(self._stacks[r]) >= MAX_STACK_BYTES)
                       for r in ranks)

    def close(self) -> None:
        """Stop reading (idempotent) once the workers' last writes are drained; the beats read so
        far stay available. Waits for the drain (bounded), so the node's result, published right
        after, is seen with every rank's final beat."""
        self._closed = True  # the thread sees it within _POLL_S, drains, closes every read end
        if self._thread is None:
            self._sel.close()
        elif self._thread is not threading.current_thread():
            self._thread.join(timeout=_POLL_S + _DRAIN_S + 0.5)

    def _run(self) -> None:
        # Only this thread registers and closes the read ends (no wake-up pipe to share): new
        # pipes wait at most _POLL_S, their data waits in the pipe meanwhile.
        while not self._closed:
            self._register_new()
            for key, _ in self._sel.select(_POLL_S):
                self._read(key)
        self._register_new()
        # Drain what the exited workers wrote last (their final beat); bounded, as a child that
        # inherited a pipe may keep it open.
        deadline = time.monotonic() + _DRAIN_S
        while time.monotonic() < deadline and (ready := self._sel.select(0)):
            for key, _ in ready:
                self._read(key)
        for key in list(self._sel.get_map().values()):
            os.close(key.fd)
        self._sel.close()

    def _read(self, key: selectors.SelectorKey) -> None:
        rank, kind = key.data
        try:
            data = os.read(key.fd, 65536)
        except OSError:
            data = b""
        if not data:
            self._sel.unregister(key.fd)
            os.close(key.fd)
        elif kind == "beat":
            self._beat_data(key.fd, rank, data)
        else:
            self._stack_data(rank, data)

    def _register_new(self) -> None:
        with self._lock:
            new, self._new = self._new, []
        for fd, rank, kind in new:
            self._sel.register(fd, selectors.EVENT_READ, (rank, kind))

    def _beat_data(self, fd: int, rank: int, data: bytes) -> None:
        *lines, rest = (self._pending.pop(fd, b"") + data).split(b"\n")
        if rest:
            self._pending[fd] = rest[-4096:]
        for line in reversed(lines):  # only the newest whole beat matters
            beat = Beat.from_line(line)
            if beat is not None:
                with self._lock:
                    self._beats[rank] = beat
                break

    def _stack_data(self, rank: int, data: bytes) -> None:
        with self._lock:
            buf = self._stacks.setdefault(rank, bytearray())
            buf += data[:max(0, MAX_STACK_BYTES - len(buf))]
            self._stack_at[rank] = time.monotonic()


def _py_spy(tool: str, pid: int, wait: float) -> dict:
    """``py-spy dump`` of ``pid``: ``{"stack", "via"}``, or ``{"why"}`` when it failed.
    ``--nonblocking``: the process is not paused (it is stuck anyway, or stopped)."""
    try:
        out = subprocess.run([tool, "dump", "--nonblocking", "--full-filenames", "--pid", str(pid)],
                             capture_output=True, text=True, errors="replace", timeout=wait)
    except (OSError, subprocess.TimeoutExpired) as err:
        return {"why": f"py-spy dump failed: {err}"}
    if out.returncode or not out.stdout.strip():
        last = (out.stderr.strip().splitlines() or [f"exit code {out.returncode}"])[-1]
        return {"why": f"py-spy dump failed: {last[:200]}"}
    return {"stack": out.stdout[:MAX_STACK_BYTES], "via": "py-spy"}


def process_stopped(pid: int) -> bool:
    """Whether ``pid`` is stopped (SIGSTOP/SIGTSTP, state T in /proc)."""
    fields = proc_stat(pid)
    return bool(fields) and fields[0] in ("T", "t")
