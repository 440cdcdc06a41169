"""The ds_config's ``comms_logger`` block (DeepSpeed: ``deepspeed.comm.config``). Torch-free.

``{"comms_logger": {"enabled": true, "verbose": false, "prof_all": true, "debug": false,
"prof_ops": ["all_reduce"]}}``: which collectives ``dslaunch.comm`` times and counts
(``dslaunch.utils.comms_logging``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dslaunch.errors import ConfigError, did_you_mean
from dslaunch.runtime.config.param_schema import boolean, describe
from dslaunch.runtime.config.sections import _opt

__all__ = ["CommsLoggerConfig", "OPS"]

#: The operations the logger can time (DeepSpeed's names; ``prof_ops`` picks among them).
OPS = ("all_reduce", "inference_all_reduce", "all_reduce_coalesced", "reduce", "broadcast", "all_gather",
       "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor", "gather", "scatter",
       "all_to_all_single", "all_to_all", "send", "recv", "isend", "irecv", "batch_isend_irecv", "barrier",
       "monitored_barrier", "broadcast_object_list", "all_gather_object")


def _ops(path: str, value: Any) -> tuple[str, ...]:
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        raise ConfigError(f"must be a list of operation names (e.g. [\"all_reduce\"]), got {describe(value)}",
                          key=path)
    for i, op in enumerate(value):
        if op not in OPS:
            raise ConfigError(f"unknown operation {op!r}{did_you_mean(op, OPS)}; valid: {', '.join(OPS)}",
                              key=f"{path}[{i}]")
    return tuple(value)


@dataclass(frozen=True)
class CommsLoggerConfig:
    """``comms_logger``: count and time collectives (off by default, free when off)."""

    enabled: bool = _opt(False, boolean, "true or false")
    verbose: bool = _opt(False, boolean, "true to print every operation as it completes (rank 0)")
    prof_all: bool = _opt(True, boolean, "true to time every operation, false for prof_ops only")
    debug: bool = _opt(False, boolean, "true to name each record after the calling function")
    prof_ops: tuple[str, ...] = _opt((), _ops, "a list of operation names, e.g. [\"all_reduce\"]")

    UNIMPLEMENTED = {}  # noqa: RUF012
