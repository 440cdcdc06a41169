"""SSH connections for the SSH runner: resolve hosts like OpenSSH, verify keys, connect in parallel.

Owns the client side of SSH and nothing else (what runs remotely is the probe and the agent):

- ``SSHOptions``/``resolve`` (re-exported from ``options``): where and how to log in;
- ``connect_all(targets) -> {alias: paramiko.Transport}``: one thread per host, TCP keepalive and
  ``TCP_USER_TIMEOUT`` on the socket plus SSH keepalives (a host whose link dies is noticed in
  seconds, not at the TCP timeout), host keys verified against known_hosts. Every failure is an
  ``SSHError`` naming the host and its cause: refused, timeout, unreachable, unknown host (DNS),
  auth, unknown host key, changed host key;
- ``source_address(target)``: this machine's address toward a host (for a master address that
  the hosts can reach when the first host is this machine's loopback).
"""

from __future__ import annotations

import errno
import logging
import os
import shlex
import socket
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from dslaunch.errors import HostsError
from dslaunch.launcher.runners.ssh.options import SSHOptions, SSHTarget, load_config, resolve
from dslaunch.launcher.runners.ssh.sshlib import paramiko
from dslaunch.safe_write import append_file, make_dirs, split_path

__all__ = ["SSHOptions", "SSHTarget", "SSHError", "load_config", "resolve", "connect", "connect_all",
           "source_address"]

KEEPALIVE_SECONDS = 2
_DEFAULT_KEYS = ("id_ed25519", "id_ecdsa", "id_rsa")
_KNOWN_HOSTS_LOCK = threading.Lock()  # parallel connects may append to the same known_hosts
# paramiko logs handshake failures itself; we report them as SSHError. A NullHandler keeps
# Python's last-resort handler from printing paramiko's copy on the user's terminal.
logging.getLogger("paramiko").addHandler(logging.NullHandler())


class SSHError(HostsError):
    """One or more hosts could not be reached or logged into.

    ``failures`` maps host -> (cause, message); cause is one of ``refused``, ``timeout``,
    ``unreachable``, ``unknown-host``, ``auth``, ``unknown-host-key``, ``changed-host-key``,
    ``key-file``, ``ssh`` (protocol error), ``interpreter``, ``venv_script``, ``preflight``.
    """


class _Fail(Exception):
    def __init__(self, cause: str, message: str):
        self.cause, self.message = cause, message
        super().__init__(message)


def _unresolvable(t: SSHTarget, exc: socket.gaierror) -> _Fail:
    return _Fail("unknown-host", f"cannot resolve host name {t.hostname!r} ({exc.strerror})")


def _open_socket(t: SSHTarget) -> socket.socket:
    try:
        sock = socket.create_connection((t.hostname, t.port), timeout=t.connect_timeout)
    except socket.gaierror as exc:
        raise _unresolvable(t, exc) from None
    except ConnectionRefusedError:
        raise _Fail("refused", f"connection refused by {t.hostname} port {t.port} "
                    "(no sshd listening there? see --ssh_port)") from None
    except TimeoutError:
        raise _Fail("timeout", f"timed out after {t.connect_timeout:g}s connecting to "
                    f"{t.hostname} port {t.port} (host down or port filtered?)") from None
    except OSError as exc:
        if exc.errno in (errno.EHOSTUNREACH, errno.ENETUNREACH, errno.EHOSTDOWN):
            raise _Fail("unreachable", f"{t.hostname} port {t.port} is unreachable ({exc.strerror})") from None
        raise _Fail("unreachable", f"cannot connect to {t.hostname} port {t.port}: {exc}") from None
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    # Why: a host whose link goes down must end the job in seconds, not at TCP's ~15 min timeout.
    for opt, val in (("TCP_KEEPIDLE", 2), ("TCP_KEEPINTVL", 1), ("TCP_KEEPCNT", 3),
                     ("TCP_USER_TIMEOUT", 6000), ("TCP_NODELAY", 1)):
        if hasattr(socket, opt):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, opt), val)
    return sock


