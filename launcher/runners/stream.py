"""An agent's byte streams, sorted line by line, for any transport that runs ``agent.bootstrap``.

An ``AgentStream`` reads the stdout and stderr of one node agent (over an SSH channel, through
``srun``'s stdio, ...) and sorts what comes back:

- the ``@@dslaunch-probe`` line (stdout) -> ``probe`` (the preflight answer);
- the agent's status line (stderr) -> ``status`` (how the node ended, parsed by the agent module);
- the agent's failure line (stderr) -> ``failure`` (its first worker failure, sent at once);
- the agent's beats and stacks lines (stderr) -> ``beats`` (latest per rank), ``stacks`` (the
  answer to ``request_stacks``); ``heard_at``: wall-clock time of the last line from the host
  (``heard_mono``: monotonic time of the last bytes on either stream, for the silence rule);
- every other line -> the controller's stdout/stderr, prefixed ``host: `` (the agent already
  prefixed worker lines with ``[rankN]``), one whole line per write so hosts never interleave
  inside a line. stderr printed before the probe line is held back and shown only with the
  probe's outcome (so a login-shell hiccup is reported with the failure it caused).

The other way, ``keep_alive`` sends the agent ``ALIVE`` every second, so that an agent behind a cut
link finds the controller gone by its silence.

Subclasses start the command, feed ``_read`` from their reader threads, call ``_ended`` once the
command is gone, and implement ``send_line`` (the agent's stdin).

``StreamNode`` is the monitor's ``NodeHandle`` over such a stream: everything but how a transport
tears its node down (``kill``) and how it words a stream that ended without the agent's status.
"""

from __future__ import annotations

import json
import os
import threading
import time
from abc import abstractmethod
from collections.abc import Callable

from dslaunch.launcher.agent.bootstrap import PROBE_MARKER
from dslaunch.launcher.agent.output import Sink
from dslaunch.launcher.agent.wire import (
    ALIVE,
    STACKS_REQUEST,
    parse_beats_line,
    parse_failure_line,
    parse_stacks_line,
    parse_status_line,
)
from dslaunch.launcher.monitor.gang import NodeHandle
from dslaunch.launcher.spec import HOST_LOST_EXIT_CODE, NodeResult, NodeSpec
from dslaunch.utils.beat import Beat

__all__ = ["AgentStream", "StreamNode", "read_lines"]

_CHUNK = 65536


def read_lines(recv: Callable[[int], bytes], handle: Callable[[bytes], None],
               errors: tuple[type[BaseException], ...], on_bytes: Callable[[], None] = lambda: None) -> None:
    """Feed ``handle`` each whole line (newline included) that ``recv`` returns, until EOF.

    EOF is ``b""`` or one of ``errors`` (a transport that died ends the stream); a last line without
    a newline gets one. ``on_bytes`` is called on every chunk, before its lines are handled.
    """
    buf = b""
    while True:
        try:
            data = recv(_CHUNK)
        except errors:
            data = b""
        if not data:
            break
        on_bytes()
        buf += data
        *lines, buf = buf.split(b"\n")
        for line in lines:
            handle(line + b"\n")
    if buf:
        handle(buf + b"\n")


