"""DeepSpeed's ``deepspeed.launcher.runner``: the launch command as a function, and the runner's
helpers for hostfiles, ``--include``/``--exclude`` and the world info, as DeepSpeed's tests and
scripts (GPT-NeoX's ``deepy.py``) call them.

Each helper is dslaunch's own launcher underneath: one hostfile grammar (``hostfile.parse_hostfile``),
one filter (``hostfile.filter_pool``), one flag parser (``cli.flags``). Their errors are
``ValueError`` s (``HostfileError``, ``UsageError``), as DeepSpeed's are, with dslaunch's one-line
messages naming the line or flag.

accelerate's ``accelerate launch`` reads ``DEEPSPEED_ENVIRONMENT_NAME`` to write the variables
it forwards to other nodes; ``python -m deepspeed.launcher.runner`` (or ``dslaunch.launcher.runner``)
is the ``dslaunch``/``deepspeed`` command.
"""

from __future__ import annotations

import argparse
import base64
import json
import sys
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence

from dslaunch.constants import TORCH_DISTRIBUTED_DEFAULT_PORT
from dslaunch.errors import DslaunchError
from dslaunch.launcher import cli
from dslaunch.launcher.cli.flags import build_parser
from dslaunch.launcher.envfile import ENV_FILE_NAMES
from dslaunch.launcher.hostfile import filter_pool, parse_hostfile, read_hostfile
from dslaunch.launcher.plan import DEFAULT_HOSTFILE
from dslaunch.utils.logging import logger

__all__ = ["DEEPSPEED_ENVIRONMENT_NAME", "DLTS_HOSTFILE", "main", "parse_args", "fetch_hostfile", "parse_resource_filter",
           "parse_inclusion_exclusion", "encode_world_info"]

DEEPSPEED_ENVIRONMENT_NAME = ENV_FILE_NAMES[0]  # ".deepspeed_env", read from ~ and the working dir
DLTS_HOSTFILE = DEFAULT_HOSTFILE  # "/job/hostfile": GPT-NeoX reads DeepSpeed's name for it


def main(args: Sequence[str] | None = None) -> None:
    """Run the ``deepspeed`` command with ``args`` (default ``sys.argv[1:]``), as DeepSpeed's
    ``runner.main``: a bad flag, hostfile or filter raises ``ValueError``; a job that fails (or
    cannot start) prints its one line and ends the process with its exit code.

    The console script (``cli.main``) prints every error as one line instead.
    """
    argv = sys.argv[1:] if args is None else list(args)
    try:
        code = cli.run(argv)
    except DslaunchError as err:
        if isinstance(err, ValueError):
            raise
        code = cli.report_error(err, argv)
    if code:
        sys.exit(code)


def parse_args(args: Sequence[str] | None = None) -> argparse.Namespace:
    """The launch command's flags as DeepSpeed's namespace: its defaults (``hostfile``
    ``/job/hostfile``, ``master_port`` 29500, ``venv_script`` None) and its unique prefixes of
    long flags (``--launcher_arg``; the ``dslaunch`` command wants them spelled out).

    Raises:
        UsageError: a bad flag (a ``ValueError``).
    """
    ns = build_parser(allow_abbrev=True).parse_args(args)
    ns.hostfile = ns.hostfile or DEFAULT_HOSTFILE
    if ns.master_port is None:
        ns.master_port = TORCH_DISTRIBUTED_DEFAULT_PORT
    for unsupported in ("comment", "account"):  # refused by the command when given
        setattr(ns, unsupported, getattr(ns, unsupported, None))
    return ns


def _parse_hostfile(hostfile_lines: Iterable[str]) -> OrderedDict[str, int]:
    """Hostfile lines (``readlines()`` or ``splitlines()``) -> ``{host: slots}`` in file order.

    Raises:
        HostfileError: naming the first bad line (a ``ValueError``).
    """
    return OrderedDict(parse_hostfile("\n".join(line.rstrip("\n") for line in hostfile_lines)))


def fetch_hostfile(hostfile_path: str) -> OrderedDict[str, int] | None:
    """``{host: slots}`` of the hostfile at ``hostfile_path``, or None (with a warning) where there
    is none: the job then runs on this machine only, as DeepSpeed's.

    Raises:
        HostfileError: naming the file and its first bad line, or a file that is not a regular one.
    """
    pool = read_hostfile(hostfile_path, explicit=False)
    if pool is None:
        logger.warning("no hostfile at %s: training with local resources only", hostfile_path)
        return None
    return OrderedDict(pool)


def parse_inclusion_exclusion(resource_pool: Mapping[str, int], inclusion: str,
                              exclusion: str) -> OrderedDict[str, list[int]]:
    """``{host: slots}`` (as ``fetch_hostfile`` gives) narrowed by an ``--include`` or
    ``--exclude`` expression: ``parse_resource_filter`` over every host's slots ``0..n-1``."""
    return parse_resource_filter({host: range(slots) for host, slots in resource_pool.items()}, inclusion, exclusion)


def parse_resource_filter(host_info: Mapping[str, Sequence[int]], include_str: str = "",
                          exclude_str: str = "") -> OrderedDict[str, list[int]]:
    """``{host: [slots]}`` narrowed by an ``--include`` or ``--exclude`` expression
    (``worker-0:0,2@worker-1``); everything excluded leaves ``{}``.

    Raises:
        HostfileError: both expressions, a malformed one, an unknown host or slot (a ``ValueError``).
    """
    pool = filter_pool(host_info, include_str, exclude_str)
    return OrderedDict((host, list(slots)) for host, slots in pool.items())


def encode_world_info(world_info: Mapping[str, object]) -> str:
    """``{host: slots}`` as DeepSpeed's ``--world_info`` value: URL-safe base64 of its JSON."""
    return base64.urlsafe_b64encode(json.dumps(world_info).encode()).decode()


if __name__ == "__main__":  # python -m deepspeed.launcher.runner: DeepSpeed's module entry point
    sys.exit(cli.main())
