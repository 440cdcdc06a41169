"""The engine's built-in observers (``runtime/events.py``), in the order the engine adds them:

- ``WallClockBreakdown`` (``wall_clock_breakdown``): times the phases;
- ``ProgressLine`` (``steps_per_print``): rank 0 prints step, skipped, lr, loss scale, grad norm
  and, with the breakdown, each phase's mean ms per optimizer step;
- ``CheckpointProfile`` (``activation_checkpointing.profile``): rank 0 prints the time spent in
  checkpointed forwards and recomputes with the progress line;
- ``HeartbeatSender``: the step, loss and samples to the monitor (only under dslaunch);
- ``PreemptionCheck``: when every rank agreed on a checkpoint request, save and leave (only when
  the launcher may ask for one).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from dslaunch.runtime import preempt
from dslaunch.runtime.events import PHASES, Observer, StepRecord
from dslaunch.runtime.timers import Timers

__all__ = ["WallClockBreakdown", "ProgressLine", "CheckpointProfile", "HeartbeatSender", "PreemptionCheck"]


class WallClockBreakdown(Observer):
    """Each phase's time (``timers.Timers``: synchronises CUDA around the timed code when in use)."""

    def __init__(self) -> None:
        self.timers = Timers()

    def phase_begin(self, name: str) -> None:
        self.timers.start(name)

    def phase_end(self, name: str) -> None:
        self.timers.stop(name)

    def log(self) -> None:
        """Print each phase's mean ms per optimizer step since the last log, then reset them.

        The "step" timer runs once per optimizer step (skipped fp16 steps included), so its
        interval count is the number of steps timed; unlike ``steps_per_print`` it stays right
        for the first report after resuming at a global step that is not a multiple of it.
        """
        steps = self.timers("step").count if "step" in self.timers else 0
        self.timers.log(list(PHASES), normalizer=max(1, steps))


class ProgressLine(Observer):
    """Every ``every`` steps, rank 0 prints DeepSpeed's progress line (and the breakdown's times)."""

    def __init__(self, every: int, rank: int, breakdown: WallClockBreakdown | None = None):
        self.every, self.rank, self.breakdown = every, rank, breakdown

    def on_step(self, record: StepRecord) -> None:
        if record.step % self.every or self.rank != 0:
            return
        norm = f"{record.grad_norm:.4g}" if record.grad_norm is not None else "n/a"
        print(f"[dslaunch] step={record.step} skipped={record.skipped_steps} "
              f"lr={[round(x, 8) for x in record.lr]} loss_scale={record.loss_scale:g} "
              f"grad_norm={norm}", flush=True)
        if self.breakdown is not None:
            self.breakdown.log()


class CheckpointProfile(Observer):
    """Every ``every`` steps, rank 0 prints ``deepspeed.checkpointing``'s time since the last print."""

    def __init__(self, every: int, rank: int):
        self.every, self.rank = every, rank

    def on_step(self, record: StepRecord) -> None:
        from dslaunch.runtime.activation_checkpointing import checkpointing

        if record.step % self.every:
            return
        t = checkpointing.profile_totals()
        if self.rank == 0:
            print(f"[dslaunch] step={record.step} activation checkpointing: {t.forwards} forwards "
                  f"{t.forward_s * 1e3:.1f} ms, {t.recomputes} recomputes {t.recompute_s * 1e3:.1f} ms",
                  flush=True)
        checkpointing.reset()


class HeartbeatSender(Observer):
    """The step to the monitor: ``Heartbeat.beat`` stores it (the loss is read when sent)."""

    def __init__(self, heartbeat: Any):
        self.heartbeat = heartbeat

    def on_step(self, record: StepRecord) -> None:
        self.heartbeat.beat(record.step, record.loss, record.samples)


class PreemptionCheck(Observer):
    """After each step, agree with every rank on a pending checkpoint request; on one, ``leave``.

    collective: every rank's engine has one (the agreement is an all-reduce).
    """

    def __init__(self, device: Any, leave: Callable[[], None]):
        self.device, self.leave = device, leave

    def on_step(self, record: StepRecord) -> None:
        if preempt.agreed(self.device):
            self.leave()
