"""Where and how to log into each host: ssh config resolution and the user's SSH options.

- ``SSHOptions``: what the user chose (ssh config file, ``--ssh_port``, user, identity files,
  known_hosts files, whether to accept new host keys), also parsed from ssh-style
  ``--launcher_args`` (``-F file -i key -l user -p port -o Key=Value``, or attached as ssh takes
  them: ``-p2222``). A malformed or unsupported option is a ``UsageError`` naming it and its
  valid form (never a Python error from shlex or float).
- ``resolve(alias, options) -> SSHTarget``: applies ``~/.ssh/config`` (or ``-F``): HostName, User,
  Port, IdentityFile, IdentitiesOnly, UserKnownHostsFile, GlobalKnownHostsFile,
  StrictHostKeyChecking, ConnectTimeout. Command-line choices win over the config, as with ``ssh``.

No network here: ``connect`` does the connecting.
"""

from __future__ import annotations

import math
import os
import re
import shlex
from dataclasses import dataclass, field, replace

from dslaunch.errors import UsageError, did_you_mean, quote
from dslaunch.launcher.runners.ssh.sshlib import lookup, paramiko
from dslaunch.utils.hostlist import hostname_problem

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

    def __post_init__(self) -> None:
        # ``port`` is --ssh_port (a -p value is checked before it lands here): a bad one must be
        # one line now, not an OverflowError from the socket module while connecting.
        if self.port is not None and not 0 < self.port < 65536:
            raise UsageError(f"--ssh_port {self.port} is not a TCP port (1-65535)")

    @classmethod
    def from_launcher_args(cls, text: str, **overrides) -> SSHOptions:
        """Parse ssh-style options (``-F -i -l -p -o``, also attached: ``-p2222``) from ``--launcher_args``.

        Raises:
            UsageError: a malformed or unsupported option, naming it and its valid form.
        """
        opts = cls(**overrides)
        for flag, value in _flag_values(_split(text)):
            opts = _apply_flag(opts, flag, value)
        return opts


_FLAG_FORMS = {"-F": "FILE", "-i": "KEY", "-l": "USER", "-p": "PORT", "-o": "Key=Value"}
_ACCEPTED = "-F FILE, -i KEY, -l USER, -p PORT and -o Key=Value"
# -o keys the SSH runner honours (canonical spelling -> valid form, quote in errors).
_O_FORMS = {"StrictHostKeyChecking": "yes|accept-new|no", "UserKnownHostsFile": "FILE",
            "ConnectTimeout": "SECONDS", "Port": "PORT", "User": "USER", "IdentityFile": "FILE"}
_O_CANONICAL = {k.lower(): k for k in _O_FORMS}
_STRICT_VALUES = ("yes", "ask", "accept-new", "no", "off")  # "ask" cannot ask here: same as yes


def _split(text: str) -> list[str]:
    try:
        return shlex.split(text or "")
    except ValueError as exc:  # shlex: "No closing quotation", "No escaped character"
        raise UsageError(f"--launcher_args {text!r}: {str(exc).lower()}; quote values as in a shell, "
                         "e.g. \"-F '/path/my config'\"") from None


def _flag_values(words: list[str]) -> list[tuple[str, str]]:
    """``[-p, 22, -oPort=22]`` -> ``[(-p, 22), (-o, Port=22)]``; a flag without its value is an error."""
    pairs: list[tuple[str, str]] = []
    i = 0
    while i < len(words):
        flag = words[i][:2]
        if flag not in _FLAG_FORMS:
            raise UsageError(f"--launcher_args: the ssh runner accepts {_ACCEPTED}, not {words[i]!r}")
        if len(words[i]) > 2:  # ssh's attached form
            value, i = words[i][2:], i + 1
        else:
            value, i = (words[i + 1] if i + 1 < len(words) else ""), i + 2
        if not value.strip():
            raise UsageError(f"--launcher_args: {flag} needs a value ({flag} {_FLAG_FORMS[flag]})")
        pairs.append((flag, value))
    return pairs


def _apply_flag(opts: SSHOptions, flag: str, value: str) -> SSHOptions:
    if flag == "-F":
        return replace(opts, config_file=value)
    if flag == "-i":
        return replace(opts, identity_files=(*opts.identity_files, value))
    if flag == "-l":
        return replace(opts, user=value)
    if flag == "-p":
        port = _port(value, "--launcher_args -p")  # checked even when --ssh_port wins
        return replace(opts, port=opts.port or port)
    return _apply_o(opts, value)


def _port(value: str, what: str) -> int:
    if not (value.isascii() and value.isdigit() and 0 < int(value) < 65536):
        raise UsageError(f"{what}: {value!r} is not a TCP port (1-65535)")
    return int(value)


def _seconds(value: str, what: str) -> float:
    try:
        seconds = float(value)
    except ValueError:
        seconds = float("nan")
    if not 0 < seconds < math.inf:  # also NaN
        raise UsageError(f"{what}: {value!r} is not a positive number of seconds (e.g. 10)")
    return seconds


