"""``dslaunch status LOGDIR``: what a running or finished job is doing, from its ``events.jsonl``.

LOGDIR is a job's directory (``<log_dir>/<job id>``) or the base ``--log_dir`` (the newest job in
it is shown); left out, the default ``--log_dir`` (``plan.default_log_dir``), from any directory. A thin click command: reading and wording live in ``launcher.monitor``. The log is
the job's (and a shared directory's other users'): lines that are no valid event are skipped and
counted, the output is bounded and control characters are escaped.
"""

from __future__ import annotations

import os
import stat

import click

from dslaunch.errors import UsageError, shorten
from dslaunch.launcher.monitor.events import EVENTS_FILE, read_events
from dslaunch.launcher.monitor.status import JobStory
from dslaunch.launcher.plan import default_log_dir

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
    except (OSError, ValueError) as err:  # ValueError: a NUL in the path
        raise UsageError(f"dslaunch status {shorten(path, 300)}: {getattr(err, 'strerror', None) or err}; "
                         "give a job's --log_dir") from None
    found = [(mtime, j) for j in jobs if os.path.isfile(j) and (mtime := _mtime(j)) is not None]
    if not found:
        raise UsageError(f"dslaunch status {shorten(path, 300)}: no {EVENTS_FILE} there nor in its "
                         f"subdirectories; give the --log_dir of a job (default {default_log_dir()})")
    return max(found)[1]


def _mtime(path: str) -> float | None:
    try:
        return os.stat(path).st_mtime
    except OSError:  # gone since the listing
        return None


def read_story(path: str) -> JobStory:
    """The story of the ``events.jsonl`` at ``path``.

    Raises:
        UsageError: it cannot be read (naming it), or holds no valid event.
    """
    story = JobStory()
    try:
        # O_NONBLOCK: a FIFO put there does not block the open; it is refused below.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        with os.fdopen(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise UsageError(f"dslaunch status: {shorten(path, 300)} is not a regular file")
            os.set_blocking(fd, True)
            for event in read_events(f):
                story.add(event)
    except OSError as err:
        raise UsageError(f"dslaunch status: cannot read {shorten(path, 300)}: {err.strerror}") from None
    if not story.events:
        raise UsageError(f"dslaunch status: {shorten(path, 300)} holds no valid event ({story.skipped} line(s) "
                         "skipped); give the --log_dir of a dslaunch job")
    return story


@click.command("status")
@click.argument("logdir", required=False)
def command(logdir: str | None) -> int:
    """Summarise a running or finished job from LOGDIR/events.jsonl (default: the newest job in the
    default --log_dir, $DSLAUNCH_LOG_DIR or $XDG_STATE_HOME/dslaunch/logs, else ~/.local/state/dslaunch/logs)."""
    path = find_events(logdir if logdir is not None else default_log_dir())
    story = read_story(path)
    click.echo(f"{shorten(os.path.dirname(path), 300)}:")
    click.echo(story.describe())
    return 0