def source_address(t: SSHTarget) -> str:
    """This machine's IPv4 address on its route to ``t``: the kernel's choice, no packet sent.

    Raises:
        SSHError: ``t`` does not resolve (``unknown-host``) or there is no route (``unreachable``).
    """
    try:
        addr = socket.getaddrinfo(t.hostname, t.port, socket.AF_INET, socket.SOCK_DGRAM)[0][4]
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(addr)  # UDP: only picks the route
            return s.getsockname()[0]
    except socket.gaierror as exc:
        fail = _unresolvable(t, exc)
    except OSError as exc:
        fail = _Fail("unreachable", f"no route from here to {t.hostname} ({exc.strerror or exc})")
    raise SSHError({t.alias: (fail.cause, fail.message)})


def _known_names(t: SSHTarget) -> list[str]:
    names = [t.hostname, t.alias] if t.alias != t.hostname else [t.hostname]
    return names if t.port == 22 else [f"[{n}]:{t.port}" for n in names]


def _load_known(t: SSHTarget) -> paramiko.HostKeys:
    keys = paramiko.HostKeys()
    for path in t.known_hosts_files:
        if os.path.isfile(path):
            try:
                keys.load(path)
            except (OSError, paramiko.SSHException) as exc:
                raise _Fail("ssh", f"cannot read known_hosts file {path}: {exc}") from None
    return keys


def _known_for(t: SSHTarget, keys: paramiko.HostKeys) -> dict[str, paramiko.PKey]:
    found: dict[str, paramiko.PKey] = {}
    for name in _known_names(t):
        for ktype, key in (keys.lookup(name) or {}).items():
            found.setdefault(ktype, key)
    return found


def _record_new_key(t: SSHTarget, key: paramiko.PKey) -> None:
    path = next((p for p in t.known_hosts_files if not p.startswith("/etc/")), None)
    if path is None:
        return
    folder, name = split_path(path)
    make_dirs(folder, 0o700)  # safe_write's rule: no planted link followed, ~/.ssh private
    with _KNOWN_HOSTS_LOCK, append_file(folder, name) as f:
        f.write(f"{_known_names(t)[0]} {key.get_name()} {key.get_base64()}\n")


def _verify_host_key(t: SSHTarget, known: dict[str, paramiko.PKey], key: paramiko.PKey) -> None:
    fingerprint = key.fingerprint  # "SHA256:..."
    if key.get_name() in known:
        if known[key.get_name()] != key:
            raise _Fail("changed-host-key", f"HOST KEY CHANGED for {t.hostname}: the {key.get_name()} key "
                        f"it offers ({fingerprint}) differs from the one in known_hosts "
                        f"({', '.join(t.known_hosts_files)}); someone may be intercepting the "
                        "connection, or the host was reinstalled: remove the old entry to continue")
        return
    if t.accept_new_host_keys and not known:
        _record_new_key(t, key)
        return
    keyscan = shlex.join(["ssh-keyscan", *([] if t.port == 22 else ["-p", str(t.port)]), t.hostname])
    user_files = [p for p in t.known_hosts_files if not p.startswith("/etc/")]
    raise _Fail("unknown-host-key", f"unknown host key: {t.hostname} ({key.get_name()} {fingerprint}) "
                f"is not in known_hosts ({', '.join(user_files)}); "
                f"check the fingerprint and add it (`{keyscan} >> {shlex.quote(user_files[0]) if user_files else '~/.ssh/known_hosts'}`), "
                "or pass --ssh_accept_new_host_keys to accept and record new keys")


def _load_keys(t: SSHTarget) -> list[tuple[str, paramiko.PKey]]:
    paths = list(t.identity_files)
    if not paths:
        paths = [os.path.expanduser(f"~/.ssh/{n}") for n in _DEFAULT_KEYS]
        paths = [p for p in paths if os.path.exists(p)]
    keys = []
    for path in paths:
        if not os.path.exists(path):
            if path in t.identity_files:
                raise _Fail("key-file", f"identity file {path} does not exist")
            continue
        try:
            keys.append((path, paramiko.PKey.from_path(path)))
        except paramiko.PasswordRequiredException:
            continue  # encrypted: only usable through an ssh-agent, tried below
        except (OSError, paramiko.SSHException, ValueError) as exc:
            raise _Fail("key-file", f"cannot load identity file {path}: {exc}") from None
    if not t.identities_only and os.environ.get("SSH_AUTH_SOCK"):
        keys += [("ssh-agent", k) for k in paramiko.Agent().get_keys()]
    return keys


