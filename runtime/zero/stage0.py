"""ZeRO stage 0: plain data parallelism with a bucketed gradient all-reduce.

Every rank holds everything: the full gradient (``FullGradients``: accumulated locally, all-reduced
in buckets at the accumulation boundary, overlapping backward with ``overlap_comm``), the fp32
master weights and the optimizer state (``Replicated``). Every rank applies the same update, so
nothing is published after the step.
"""

from __future__ import annotations

from dslaunch.runtime.zero.gradients import FullGradients
from dslaunch.runtime.zero.placement import Replicated
from dslaunch.runtime.zero.strategy import ZeroStrategy

__all__ = ["Stage0"]


class Stage0(ZeroStrategy):
    """Replicated optimizer state; full gradients all-reduced at the accumulation boundary."""

    stage = 0
    placement_type = Replicated
    gradients_type = FullGradients
