"""DeepSpeed's ``deepspeed.launcher.launch``: one node's workers, as DeepSpeed's runner starts it on
each node and as multi-node scripts call it themselves::

    python -u -m deepspeed.launcher.launch --world_info=<base64 JSON {host: [slots]}> \\
        --node_rank=1 --master_addr=10.0.0.1 --master_port=29500 train.py --deepspeed ...

DeepSpeed's flags and defaults; the node is started as ``dslaunch --no_ssh --node_rank N`` starts
it (``cli.launch``: the plan, the agent, the monitor): the same ranks, ``--local_rank``, variables
and ``CUDA_VISIBLE_DEVICES`` as DeepSpeed's launch, plus dslaunch's failure handling (a failed rank
stops the others and the exit code names it). ``--save_pid`` (DeepSpeed's runner's own pid
bookkeeping) is refused in one line; ``--log_level`` and ``--quiet`` choose which of the launcher's
own lines are printed (``launcher.log_level``), as with the ``dslaunch`` command.
"""

from __future__ import annotations

import argparse
import base64
import binascii
import json
import sys
from collections.abc import Sequence

from dslaunch.constants import TORCH_DISTRIBUTED_DEFAULT_PORT
from dslaunch.errors import DslaunchError, UsageError
from dslaunch.launcher.cli import report_error
from dslaunch.launcher.cli.launch import core_list, launch_job
from dslaunch.launcher.hostfile import MAX_SLOTS, hostname_problem
from dslaunch.launcher.log_level import LEVELS, chosen
from dslaunch.launcher.monitor.restart import RestartPolicy
from dslaunch.launcher.plan import LaunchConfig

__all__ = ["main", "parse_args", "decode_world_info"]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """DeepSpeed's ``launch.py`` command line (its flags, defaults and help)."""
    p = argparse.ArgumentParser(prog="deepspeed.launcher.launch", allow_abbrev=False,
                                description="Start this node's workers of a job given by --world_info.")
    p.add_argument("--node_rank", type=int, default=0, help="this node's index in --world_info")
    p.add_argument("--master_addr", default="127.0.0.1", help="address of node 0 (rank 0), reachable from every node")
    p.add_argument("--master_port", type=int, default=TORCH_DISTRIBUTED_DEFAULT_PORT, help="a free port on node 0")
    p.add_argument("--world_info", default="None", help="URL-safe base64 of the JSON {host: [slot, ...]}")
    p.add_argument("--module", action="store_true", help="run the script as a module (python -m)")
    p.add_argument("--no_python", action="store_true", help="run the script as a program, without python")
    p.add_argument("--no_local_rank", action="store_true", help="do not pass --local_rank to the script")
    p.add_argument("--save_pid", type=int, default=0, help="DeepSpeed's runner's pid bookkeeping (refused)")
    p.add_argument("--enable_each_rank_log", default="None", help="also write each rank's output to DIR")
    p.add_argument("--bind_cores_to_rank", action="store_true", help="split the cores among the workers")
    p.add_argument("--bind_core_list", default=None, help="cores to split, e.g. 0-3,8")
    p.add_argument("--log_level", default="info", choices=LEVELS,
                   help="the launcher's own lines shown (info: also its notes; worker output is never filtered)")
    p.add_argument("-q", "--quiet", action="store_true", help="DeepSpeed's --log_level error")
    p.add_argument("training_script")
    p.add_argument("training_script_args", nargs=argparse.REMAINDER)
    return p.parse_args(argv)


def decode_world_info(text: str) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """``--world_info``: hosts in order with their slots.

    Raises:
        UsageError: not given, not base64 of a JSON object of host -> list of slots, a bad host
            name, a slot out of range or repeated, a host without slots.
    """
    if text == "None":
        raise UsageError("--world_info is required: URL-safe base64 of the JSON {host: [slot, ...]} "
                         "(what deepspeed.launcher.runner.encode_world_info makes)")
    try:
        raw = json.loads(base64.urlsafe_b64decode(text.encode() + b"=" * (-len(text) % 4)))
    except (binascii.Error, ValueError) as exc:
        raise UsageError(f"--world_info {text[:40]!r}: not URL-safe base64 of a JSON object ({exc})"[:300]) from None
    if not isinstance(raw, dict) or not raw:
        raise UsageError(f"--world_info: expected a JSON object {{host: [slot, ...]}}, got {type(raw).__name__}")
    pool = []
    for host, slots in raw.items():
        if (problem := hostname_problem(host)) is not None:
            raise UsageError(f"--world_info: host {host[:60]!r}: {problem}")
        ok = isinstance(slots, list) and slots and all(type(s) is int and 0 <= s < MAX_SLOTS for s in slots)
        if not ok or len(set(slots)) != len(slots):
            raise UsageError(f"--world_info: host {host!r}: expected a list of distinct slots 0-{MAX_SLOTS - 1}, "
                             f"got {str(slots)[:80]}")
        pool.append((host, tuple(slots)))
    return tuple(pool)


def _config(ns: argparse.Namespace) -> LaunchConfig:
    if ns.save_pid:
        raise UsageError(f"--save_pid {ns.save_pid}: DeepSpeed's runner's pid bookkeeping is not in dslaunch's "
                         "launch; leave it out (dslaunch --save_pid writes the launcher's pid file)")
    if ns.module and ns.no_python:
        raise UsageError("--module and --no_python are mutually exclusive")
    return LaunchConfig(
        user_script=ns.training_script, user_args=tuple(ns.training_script_args), world_info=decode_world_info(
            ns.world_info), no_ssh=True, node_rank=ns.node_rank, master_addr=ns.master_addr,
        master_port=ns.master_port, master_port_given=True, module=ns.module, no_python=ns.no_python,
        no_local_rank=ns.no_local_rank, bind_cores_to_rank=ns.bind_cores_to_rank,
        bind_core_list=core_list(ns.bind_core_list or ""),
        each_rank_log=None if ns.enable_each_rank_log == "None" else ns.enable_each_rank_log,
        log_level=chosen(ns.log_level, ns.quiet))


def main(argv: Sequence[str] | None = None) -> int:
    """Start this node's workers and wait for them; returns the node's exit code (a mistake or a
    failed rank prints one line)."""
    args = sys.argv[1:] if argv is None else list(argv)
    try:
        return launch_job(_config(parse_args(args)), False, RestartPolicy(), {})
    except DslaunchError as err:
        return report_error(err, args)


if __name__ == "__main__":
    sys.exit(main())