def _authenticate(transport: paramiko.Transport, t: SSHTarget) -> None:
    keys = _load_keys(t)
    if not keys:
        raise _Fail("auth", f"no usable identity to log in as {t.user}@{t.hostname}: no IdentityFile in "
                    "the ssh config, no ~/.ssh/id_* key (passphrase-protected keys need an ssh-agent) "
                    "and no ssh-agent key")
    for _path, key in keys:
        try:
            transport.auth_publickey(t.user, key)
            return
        except paramiko.AuthenticationException:
            continue
    tried = ", ".join(p for p, _ in keys)
    raise _Fail("auth", f"authentication failed for {t.user}@{t.hostname} port {t.port} "
                f"(public keys tried: {tried}); is the key in that user's authorized_keys?")


def connect(t: SSHTarget) -> paramiko.Transport:
    """Open an authenticated SSH transport to one host.

    Raises:
        SSHError: with one failure for ``t.alias`` (see ``SSHError`` for the causes).
    """
    transport = None
    try:
        known = _known_for(t, _load_known(t))
        sock = _open_socket(t)
        transport = paramiko.Transport(sock)
        transport.banner_timeout = transport.handshake_timeout = t.connect_timeout
        if known:  # negotiate a key type we can verify, as OpenSSH does
            opts = transport.get_security_options()
            opts.key_types = [k for k in opts.key_types if k in known] or opts.key_types
        transport.start_client(timeout=t.connect_timeout)
        if not transport.is_active() or transport.host_key is None:  # start_client returns on timeout
            raise _Fail("timeout", f"no SSH handshake with {t.hostname} port {t.port} within "
                        f"{t.connect_timeout:g}s (is an sshd listening there? see --ssh_port)")
        _verify_host_key(t, known, transport.get_remote_server_key())
        _authenticate(transport, t)
        transport.set_keepalive(KEEPALIVE_SECONDS)
        return transport
    except _Fail as fail:
        failure = (fail.cause, fail.message)
    except (paramiko.SSHException, EOFError, OSError) as exc:
        if "banner" in str(exc) or isinstance(exc, TimeoutError):
            failure = ("timeout", f"no SSH greeting from {t.hostname} port {t.port} within "
                       f"{t.connect_timeout:g}s (is an sshd listening there? see --ssh_port)")
        else:
            failure = ("ssh", f"SSH handshake with {t.where} failed: {exc or type(exc).__name__}")
    if transport is not None:
        transport.close()
    raise SSHError({t.alias: failure})


def _connect_then(t: SSHTarget, then: Callable[[SSHTarget, paramiko.Transport], None] | None) -> paramiko.Transport:
    transport = connect(t)
    if then is not None:
        try:
            then(t, transport)
        except (OSError, EOFError, paramiko.SSHException) as exc:
            transport.close()
            raise SSHError({t.alias: ("ssh", f"connected, but starting the remote command failed: {exc}")}) from None
    return transport


def connect_all(targets: list[SSHTarget],
                then: Callable[[SSHTarget, paramiko.Transport], None] | None = None) -> dict[str, paramiko.Transport]:
    """Connect to every target in parallel; all or nothing.

    Args:
        targets: the hosts.
        then: called in the connecting thread right after a host is ready (e.g. to start the
            remote command without waiting for the slowest host).

    Returns:
        alias -> authenticated transport, in ``targets`` order.

    Raises:
        SSHError: naming every host that failed and why (the others are closed).
    """
    with ThreadPoolExecutor(max_workers=max(1, len(targets))) as pool:
        futures = {t.alias: pool.submit(_connect_then, t, then) for t in targets}
    done: dict[str, paramiko.Transport] = {}
    failures: dict[str, tuple[str, str]] = {}
    for alias, fut in futures.items():
        try:
            done[alias] = fut.result()
        except SSHError as err:
            failures.update(err.failures)
    if failures:
        for transport in done.values():
            transport.close()
        raise SSHError(failures)
    return done
