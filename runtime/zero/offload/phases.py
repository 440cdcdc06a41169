"""Where an offloaded step's time goes beyond the update itself: a clock per phase, bytes moved.

An offloaded step is: the global gradient norm (``norm``: before any update, for exact clipping;
where the backward folded its sums of squares into the gradients' last write, only their sum and
reduction, ``norm_bytes`` 0), the gradients' way to the host (``grads``: the time spent waiting
for a bucket's copy, so only what the update did not hide; the first bucket's copy starts at the
end of the backward), the update of the host master (``update``: the optimizer's kernel,
the 16-bit copy fused into it where it can be), the NVMe state's reads and writes waited for
(``state``) and the updated parameters' way back to the model
(``write_back``: a separate copy where the 16-bit copy is not fused, sends to the device and the
wait for the last of them). ``PhaseClock`` is restarted by each step; ``StepPhases`` is what the
last step measured (``engine.zero.offload.phases``).

Host wall-clock times: the waits on the device are where the host stops (a copy's event, the
norm's ``item()``), so each phase is what it added to the step. No synchronisation is added.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass

__all__ = ["PHASES", "StepPhases", "PhaseClock"]

PHASES = ("norm", "grads", "update", "state", "write_back")


@dataclass(frozen=True)
class StepPhases:
    """One offloaded step: milliseconds per phase (``PHASES``) and the bytes each copy moved.

    Attributes:
        ms: phase -> milliseconds of host wall clock.
        grad_bytes: gradient bytes copied to host buffers (0 where they are on the host already).
        param_bytes: parameter bytes copied back to the model's storage outside the update's
            kernel (0 where the update wrote them in its own pass).
        norm_bytes: gradient bytes the norm read in a pass of its own (0 where the backward
            folded the norm into its writes).
    """

    ms: dict[str, float]
    grad_bytes: int = 0
    param_bytes: int = 0
    norm_bytes: int = 0

    @property
    def overhead_ms(self) -> float:
        """Everything but the update."""
        return sum(v for k, v in self.ms.items() if k != "update")


class PhaseClock:
    """Accumulates one step's phases; ``snapshot`` freezes them."""

    def __init__(self) -> None:
        self.restart()

    def restart(self) -> None:
        self._ms = dict.fromkeys(PHASES, 0.0)
        self.grad_bytes = self.param_bytes = self.norm_bytes = 0

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self._ms[name] += (time.perf_counter() - t0) * 1e3

    def snapshot(self) -> StepPhases:
        return StepPhases(dict(self._ms), self.grad_bytes, self.param_bytes, self.norm_bytes)