class AgentStream:
    """One node agent's output, sorted (see the module docstring). Thread-safe for its methods.

    Args:
        alias: the host name shown in prefixes and messages.
        out, err: where prefixed lines go (shared by all nodes).
        on_change: called whenever the probe or the agent's failure line arrives, or the command ends.
    """

    transport_errors: tuple[type[BaseException], ...] = (OSError, EOFError)
    """What reading or writing the agent's streams raises when the transport is gone."""

    def __init__(self, alias: str, out: Sink, err: Sink, on_change: Callable[[], None] = lambda: None) -> None:
        self.alias = alias
        self._out, self._err = out, err
        self._on_change = on_change
        self._prefix = f"{alias}: ".encode()
        self.probe: dict | None = None
        self.status: NodeResult | None = None
        self.failure: NodeResult | None = None
        self.exit_code: int | None = None
        self.lost = False
        self.beats: dict[int, Beat] = {}
        self.stacks: dict[int, dict] | None = {}
        self.heard_at: float | None = None
        self.heard_mono = time.monotonic()
        self._held_stderr: list[bytes] = []
        self._lock = threading.Lock()
        self._probe_seen = threading.Event()
        self.done = threading.Event()

    # -- reading -------------------------------------------------------------------------------

    def _follow(self, recv_stdout: Callable[[int], bytes], recv_stderr: Callable[[int], bytes],
                finish: Callable[[], None], name: str) -> None:
        """Read the agent's stdout and stderr in a thread each; once both reached EOF, ``finish``
        (it learns the exit and calls ``_ended``) runs in a third thread, named ``name``."""
        readers = [threading.Thread(target=self._read, args=(recv, handle), daemon=True)
                   for recv, handle in ((recv_stdout, self._stdout_line), (recv_stderr, self._stderr_line))]
        for t in readers:
            t.start()

        def drained_then_finish() -> None:
            for t in readers:
                t.join()
            finish()
        threading.Thread(target=drained_then_finish, daemon=True, name=name).start()

    def _read(self, recv: Callable[[int], bytes], handle: Callable[[bytes], None]) -> None:
        """Split what ``recv`` returns into lines for ``handle`` until EOF (b'' or an OSError)."""
        read_lines(recv, handle, self.transport_errors, on_bytes=self._heard)

    def _heard(self) -> None:
        self.heard_mono = time.monotonic()

    def _stdout_line(self, line: bytes) -> None:
        if self.probe is None and line.startswith(PROBE_MARKER.encode()):
            try:
                self.probe = json.loads(line[len(PROBE_MARKER):])
            except ValueError:
                self.probe = {"error": f"unreadable probe answer: {line[:200]!r}"}
            self._probe_seen.set()
            self._on_change()
            return
        self._out.write(self._prefix + line)

    def _stderr_line(self, line: bytes) -> None:
        self.heard_at = time.time()
        if line.startswith(b"@@dslaunch-agent-") and self._monitor_line(line):
            return
        result = parse_status_line(line)
        if result is not None:
            self.status = result
            return
        failure = parse_failure_line(line)
        if failure is not None:
            self.failure = failure
            self._on_change()
            return
        with self._lock:
            if not self._probe_seen.is_set():
                self._held_stderr.append(line)
                return
        self._err.write(self._prefix + line)

    def _monitor_line(self, line: bytes) -> bool:
        beats = parse_beats_line(line)
        if beats is not None:
            self.beats = {**self.beats, **beats}
            return True
        stacks = parse_stacks_line(line)
        if stacks is not None:
            self.stacks = stacks
            self._on_change()
            return True
        return False

    def _ended(self, exit_code: int, lost: bool) -> None:
        """The command is gone (its readers drained): record how, wake everyone waiting."""
        self.lost = lost
        self.exit_code = exit_code
        self._probe_seen.set()  # wake wait_probe() callers: there will be no probe now
        self.done.set()
        self._on_change()

    # -- queries and control -------------------------------------------------------------------

    def send_line(self, text: str) -> None:
        """One line to the agent's stdin. Raises OSError/EOFError when the agent is gone."""
        raise NotImplementedError

    def close_stdin(self) -> None:
        """EOF on the agent's stdin: it stops its workers and exits. Non-blocking, idempotent."""
        raise NotImplementedError

    def keep_alive(self, every: float) -> None:
        """Send the agent ``ALIVE`` every ``every`` seconds until its stdin is closed (a thread):
        behind a cut link, the agent finds the controller gone by its silence."""
        def run() -> None:
            while True:  # the first at once: the agent heeds silence only after one came
                try:
                    self.send_line(ALIVE)
                except (*self.transport_errors, AssertionError, ValueError):
                    return  # closed (the stop request) or gone: nothing more to say
                if self.done.wait(every):
                    return
        threading.Thread(target=run, daemon=True, name=f"alive-{self.alias}").start()

    def request_stacks(self) -> None:
        """Ask the agent for its workers' stacks; ``stacks`` is None until the answer came."""
        self.stacks = None
        try:
            self.send_line(STACKS_REQUEST)
        except (*self.transport_errors, AssertionError):
            self.stacks = {}  # no agent to answer: nothing to wait for

    def wait_probe(self, deadline: float) -> dict | None:
        """Block until the probe line arrived, the command ended, or ``deadline`` (monotonic)."""
        self._probe_seen.wait(max(0.0, deadline - time.monotonic()))
        return self.probe

    def held_stderr(self, release: bool) -> str:
        """stderr printed before the probe; with ``release`` later lines stream directly."""
        with self._lock:
            text = b"".join(self._held_stderr).decode("utf-8", "replace")
            if release:
                for line in self._held_stderr:
                    self._err.write(self._prefix + line)
                self._held_stderr.clear()
                self._probe_seen.set()
        return text


class StreamNode(NodeHandle):
    """A node agent seen through its ``AgentStream``. Subclasses implement ``kill`` and ``lost``."""

    def __init__(self, node: NodeSpec, session: AgentStream) -> None:
        self.node = node
        self.session = session
        self._since = time.monotonic()  # the agent has its NodeSpec: it speaks every ALIVE_EVERY_S

    @abstractmethod
    def lost(self) -> tuple[str, str]:
        """(the note printed, ``stopped_by``) when the stream ended without the agent's status."""

    def poll(self) -> NodeResult | None:
        s = self.session
        if not s.done.is_set():
            return None
        if s.status is not None:
            return s.status
        if s.lost:
            note, stopped_by = self.lost()
            os.write(2, f"dslaunch: {note}\n".encode())
            return NodeResult(self.node.node_rank, self.node.host, s.exit_code or HOST_LOST_EXIT_CODE,
                              stopped_by=stopped_by, cause="host_lost", failed_at=s.heard_at)
        return NodeResult(self.node.node_rank, self.node.host, s.exit_code or 0)

    def failing(self) -> NodeResult | None:
        return self.session.failure

    def last_heard(self) -> float:
        return max(self.session.heard_mono, self._since)

    def stop(self, sig: int) -> None:
        self.session.close_stdin()

    def beats(self) -> dict[int, Beat]:
        return self.session.beats

    def request_stacks(self) -> None:
        self.session.request_stacks()

    def stacks(self) -> dict[int, dict] | None:
        return self.session.stacks
