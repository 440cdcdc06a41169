"""One remote command over an SSH transport: the node agent's streams over a paramiko channel.

A ``RemoteSession`` runs the ``agent.bootstrap`` command on one host; ``stream.AgentStream`` sorts
what comes back (probe, status, failure, beats and stacks lines; prefixed output).

The channel's stdin stays open for the job: ``send_line`` hands the agent its NodeSpec and
``close_stdin`` is the stop request (the agent stops its workers on EOF; OpenSSH ignores signal
requests for root, so EOF is the portable way).
"""

from __future__ import annotations

from collections.abc import Callable

from dslaunch.launcher.agent.output import Sink
from dslaunch.launcher.runners.ssh.sshlib import paramiko
from dslaunch.launcher.runners.stream import AgentStream

__all__ = ["RemoteSession", "LOST_CONNECTION"]

LOST_CONNECTION = 255  # what ssh(1) exits with when the connection drops
# How long the last-resort kill waits for the host's sshd to open its channel: the gang stops
# waiting for the node 5 s after the kill (monitor.gang's give-up), so waiting longer helps nobody.
# It was 1 s: a busy host's sshd took longer, the connection was dropped and the stopped agent and
# its workers were left running there (staged in test_a_frozen_agent_behind_a_slow_sshd_is_still_killed).
KILL_CHANNEL_TIMEOUT_S = 5.0


class RemoteSession(AgentStream):
    """A remote command's channel with reader threads. Thread-safe for the methods below.

    Args:
        alias: the host name shown in prefixes and messages.
        command: the shell command line to execute remotely.
        out, err: where prefixed lines go (shared by all sessions).
        on_change: called whenever the probe or the agent's failure line arrives, or the command ends.
    """

    transport_errors = (OSError, EOFError, paramiko.SSHException)

    def __init__(self, alias: str, command: str, out: Sink, err: Sink,
                 on_change: Callable[[], None] = lambda: None) -> None:
        super().__init__(alias, out, err, on_change)
        self.transport: paramiko.Transport | None = None
        self.command = command
        self._channel: paramiko.Channel | None = None

    def start(self, transport: paramiko.Transport) -> None:
        """Open a channel on ``transport`` and execute the command; readers run in threads."""
        self.transport = transport
        chan = transport.open_session()
        chan.exec_command(self.command)
        self._channel = chan
        self._follow(chan.recv, chan.recv_stderr, lambda: self._finish(chan), f"ssh-{self.alias}")

    def _finish(self, chan: paramiko.Channel) -> None:
        code = chan.recv_exit_status()  # -1 when the connection died without an exit status
        self._ended(LOST_CONNECTION if code == -1 else code, lost=code == -1)

    # -- queries and control -------------------------------------------------------------------

    def send_line(self, text: str) -> None:
        assert self._channel is not None and "\n" not in text
        self._channel.sendall((text + "\n").encode())

    def close_stdin(self) -> None:
        """EOF on the remote stdin: the agent stops its workers and exits. Non-blocking, idempotent."""
        chan = self._channel
        if chan is not None and not chan.closed:
            try:
                chan.shutdown_write()
            except (OSError, EOFError, paramiko.SSHException):
                pass

    def kill_remote(self, pid: int | None) -> None:
        """Last resort: SIGKILL the remote agent by pid over a new channel, then drop the connection.

        The agent's watchdog and its workers' PDEATHSIG take the workers down with it.
        """
        try:
            if pid and self.transport is not None:
                chan = self.transport.open_session(timeout=KILL_CHANNEL_TIMEOUT_S)
                chan.exec_command(f"kill -KILL {int(pid)}")
                chan.recv_exit_status()
        except (OSError, EOFError, paramiko.SSHException):
            pass
        finally:
            self.close()

    def close(self) -> None:
        """Drop the channel and the connection; a connection already dead has nothing left to close."""
        try:
            if self._channel is not None:
                self._channel.close()  # sends a close message: EOFError/OSError once the link is gone
        except self.transport_errors:
            pass
        if self.transport is not None:
            self.transport.close()
