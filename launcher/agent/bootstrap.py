"""Remote side of an SSH launch: answer the preflight probe, then become the node agent.

The SSH runner starts ``python -m dslaunch.launcher.agent.bootstrap '<request JSON>'`` on every host in
one SSH command (no second round trip, which would cost a login shell per host). This module:

1. looks around (Python and torch versions, the working directory, which interface routes to the
   master address, whether the master address answers from here and whether the master port is
   free on the master host) and prints one ``@@dslaunch-probe {json}`` line on stdout. A master
   address that resolves to this host's loopback is ``loopback`` (never reachable) unless this
   host is the master host (``is_master`` in the request);
2. runs the node agent in this same process (``remote.main``): it waits for the NodeSpec line the
   controller sends once every host's probe passed, or for EOF when preflight failed elsewhere.

``--standby N`` instead of the request (a Ray node's actor keeps one such agent ready for the
job's next run): start N warm spare workers (``spare``: torch imported at idle priority, at
normal priority after ``STANDBY_PROMOTE_S`` on a host too busy to leave idle CPU), then
wait for the request as the first line on stdin; the agent then hands its workers to the spares.
EOF before the request: the spares are ended and it exits 0.

Standard library only and never imports torch (its version is read from torch/version.py), so the
probe answers in tens of milliseconds.
"""

from __future__ import annotations

import errno
import fcntl
import ipaddress
import json
import os
import platform
import re
import socket
import struct
import sys
import threading
import time

from dslaunch import __version__

__all__ = ["PROBE_MARKER", "STANDBY", "probe", "main", "route"]

PROBE_MARKER = "@@dslaunch-probe "
STANDBY = "--standby"
STANDBY_PROMOTE_S = 10.0
"""A standby's spares import at normal priority from this long after its start: a failure soon
after a run's start finds them warm on a busy host too, and the run's own start goes first."""
_SIOCGIFADDR = 0x8915
_CONNECT_TIMEOUT = 2.0
# "No route to host" may be the tail of an address resolution begun before a link came back (the
# kernel fails every connect queued on it): such answers are asked again, for one resolution cycle
# (3 probes 1 s apart), as torch's own rendezvous would keep trying; a timeout is not.
_TRANSIENT = (errno.EHOSTUNREACH, errno.ENETUNREACH)
_RETRY_FOR_S = 3.5
_RETRY_PAUSE_S = 0.5


def _torch_version() -> str | None:
    """torch's version without importing torch (~1.3 s) or scanning package metadata (~25 ms on
    the launch's critical path): ``torch/version.py`` holds ``__version__ = '...'``."""
    from importlib.util import find_spec

    spec = find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return None
    try:
        with open(os.path.join(next(iter(spec.submodule_search_locations)), "version.py")) as f:
            found = re.search(r"^__version__\s*=\s*['\"]([^'\"]+)['\"]", f.read(), re.M)
    except OSError:
        found = None
    return found.group(1) if found else "unknown"


def _iface_of(addr: str) -> str | None:
    """The interface that owns the IPv4 address ``addr`` on this host."""
    if addr.startswith("127."):
        return "lo"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _index, name in socket.if_nameindex():
            try:
                raw = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue  # interface without an IPv4 address
            if socket.inet_ntoa(raw[20:24]) == addr:
                return name
    return None


