"""The launcher's own lines by level: DeepSpeed's ``--log_level`` and ``-q/--quiet``.

What the launcher says besides its workers' output is one of: a note on the plan or the run (no
GPU, the devices used, the master address chosen, a world size's batch under elasticity, a restart
that started): ``info``; a change the user should see (a restart after a failure, hosts that left
or joined, a job stopped by a signal): ``warning``; the one line a failed launch or job ends with:
``error``, always printed. Workers' output is never filtered (as in DeepSpeed, whose levels set its
launcher's logger only). ``--quiet`` is ``--log_level error``.
"""

from __future__ import annotations

import sys

__all__ = ["LEVELS", "chosen", "shown", "say"]

LEVELS = ("debug", "info", "warning", "error", "critical")
"""DeepSpeed's choices for ``--log_level``, least severe first (default ``info``)."""


def chosen(log_level: str, quiet: bool) -> str:
    """The threshold the flags ask for: ``--quiet`` wins over ``--log_level`` (DeepSpeed's alias)."""
    return "error" if quiet else log_level


def shown(threshold: str, level: str) -> bool:
    """Whether a line of ``level`` is printed under ``--log_level threshold``."""
    return LEVELS.index(level) >= LEVELS.index(threshold)


def say(threshold: str, level: str, line: str) -> None:
    """Print ``line`` on stderr when ``level`` is shown under ``threshold``."""
    if shown(threshold, level):
        print(line, file=sys.stderr, flush=True)