def _apply_o(opts: SSHOptions, option: str) -> SSHOptions:
    key, _, value = option.strip().replace(" ", "=", 1).partition("=")
    name = _O_CANONICAL.get(key.lower())
    if name is None:
        raise UsageError(f"--launcher_args: unsupported ssh option -o {key!r}{did_you_mean(key, _O_FORMS)} "
                         f"(supported: {', '.join(_O_FORMS)})")
    value = value.strip()
    what = f"--launcher_args -o {name}"
    if not value:
        raise UsageError(f"{what} needs a value (-o {name}={_O_FORMS[name]})")
    if name == "StrictHostKeyChecking":
        if value.lower() not in _STRICT_VALUES:
            raise UsageError(f"{what}: {value!r} is not one of {', '.join(_STRICT_VALUES)}")
        accept = value.lower() in ("no", "accept-new", "off")
        return replace(opts, accept_new_host_keys=opts.accept_new_host_keys or accept)
    if name == "UserKnownHostsFile":
        return replace(opts, known_hosts_files=(*opts.known_hosts_files, *value.split()))
    if name == "ConnectTimeout":
        return replace(opts, connect_timeout=_seconds(value, what))
    if name == "Port":
        port = _port(value, what)
        return replace(opts, port=opts.port or port)
    if name == "User":
        return replace(opts, user=opts.user or value)
    return replace(opts, identity_files=(*opts.identity_files, value))


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
    default = os.path.expanduser("~/.ssh/config")
    path = _expand(path) if path else default  # -F '~/x' came quoted: no shell expanded it
    if not os.path.exists(path):
        if path != default:
            raise UsageError(f"--launcher_args -F: ssh config file {path} does not exist")
        return paramiko.SSHConfig()
    try:
        return paramiko.SSHConfig.from_path(path)
    except Exception as exc:  # paramiko raises bare ConfigParseError/ValueError types
        raise UsageError(f"{path}: cannot parse ssh config: {exc}") from None


# What OpenSSH 9.6 refuses in a user name given on its command line (a ProxyCommand or Match exec
# with %r would hand it to a shell), plus any whitespace or control character.
_USER_BAD = re.compile(r"[\s\x00-\x1f\x7f'`\"$\\;&<>|(){}]")


def _checked_user(options: SSHOptions, configured: str | None, alias: str) -> str:
    """The login user (command line, else ssh config, else $USER, else root), refused when a shell
    or ssh would read it as something else (an option, a command)."""
    for user, source in ((options.user, "--launcher_args -l/-o User"), (configured, f"ssh config User for {alias}"),
                         (os.environ.get("USER"), "$USER")):
        if user:
            if user.startswith("-") or _USER_BAD.search(user):
                raise UsageError(f"{source}: {quote(user)} is not a user name ssh accepts (no leading '-', "
                                 "whitespace, quotes or shell characters such as ; & | $ `)")
            return user
    return "root"


def _checked_hostname(hostname: str, alias: str) -> str:
    if hostname != alias and (problem := hostname_problem(hostname)):  # the alias was checked with the hostfile
        raise UsageError(f"ssh config HostName for {alias}: {quote(hostname)}: {problem}")
    return hostname


def _refuse_proxies(cfg: dict, alias: str) -> None:
    """dslaunch connects straight to each host: a proxy the ssh config asks for must not be skipped silently."""
    for key, name in (("proxyjump", "ProxyJump"), ("proxycommand", "ProxyCommand")):
        value = cfg.get(key)
        if value and str(value).lower() != "none":
            raise UsageError(f"ssh config {name} for {alias}: {quote(str(value))}: dslaunch connects to each host "
                             "directly and does not support jump hosts; run dslaunch on a host that reaches "
                             f"{alias} directly, or set {name} none for it")


def resolve(alias: str, options: SSHOptions, config: paramiko.SSHConfig | None = None) -> SSHTarget:
    """Apply the ssh config and the user's options to one hostfile name."""
    cfg = lookup(config or load_config(options.config_file), alias)
    _refuse_proxies(cfg, alias)
    port = options.port or _port(cfg.get("port", "22"), f"ssh config Port for {alias}")
    identity = tuple(_expand(p) for p in (*options.identity_files, *cfg.get("identityfile", [])))
    known = options.known_hosts_files or tuple(cfg.get("userknownhostsfile", "").split())
    if not known:
        known = ("~/.ssh/known_hosts", "~/.ssh/known_hosts2")
    known += tuple(cfg.get("globalknownhostsfile", "/etc/ssh/ssh_known_hosts").split())
    strict = cfg.get("stricthostkeychecking", "ask").lower()
    timeout = options.connect_timeout or _seconds(cfg.get("connecttimeout", str(DEFAULT_CONNECT_TIMEOUT)),
                                                  f"ssh config ConnectTimeout for {alias}")
    return SSHTarget(
        alias=alias,
        hostname=_checked_hostname(cfg.get("hostname", alias), alias),
        port=port,
        user=_checked_user(options, cfg.get("user"), alias),
        identity_files=identity,
        identities_only=cfg.get("identitiesonly", "no").lower() == "yes",
        known_hosts_files=tuple(_expand(p) for p in known),
        accept_new_host_keys=options.accept_new_host_keys or strict in ("no", "accept-new", "off"),
        connect_timeout=min(timeout, 30.0),
    )
