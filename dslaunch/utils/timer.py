"""``deepspeed.utils.timer``: DeepSpeed's timer group and its timer names.

``SynchronizedWallClockTimer`` and ``NoopTimer`` are ``dslaunch.runtime.timers``'; the names are
DeepSpeed's keys for the engine's phases (Megatron-DeepSpeed imports them for its own timers);
``trim_mean`` is the comms logger's.
"""

from dslaunch.runtime.comm.comms_logging import trim_mean
from dslaunch.runtime.timers import NoopTimer, SynchronizedWallClockTimer

FORWARD_MICRO_TIMER = "fwd_microstep"
FORWARD_GLOBAL_TIMER = "fwd"
BACKWARD_MICRO_TIMER = "bwd_microstep"
BACKWARD_GLOBAL_TIMER = "bwd"
BACKWARD_INNER_MICRO_TIMER = "bwd_inner_microstep"
BACKWARD_INNER_GLOBAL_TIMER = "bwd_inner"
BACKWARD_REDUCE_MICRO_TIMER = "bwd_allreduce_microstep"
BACKWARD_REDUCE_GLOBAL_TIMER = "bwd_allreduce"
STEP_MICRO_TIMER = "step_microstep"
STEP_GLOBAL_TIMER = "step"

__all__ = ["SynchronizedWallClockTimer", "NoopTimer", "trim_mean", "FORWARD_MICRO_TIMER", "FORWARD_GLOBAL_TIMER",
           "BACKWARD_MICRO_TIMER", "BACKWARD_GLOBAL_TIMER", "BACKWARD_INNER_MICRO_TIMER",
           "BACKWARD_INNER_GLOBAL_TIMER", "BACKWARD_REDUCE_MICRO_TIMER", "BACKWARD_REDUCE_GLOBAL_TIMER",
           "STEP_MICRO_TIMER", "STEP_GLOBAL_TIMER"]
