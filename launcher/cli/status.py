"""``dslaunch status LOGDIR``: what a running or finished job is doing, from its ``events.jsonl``.

LOGDIR is a job's directory (``<log_dir>/<job id>``) or the base ``--log_dir`` (the newest job in
it is shown). A thin click command: reading and wording live in ``launcher.monitor``.
"""

from __future__ import annotations

import os

import click

from dslaunch.errors import UsageError
from dslaunch.launcher.monitor.events import EVENTS_FILE, read_events
from dslaunch.launcher.monitor.status import describe_job

__all__ = ["command", "find_events"]


def find_events(path: str) -> str:
    """The ``events.jsonl`` of the job at ``path``, or of the newest job under it.

    Raises:
        UsageError: no job there.
    """
    direct = os.path.join(path, EVENTS_FILE)
    if os.path.isfile(direct):
        return direct
    try:
        jobs = [os.path.join(path, d, EVENTS_FILE) for d in os.listdir(path)]
    except OSError as err:
        raise UsageError(f"dslaunch status {path}: {err.strerror}; give a job's --log_dir") from None
    jobs = [j for j in jobs if os.path.isfile(j)]
    if not jobs:
        raise UsageError(f"dslaunch status {path}: no {EVENTS_FILE} there nor in its subdirectories; "
                         "give the --log_dir of a job (default ./dslaunch_logs)")
    return max(jobs, key=os.path.getmtime)


@click.command("status")
@click.argument("logdir", default="dslaunch_logs")
def command(logdir: str) -> int:
    """Summarise a running or finished job from LOGDIR/events.jsonl (default: the newest job in ./dslaunch_logs)."""
    path = find_events(logdir)
    click.echo(f"{os.path.dirname(path)}:")
    click.echo(describe_job(read_events(path)))
    return 0
