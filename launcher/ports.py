"""Is the rendezvous port free? Checked before any worker starts, so a busy port is one clear line.

torch's TCPStore (rank 0) listens on all interfaces with SO_REUSEADDR, so we probe the same way:
a listener anywhere on the port makes the bind fail, a socket in TIME_WAIT does not.
"""

from __future__ import annotations

import errno
import socket

from dslaunch.errors import LaunchError

__all__ = ["check_port_free"]


def check_port_free(port: int) -> None:
    """Raise LaunchError naming the process that listens on ``port`` (when it can be found)."""
    for family, addr in ((socket.AF_INET6, "::"), (socket.AF_INET, "0.0.0.0")):
        try:
            s = socket.socket(family, socket.SOCK_STREAM)
        except OSError:  # no IPv6 on this machine
            continue
        with s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((addr, port))  # each probe socket closes before the next one binds
            except OSError as err:
                if err.errno == errno.EADDRINUSE:
                    raise LaunchError(f"--master_port {port} is already in use{_owner(port)}; "
                                      "pick a free port with --master_port") from None
                if err.errno != errno.EADDRNOTAVAIL:  # EADDRNOTAVAIL: IPv6 disabled; IPv4 still checked
                    raise


def _owner(port: int) -> str:
    """' (by pid N: name)' for the listener, or '' (psutil is imported only on this error path)."""
    try:
        import psutil

        for conn in psutil.net_connections(kind="tcp"):
            if conn.laddr and conn.laddr.port == port and conn.status == psutil.CONN_LISTEN and conn.pid:
                return f" (by pid {conn.pid}: {psutil.Process(conn.pid).name()})"
    except Exception:  # best effort: never mask the real message
        pass
    return ""
