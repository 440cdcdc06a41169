"""The engine's built-in observers (``runtime/events.py``), in the order the engine adds them:

- ``WallClockBreakdown`` (``wall_clock_breakdown``): times the phases;
- ``ProgressLine`` (``steps_per_print``): rank 0 prints step, skipped, lr, loss scale, grad norm
  and, with the breakdown, each phase's mean ms per optimizer step;
- ``CheckpointProfile`` (``activation_checkpointing.profile``): rank 0 prints the time spent in
  checkpointed forwards and recomputes with the progress line;
- ``WorkMeter`` (``runtime/throughput.py``, when the heartbeat or the monitors need rates): the
  tokens and model FLOPs each step did;
- ``HeartbeatSender``: the step, loss, samples, tokens and FLOPs to the monitor (only under
  dslaunch);
- ``PreemptionCheck``: when every rank agreed on a checkpoint request, save and leave (only when
  the launcher may ask for one);
- ``MonitorEvents`` (``tensorboard``/``csv_monitor``/``wandb``/``comet``): rank 0 hands each
  step's events to the monitors (``dslaunch.runtime.monitors``), which write them on their own thread.

``build_observers`` makes the engine's set from its config, once, when the engine is built.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from dslaunch.runtime import preempt
from dslaunch.runtime.events import PHASES, Events, Observer, StepRecord
from dslaunch.runtime.monitors.monitor import MonitorMaster
from dslaunch.runtime.throughput import WorkMeter, device_peak, model_params
from dslaunch.runtime.timers import Timers
from dslaunch.utils.restart import restart_count, restart_reason

__all__ = ["WallClockBreakdown", "ProgressLine", "CheckpointProfile", "HeartbeatSender", "PreemptionCheck",
           "MonitorEvents", "BuiltObservers", "build_observers"]


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
    """The step to the monitor: ``Heartbeat.beat`` stores it (the loss is read when sent), with
    ``work``'s totals (tokens as all data-parallel ranks', like the samples) for tokens/s and MFU
    against ``peak`` (the device's FLOP/s; None: no MFU)."""

    def __init__(self, heartbeat: Any, work: WorkMeter | None = None, dp_world_size: int = 1,
                 peak: float | None = None):
        self.heartbeat, self.work, self.dp_world_size, self.peak = heartbeat, work, dp_world_size, peak
        self._basis: str | None = None

    def on_step(self, record: StepRecord) -> None:
        work = self.work
        if work is None:
            self.heartbeat.beat(record.step, record.loss, record.samples)
            return
        if work.basis != self._basis:  # once, and once more when the profiler's count arrives
            self._basis = work.basis
            self.heartbeat.set_peak(self.peak, work.basis)
        self.heartbeat.beat(record.step, record.loss, record.samples,
                            work.tokens * self.dp_world_size if work.tokens else None, work.flops or None)


class PreemptionCheck(Observer):
    """After each step, agree with every rank on a pending checkpoint request; on one, ``leave``.

    collective: every rank's engine has one (the agreement is an all-reduce).
    """

    def __init__(self, device: Any, leave: Callable[[], None]):
        self.device, self.leave = device, leave

    def on_step(self, record: StepRecord) -> None:
        if preempt.agreed(self.device):
            self.leave()


class _MeanLoss:
    """The mean of an accumulation window's losses, read only when written (on the monitors' thread,
    so the training thread never waits for the device)."""

    __slots__ = ("losses",)

    def __init__(self, losses: tuple[Any, ...]):
        self.losses = losses

    def __float__(self) -> float:
        return sum(float(loss) for loss in self.losses) / len(self.losses)


# DeepSpeed's elapsed_time_ms_* events -> the phases they sum (its backward includes the reduction)
_ELAPSED = {"forward": ("forward",), "backward": ("backward", "allreduce"), "backward_inner": ("backward",),
            "backward_allreduce": ("allreduce",), "step": ("step",)}


class _PeakRss:
    """This process's peak RSS in MiB, read when written (on the monitors' thread: it is process-wide)."""

    __slots__ = ()

    def __float__(self) -> float:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def _peak_memory_mib(device: Any) -> Any:
    """The device's peak allocated memory since the last call (CUDA), else this process's peak RSS."""
    if getattr(device, "type", None) == "cuda":
        import torch

        peak = torch.cuda.max_memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        return peak / 2**20
    return _PeakRss()


def _resume_marker(step: int, samples: int) -> str:
    """The text where a resumed curve continues: the step and samples, the launcher's restart count
    and why it restarted (a hang, a lost host, a failure: the job monitor's words)."""
    why = restart_reason()
    return f"resumed at step {step} ({samples} samples), restart {restart_count()}" + (f" ({why})" if why else "")


class MonitorEvents(Observer):
    """Rank 0: each optimizer step's events, at x = samples after the step, to ``monitor``.

    DeepSpeed's ``Train/Samples/`` names: ``train_loss`` (the mean over the accumulation window),
    ``lr`` (first param group), ``loss_scale`` (fp16) and, with ``breakdown``, ``elapsed_time_ms_``
    ``forward``/``backward``/``backward_inner``/``backward_allreduce``/``step`` (this step's ms).
    Added by dslaunch: ``grad_norm`` (where computed), ``samples_per_sec``, ``tokens_per_sec`` (when
    ``work`` counted token ids: integer inputs of 2+ dims), ``mfu`` (this rank's model FLOP/s over
    ``peak``, the device's peak FLOP/s, when both are known: see ``runtime/throughput.py``) and
    ``peak_memory_MiB``; and, when the
    run resumed from a checkpoint or is a restart, the text ``Run/resume`` at the samples it resumed
    from (a marker where the curve continues, with the launcher's reason for a restart).
    """

    def __init__(self, monitor: Any, batch_size: int, dp_world_size: int, fp16: bool, device: Any,
                 work: WorkMeter, breakdown: WallClockBreakdown | None = None, peak: float | None = None,
                 clock: Callable[[], float] = time.perf_counter):
        self.monitor, self.batch_size, self.dp_world_size = monitor, batch_size, dp_world_size
        self.fp16, self.device, self.work, self.breakdown = fp16, device, work, breakdown
        self.peak, self.clock = peak, clock
        self._last: tuple[float, int, int, float] | None = None  # (time, samples, tokens, flops) at the previous step
        self._totals: dict[str, float] = {}

    def on_step(self, record: StepRecord) -> None:
        now, x = self.clock(), record.samples
        events: list[tuple[str, Any, int]] = []
        if self._last is None:
            resumed_at = x - (self.batch_size if record.window_samples is None else record.window_samples)
            self.monitor.start_at(resumed_at)
            if resumed_at > 0 or restart_count() > 0:
                events.append(("Run/resume", _resume_marker(record.step - 1, resumed_at), resumed_at))
        if record.window_losses:
            events.append(("Train/Samples/train_loss", _MeanLoss(record.window_losses), x))
        events.append(("Train/Samples/lr", record.lr[0], x))
        if self.fp16:
            events.append(("Train/Samples/loss_scale", record.loss_scale, x))
        if self.breakdown is not None:
            ms = self._phase_ms()
            events += [(f"Train/Samples/elapsed_time_ms_{name}", sum(ms[p] for p in phases), x)
                       for name, phases in _ELAPSED.items()]
        if record.grad_norm is not None:
            events.append(("Train/Samples/grad_norm", record.grad_norm, x))
        if self._last is not None and now > self._last[0]:
            events += self._rates(now - self._last[0], x)
        events.append(("Train/Samples/peak_memory_MiB", _peak_memory_mib(self.device), x))
        self._last = (now, x, self.work.tokens, self.work.flops)
        self.monitor.write_events(events)

    def _rates(self, seconds: float, x: int) -> list[tuple[str, Any, int]]:
        """samples/s, tokens/s (all ranks': this rank's x the data-parallel size) and this rank's MFU
        since the previous step."""
        assert self._last is not None
        _, samples, tokens, flops = self._last
        events: list[tuple[str, Any, int]] = [("Train/Samples/samples_per_sec", (x - samples) / seconds, x)]
        if self.work.tokens > tokens:
            events.append(("Train/Samples/tokens_per_sec", (self.work.tokens - tokens) * self.dp_world_size / seconds,
                           x))
        if self.peak and self.work.flops > flops:
            events.append(("Train/Samples/mfu", (self.work.flops - flops) / seconds / self.peak, x))
        return events

    def _phase_ms(self) -> dict[str, float]:
        """Each phase's ms since the previous step (from the timers' never-reset totals)."""
        timers, ms = self.breakdown.timers, {}
        for phase in PHASES:
            total = timers(phase).total if phase in timers else 0.0
            ms[phase] = (total - self._totals.get(phase, 0.0)) * 1000.0
            self._totals[phase] = total
        return ms


@dataclass(frozen=True)
class BuiltObservers:
    """An engine's observers and the objects DeepSpeed's engine exposes from them."""

    events: Events
    timers: Timers | None
    """``engine.timers``: the breakdown's timers (``wall_clock_breakdown``), else None."""
    flops_profiler: Any
    """``engine.flops_profiler``: the FlopsProfiler of the profiled step, else None."""
    monitor: MonitorMaster
    """``engine.monitor``."""
    work: WorkMeter | None
    """The tokens and FLOPs meter behind tokens/s and MFU (None: neither heartbeat nor monitors)."""


def build_observers(engine: Any, config: Any, heartbeat: Any,
                    leave_on_request: Callable[[str], None]) -> BuiltObservers:
    """The built-in observers of ``engine`` (a ``DeepSpeedEngine`` being built) for ``config``.

    Order (each sees a step's events after those before it): breakdown, progress line, checkpoint
    profile, work meter, heartbeat, flops profiler, monitors, the autotuning experiment's profile,
    pre-emption check (last: it may save and leave).

    Args:
        heartbeat: the launcher's reporter (None outside dslaunch).
        leave_on_request: saves into the directory given and leaves (the launcher's checkpoint
            request; called once every rank agreed).
    """
    rank = engine.global_rank
    events = Events()
    breakdown = events.add(WallClockBreakdown()) if config.wall_clock_breakdown else None
    if config.steps_per_print:
        events.add(ProgressLine(config.steps_per_print, rank, breakdown))
        if config.activation_checkpointing.profile:
            events.add(CheckpointProfile(config.steps_per_print, rank))
    profiler = flops_profiler = profiled = None
    if config.flops_profiler.enabled:
        # Imported only when on: torch's flop formulas and dispatch-mode machinery are not free.
        from dslaunch.runtime.profiling.observer import FlopsProfilerObserver

        profiler = FlopsProfilerObserver(engine, config.flops_profiler)
        flops_profiler, profiled = profiler.profiler, profiler.step_flops
    monitor = MonitorMaster(config.monitor_config, rank=rank)
    watch = monitor.enabled and rank == 0
    work, peak = None, None
    if heartbeat is not None or watch:
        work = events.add(WorkMeter(model_params(engine.module), profiled))
        engine.module.register_forward_pre_hook(work.count_tokens, with_kwargs=True)
        peak = device_peak(engine.device, engine.precision.model_dtype)
    if heartbeat is not None:
        events.add(HeartbeatSender(heartbeat, work, engine.dp_world_size, peak))
    if profiler is not None:
        events.add(profiler)
    if watch:
        assert work is not None
        events.add(MonitorEvents(monitor, config.train_batch_size, engine.dp_world_size, config.fp16.enabled,
                                 engine.device, work, breakdown, peak))
    if config.autotuning.metric_path is not None:  # an experiment of dslaunch --autotuning
        from dslaunch.runtime.autotuning import ExperimentProfile

        events.add(ExperimentProfile(config.autotuning, rank, engine.device, engine.module, flops_profiler))
    save_dir = preempt.checkpoint_dir()  # None unless the launcher may ask for a checkpoint
    if save_dir is not None:
        events.add(PreemptionCheck(engine.device, lambda: leave_on_request(save_dir)))
    return BuiltObservers(events, breakdown.timers if breakdown is not None else None, flops_profiler, monitor,
                          work)
