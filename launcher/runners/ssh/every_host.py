"""One shell command on every host over SSH: what DeepSpeed's ``ds_ssh`` does with ``pdsh``.

``run_on_hosts(targets, command, out, err)`` connects to every host in parallel (the SSH runner's
``connect``: the ssh config, keys and known_hosts rules of a launch) and runs ``command`` there
through the login shell, as ``pdsh -w HOSTS COMMAND`` does. Every line a host prints comes back
prefixed ``host: ``, stdout to ``out`` and stderr to ``err``, one whole line per write, so hosts
never interleave inside a line. A host that cannot be reached or logged into prints one line on
``err`` saying why and counts as exit 255 (ssh's code for a failed connection), while the others
still run; so does a host whose connection drops, or whose command dies by a signal (SSH then sends
no exit status).

Limitations: no stdin is sent (the remote command reads EOF) and no terminal is allocated, as with
pdsh; an interrupted run leaves the remote commands to the hosts' sshd (they see their channel
close).
"""

from __future__ import annotations

import threading

from dslaunch.launcher.agent.output import Sink
from dslaunch.launcher.runners.ssh.connect import SSHError, SSHTarget, connect
from dslaunch.launcher.runners.ssh.session import LOST_CONNECTION, RemoteSession
from dslaunch.launcher.runners.stream import read_lines

__all__ = ["run_on_hosts"]

_TRANSPORT_ERRORS = RemoteSession.transport_errors  # what a channel raises once its connection is gone


def run_on_hosts(targets: list[SSHTarget], command: str, out: Sink, err: Sink) -> dict[str, int]:
    """Run ``command`` on every target at once; return alias -> exit code, in ``targets`` order.

    Args:
        targets: the hosts (``connect.resolve`` of each hostfile name).
        command: a shell command line, run by each host's login shell.
        out, err: where the prefixed lines go.

    Returns:
        Each host's exit code; 255 for a host that could not run the command to its end.
    """
    codes: dict[str, int] = {}
    threads = [threading.Thread(target=lambda t=t: codes.__setitem__(t.alias, _run_one(t, command, out, err)),
                                name=f"ssh-{t.alias}", daemon=True) for t in targets]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return {t.alias: codes[t.alias] for t in targets}


def _run_one(target: SSHTarget, command: str, out: Sink, err: Sink) -> int:
    prefix = f"{target.alias}: ".encode()
    try:
        transport = connect(target)
    except SSHError as exc:
        _cause, message = exc.failures[target.alias]
        err.write(prefix + f"dslaunch: {message}\n".encode())
        return LOST_CONNECTION
    try:
        chan = transport.open_session()
        chan.exec_command(command)
        stderr = threading.Thread(target=read_lines, daemon=True,
                                  args=(chan.recv_stderr, lambda line: err.write(prefix + line), _TRANSPORT_ERRORS))
        stderr.start()
        read_lines(chan.recv, lambda line: out.write(prefix + line), _TRANSPORT_ERRORS)
        stderr.join()
        code = chan.recv_exit_status()  # -1: the connection dropped, or a signal ended the command
    except _TRANSPORT_ERRORS as exc:
        err.write(prefix + f"dslaunch: the SSH connection failed while running the command: {exc}\n".encode())
        return LOST_CONNECTION
    finally:
        transport.close()
    if code == -1:
        err.write(prefix + b"dslaunch: no exit status (the connection dropped, or a signal ended the command)\n")
        return LOST_CONNECTION
    return code
