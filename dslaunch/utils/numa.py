"""``deepspeed.utils.numa``: ``parse_range_list``, the core-list syntax of ``--bind_core_list``.

The launcher's parser (``launcher/cli/launch.py``) owns the syntax; this path raises DeepSpeed's
``ValueError`` for a bad list, and, as DeepSpeed, wants the parts in ascending order.
"""

from __future__ import annotations

from dslaunch.errors import UsageError
from dslaunch.launcher.cli.launch import core_list

__all__ = ["parse_range_list"]


def parse_range_list(range_str: str) -> list[int]:
    """'0,2-4,6' -> [0, 2, 3, 4, 6].

    Raises:
        ValueError: a part that is not a core or a range, an empty range, overlapping parts, or
            parts out of ascending order.
    """
    try:
        cores = list(core_list(range_str))
    except UsageError as err:
        raise ValueError(str(err)) from None
    if cores != sorted(cores):
        raise ValueError(f"core list {range_str!r}: its parts must be in ascending order")
    return cores