def route(master_ip: str, port: int) -> dict:
    """Source address and interface the kernel picks to reach the master (no packet sent)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((master_ip, port))
            src = s.getsockname()[0]
    except OSError as exc:
        return {"error": exc.strerror or str(exc)}
    return {"src": src, "iface": _iface_of(src)}


def _connect_once(master_ip: str, port: int) -> tuple[dict, int | None]:
    """One connect to the master port: refused = reachable and free; accepted = something listens.
    Returns the answer and the errno of an unreachable one."""
    try:
        with socket.create_connection((master_ip, port), timeout=_CONNECT_TIMEOUT):
            return {"status": "busy"}, None
    except ConnectionRefusedError:
        return {"status": "ok"}, None
    except TimeoutError:
        return {"status": "unreachable", "detail": f"timed out after {_CONNECT_TIMEOUT:g}s"}, None
    except OSError as exc:
        return {"status": "unreachable", "detail": exc.strerror or str(exc)}, exc.errno


def _reach(master_ip: str, port: int) -> dict:
    """``_connect_once``, asked again while the answer is a transient "no route" (``_TRANSIENT``)."""
    deadline = time.monotonic() + _RETRY_FOR_S
    while True:
        answer, err = _connect_once(master_ip, port)
        if err not in _TRANSIENT or time.monotonic() + _RETRY_PAUSE_S > deadline:
            return answer
        time.sleep(_RETRY_PAUSE_S)


def _port_free(port: int) -> dict:
    """Can the rendezvous store listen on ``port`` here? (the local launcher's own check)"""
    from dslaunch.errors import LaunchError
    from dslaunch.launcher.ports import check_port_free

    try:
        check_port_free(port)
    except LaunchError as err:
        return {"free": False, "detail": str(err)}
    except OSError as exc:
        return {"free": False, "detail": exc.strerror or str(exc)}
    return {"free": True}


def probe(request: dict) -> dict:
    """Look around this host for the preflight (see the module docstring)."""
    info: dict = {
        "pid": os.getpid(),
        "hostname": socket.gethostname(),
        "python": platform.python_version(),
        "implementation": platform.python_implementation(),
        "executable": sys.executable,
        "torch": _torch_version(),
        "dslaunch": __version__,
    }
    cwd = request.get("cwd")
    if cwd:
        try:
            os.chdir(cwd)
        except OSError as exc:
            info["cwd_error"] = exc.strerror or str(exc)
    script = request.get("script")
    if script and not os.path.isfile(script):  # relative to cwd, as the workers will see it
        info["script_missing"] = script
    master, port = request.get("master_addr"), int(request.get("master_port", 0))
    if master:
        try:
            master_ip = socket.getaddrinfo(master, port, socket.AF_INET, socket.SOCK_STREAM)[0][4][0]
        except OSError as exc:
            info["master"] = {"status": "unresolvable", "detail": getattr(exc, "strerror", None) or str(exc)}
        else:
            info["master_ip"] = master_ip
            if ipaddress.ip_address(master_ip).is_loopback and not request.get("is_master"):
                # Our own loopback: a connect would be refused "ok" by this very host, and the
                # job would hang at rendezvous.
                info["master"] = {"status": "loopback"}
                return info
            info["route"] = route(master_ip, port)
            info["master"] = _reach(master_ip, port)
            if request.get("is_master"):
                info["port"] = _port_free(port)
    return info


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    spares = None
    if argv[:1] == [STANDBY]:
        from dslaunch.launcher.agent.spare import SparePool

        spares = SparePool(os.environ)
        spares.fill(int(argv[1]))
        asked = threading.Event()
        threading.Thread(target=_promote, args=(spares, asked), daemon=True, name="promote").start()
        argv = [_request_line()]
        asked.set()
        if not argv[0]:
            spares.close()
            return 0
    request = json.loads(argv[0]) if argv else {}
    line = PROBE_MARKER + json.dumps(probe(request), separators=(",", ":")) + "\n"
    os.write(1, line.encode())
    from dslaunch.launcher.agent import remote  # after the probe: its answer should not wait for imports

    return remote.main(spares)


def _promote(spares, asked: threading.Event) -> None:
    """From ``STANDBY_PROMOTE_S`` on, keep the spares at normal priority until the request came."""
    if asked.wait(STANDBY_PROMOTE_S):
        return
    while True:
        spares.promote()
        if asked.wait(1.0):
            return


def _request_line() -> str:
    """The request, the first line on stdin ('' at EOF), read a byte at a time: the NodeSpec line
    that follows it is the agent's to read from the same descriptor."""
    data = b""
    while not data.endswith(b"\n") and (byte := os.read(0, 1)):
        data += byte
    return data.decode().strip()


if __name__ == "__main__":
    sys.exit(main())
