"""The engine's one seam for tools that watch a run: phases and steps, sent to observers.

The engine (and any other engine that trains, e.g. a pipeline engine) announces:

- phases: ``forward``, ``backward``, ``allreduce`` (the gradient reduction after backward) and
  ``step`` (the optimizer step at an accumulation boundary), each as ``phase_begin(name)`` /
  ``phase_end(name)``;
- after each optimizer step, a ``StepRecord``: the step, samples, loss, learning rates, loss
  scale, gradient norm and whether the step was skipped.

Observers subclass ``Observer`` and override what they need; ``Events`` calls only the observers
that override a method, so an engine whose observers watch no phase pays one attribute check per
phase, and one with no step observer builds no record. The engine's own progress line, timers
(``wall_clock_breakdown``), heartbeat and pre-emption check are observers (``runtime/observers.py``);
``engine.events.add(observer)`` attaches another.

Observers run on the training thread, in the order added; one that raises stops the step (a
pre-emption leaves this way, with SystemExit).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["PHASES", "StepRecord", "Observer", "Events"]

PHASES = ("forward", "backward", "allreduce", "step")


@dataclass(frozen=True)
class StepRecord:
    """One optimizer step, as the engine saw it right after the step."""

    step: int
    """``global_steps`` after this step (skipped steps count, as DeepSpeed's)."""
    samples: int
    """``global_samples`` after this step."""
    micro_steps: int
    """Micro steps before this one (``engine.micro_steps``; the engine counts it after the record)."""
    loss: Any
    """The last micro step's loss as a detached tensor (None if backward never saw one); reading
    its value may wait for the device: observers read it only when they print or send it."""
    lr: tuple[float, ...]
    """Each param group's learning rate after the step."""
    loss_scale: float
    grad_norm: float | None
    """The unscaled global norm before clipping, where the engine computed it (else None)."""
    skipped: bool
    """An fp16 overflow skipped the update."""
    skipped_steps: int
    """Skipped steps so far."""
    window_losses: tuple[Any, ...] = ()
    """Each micro step's loss (detached) in this step's accumulation window, oldest first: their
    mean is the step's loss as DeepSpeed's monitors log it."""
    window_samples: int | None = None
    """Samples this step's window trained on (``train_batch_size``, or where the script ends each
    window, its backwards' micro batches); None: not said."""

    def loss_value(self) -> float | None:
        return float(self.loss) if self.loss is not None else None


class Observer:
    """Override any of these; the defaults do nothing (and are never called: see ``Events``)."""

    def phase_begin(self, name: str) -> None:
        """``name`` in ``PHASES`` starts."""

    def phase_end(self, name: str) -> None:
        """``name`` ended (also when it raised)."""

    def on_step(self, record: StepRecord) -> None:
        """An optimizer step was taken (or skipped)."""


class _NoPhase:
    """The context every phase gets while no observer watches phases: nothing to call."""

    __slots__ = ()

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


_NO_PHASE = _NoPhase()


class _Phase:
    __slots__ = ("observers", "name")

    def __init__(self, observers: list[Observer], name: str):
        self.observers, self.name = observers, name

    def __enter__(self) -> None:
        for o in self.observers:
            o.phase_begin(self.name)

    def __exit__(self, *exc: object) -> None:
        for o in reversed(self.observers):  # nested like the timers they drive
            o.phase_end(self.name)


def _overrides(observer: Observer, *methods: str) -> bool:
    return any(getattr(type(observer), m) is not getattr(Observer, m) for m in methods)


class Events:
    """The observers of one engine, by what they watch."""

    def __init__(self, observers: list[Observer] | None = None):
        self._phase_observers: list[Observer] = []
        self._step_observers: list[Observer] = []
        for o in observers or ():
            self.add(o)

    def add(self, observer: Observer) -> Observer:
        """Attach ``observer`` after the ones already there; returns it."""
        if _overrides(observer, "phase_begin", "phase_end"):
            self._phase_observers.append(observer)
        if _overrides(observer, "on_step"):
            self._step_observers.append(observer)
        return observer

    def remove(self, observer: Observer) -> None:
        for observers in (self._phase_observers, self._step_observers):
            if observer in observers:
                observers.remove(observer)

    def phase(self, name: str) -> Any:
        """``with events.phase("forward"): ...``"""
        return _Phase(self._phase_observers, name) if self._phase_observers else _NO_PHASE

    def step(self, record: Callable[[], StepRecord]) -> None:
        """Send the step to the step observers; ``record`` is called only if there is one."""
        if self._step_observers:
            made = record()
            for o in self._step_observers:
                o.on_step(made)
