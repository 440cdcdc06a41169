"""Where and how to log into each host: ssh config resolution and the user's SSH options.

- ``SSHOptions``: what the user chose (ssh config file, ``--ssh_port``, user, identity files,
  known_hosts files, whether to accept new host keys), also parsed from ssh-style
  ``--launcher_args`` (``-F file -i key -l user -p port -o Key=Value``).
- ``resolve(alias, options) -> SSHTarget``: applies ``~/.ssh/config`` (or ``-F``): HostName, User,
  Port, IdentityFile, IdentitiesOnly, UserKnownHostsFile, GlobalKnownHostsFile,
  StrictHostKeyChecking, ConnectTimeout. Command-line choices win over the config, as with ``ssh``.

No network here: ``ssh_connect`` does the connecting.
"""

from __future__ import annotations

import os
import shlex
from dataclasses import dataclass, field, replace

import paramiko

from dslaunch.errors import UsageError

__all__ = ["SSHOptions", "SSHTarget", "DEFAULT_CONNECT_TIMEOUT", "load_config", "resolve"]

DEFAULT_CONNECT_TIMEOUT = 4.0


@dataclass(frozen=True)
class SSHOptions:
    """The user's SSH choices (CLI/launcher_args); ``None``/empty = take the ssh config's value."""

    config_file: str | None = None
    """ssh config to read; None = ``~/.ssh/config`` when it exists."""
    port: int | None = None
    """``--ssh_port``: overrides the config's Port for every host."""
    user: str | None = None
    identity_files: tuple[str, ...] = ()
    known_hosts_files: tuple[str, ...] = ()
    accept_new_host_keys: bool = False
    """Accept and record keys of hosts not in known_hosts (OpenSSH's ``accept-new``)."""
    connect_timeout: float | None = None

    @classmethod
    def from_launcher_args(cls, text: str, **overrides) -> SSHOptions:
        """Parse ssh-style options (``-F -i -l -p -o``) from ``--launcher_args``.

        Raises:
            UsageError: an option the SSH runner does not understand, naming it.
        """
        opts = cls(**overrides)
        words = shlex.split(text or "")
        i = 0
        while i < len(words):
            flag = words[i]
            if flag not in ("-F", "-i", "-l", "-p", "-o") or i + 1 >= len(words):
                raise UsageError(f"--launcher_args: the ssh runner accepts -F FILE, -i KEY, -l USER, "
                                 f"-p PORT and -o Key=Value, not {flag!r}")
            value = words[i + 1]
            i += 2
            if flag == "-F":
                opts = replace(opts, config_file=value)
            elif flag == "-i":
                opts = replace(opts, identity_files=(*opts.identity_files, value))
            elif flag == "-l":
                opts = replace(opts, user=value)
            elif flag == "-p":
                opts = replace(opts, port=opts.port or _port(value, "-p"))
            else:
                opts = _apply_o(opts, value)
        return opts


def _port(value: str, what: str) -> int:
    if not value.isdigit() or not 0 < int(value) < 65536:
        raise UsageError(f"{what}: {value!r} is not a TCP port (1-65535)")
    return int(value)


def _apply_o(opts: SSHOptions, option: str) -> SSHOptions:
    key, _, value = option.replace(" ", "=", 1).partition("=")
    key = key.lower()
    if key == "stricthostkeychecking":
        return replace(opts, accept_new_host_keys=opts.accept_new_host_keys or value in ("no", "accept-new"))
    if key == "userknownhostsfile":
        return replace(opts, known_hosts_files=(*opts.known_hosts_files, *value.split()))
    if key == "connecttimeout":
        return replace(opts, connect_timeout=float(value))
    if key == "port":
        return replace(opts, port=opts.port or _port(value, "-o Port"))
    if key == "user":
        return replace(opts, user=opts.user or value)
    if key == "identityfile":
        return replace(opts, identity_files=(*opts.identity_files, value))
    raise UsageError(f"--launcher_args: unsupported ssh option -o {option!r} (supported: "
                     "StrictHostKeyChecking, UserKnownHostsFile, ConnectTimeout, Port, User, IdentityFile)")


@dataclass(frozen=True)
class SSHTarget:
    """Where and how to log into one host, after applying the ssh config."""

    alias: str
    """The name in the hostfile (what messages show)."""
    hostname: str
    port: int = 22
    user: str = "root"
    identity_files: tuple[str, ...] = ()
    identities_only: bool = False
    known_hosts_files: tuple[str, ...] = ()
    accept_new_host_keys: bool = False
    connect_timeout: float = DEFAULT_CONNECT_TIMEOUT
    extra: dict[str, str] = field(default_factory=dict, compare=False)

    @property
    def where(self) -> str:
        return f"{self.user}@{self.hostname}:{self.port}"


def _expand(path: str) -> str:
    return os.path.expanduser(os.path.expandvars(path))


def load_config(path: str | None) -> paramiko.SSHConfig:
    """Parse ``path`` (None: ``~/.ssh/config`` if present). Raises UsageError naming the file."""
    path = path or os.path.expanduser("~/.ssh/config")
    if not os.path.exists(path):
        if path != os.path.expanduser("~/.ssh/config"):
            raise UsageError(f"ssh config file {path} does not exist")
        return paramiko.SSHConfig()
    try:
        return paramiko.SSHConfig.from_path(path)
    except Exception as exc:  # paramiko raises bare ConfigParseError/ValueError types
        raise UsageError(f"{path}: cannot parse ssh config: {exc}") from None


def resolve(alias: str, options: SSHOptions, config: paramiko.SSHConfig | None = None) -> SSHTarget:
    """Apply the ssh config and the user's options to one hostfile name."""
    cfg = (config or load_config(options.config_file)).lookup(alias)
    port = options.port or _port(cfg.get("port", "22"), f"ssh config Port for {alias}")
    identity = tuple(_expand(p) for p in (*options.identity_files, *cfg.get("identityfile", [])))
    known = options.known_hosts_files or tuple(cfg.get("userknownhostsfile", "").split())
    if not known:
        known = ("~/.ssh/known_hosts", "~/.ssh/known_hosts2")
    known += tuple(cfg.get("globalknownhostsfile", "/etc/ssh/ssh_known_hosts").split())
    strict = cfg.get("stricthostkeychecking", "ask").lower()
    timeout = options.connect_timeout or float(cfg.get("connecttimeout", DEFAULT_CONNECT_TIMEOUT))
    return SSHTarget(
        alias=alias,
        hostname=cfg.get("hostname", alias),
        port=port,
        user=options.user or cfg.get("user") or os.environ.get("USER") or "root",
        identity_files=identity,
        identities_only=cfg.get("identitiesonly", "no").lower() == "yes",
        known_hosts_files=tuple(_expand(p) for p in known),
        accept_new_host_keys=options.accept_new_host_keys or strict in ("no", "accept-new", "off"),
        connect_timeout=min(timeout, 30.0),
    )
