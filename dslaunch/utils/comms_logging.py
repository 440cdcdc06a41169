"""DeepSpeed's ``deepspeed.utils.comms_logging``: the comms logger's records and summary table,
implemented in ``dslaunch.runtime.comm.comms_logging``."""

from dslaunch.runtime.comm.comms_logging import (
    CommsLogger,
    calc_bw_log,
    convert_size,
    message_size,
    trim_mean,
)

__all__ = ["CommsLogger", "convert_size", "calc_bw_log", "trim_mean", "message_size"]
