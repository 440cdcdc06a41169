"""This rank's work so far, for the live rates: tokens seen and model FLOPs done, counted per step.

``WorkMeter`` is an observer (``runtime/events.py``) added before the ones that report rates (the
heartbeat's ``HeartbeatSender`` and the monitors' ``MonitorEvents``), which read its running
totals after each step and take differences; so one forward pre-hook counts the tokens for both.

A step's FLOPs are, in this order of preference:

- ``profiled``: the flops profiler's count (forward + backward, recomputation included) of this
  rank's profiled step, reused for every later step (the batch shape is taken to stay the same);
- ``6N*tokens``: 6 x this rank's parameters x the step's tokens (forward 2N, backward 4N per
  token: a dense transformer's usual estimate; it ignores attention's own FLOPs);
- none: no tokens seen and no profile, so no MFU.

Limitations: ``6N*tokens`` counts every parameter as a matmul weight (embeddings too), and with
pipeline stages only the first stage sees token ids; the profiled count assumes later steps do
the same work as the profiled one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from dslaunch.runtime.events import Observer, StepRecord

__all__ = ["WorkMeter", "step_flops_6n", "model_params", "device_peak", "PROFILED", "SIX_N_TOKENS"]

PROFILED = "profiled"
SIX_N_TOKENS = "6N*tokens"


class WorkMeter(Observer):
    """Running totals of this rank's training tokens and model FLOPs, advanced at each step.

    Args:
        params: this rank's parameter count (N of ``6N*tokens``).
        profiled: returns the flops profiler's count of one step on this rank once it has one
            (else None); None when the profiler is off.
    """

    def __init__(self, params: int, profiled: Callable[[], int | None] | None = None):
        self.params, self.profiled = params, profiled
        self.tokens = 0
        """Tokens in training forwards, counted at each step (this rank's)."""
        self.flops = 0.0
        """Model FLOPs of the steps so far (this rank's), by ``basis``."""
        self.basis: str | None = None
        """How the last step's FLOPs were counted: ``PROFILED``, ``SIX_N_TOKENS`` or None (not)."""
        self._pending = 0  # tokens of the step in progress, counted by the forward pre-hook
        self._reported = 0  # ... and as the script reported them (``report_tokens``), which wins

    def count_tokens(self, module: Any, args: tuple, kwargs: dict) -> None:
        """Forward pre-hook: count the tokens of a training forward (first integer input of 2+ dims)."""
        import torch

        if not (module.training and torch.is_grad_enabled()):
            return
        for value in (*args, *kwargs.values()):
            if isinstance(value, torch.Tensor) and value.dim() >= 2 and not value.is_floating_point():
                self._pending += value.numel()
                return

    def report_tokens(self, n: int) -> None:
        """The script's count of this rank's tokens in the step in progress (added up over its
        micro steps); it replaces the forward pre-hook's count for that step."""
        self._reported += n

    def on_step(self, record: StepRecord) -> None:
        tokens = self._reported or self._pending
        step_flops = self.profiled() if self.profiled is not None else None
        if step_flops:
            self.flops, self.basis = self.flops + step_flops, PROFILED
        elif tokens:
            self.flops, self.basis = self.flops + step_flops_6n(self.params, tokens), SIX_N_TOKENS
        self.tokens += tokens
        self._pending = self._reported = 0


def step_flops_6n(params: int, tokens: int) -> float:
    """Training FLOPs of ``tokens`` through a dense model of ``params``: 2N forward + 4N backward each."""
    return 6.0 * params * tokens


def model_params(module: Any) -> int:
    """This rank's model parameters, a ZeRO-3 partitioned one at its full size (``ds_numel``)."""
    return sum(getattr(p, "ds_numel", p.numel()) for p in module.parameters())


def device_peak(device: Any, dtype: Any) -> float | None:
    """The peak FLOP/s of ``device`` in ``dtype`` (``runtime.profiling.mfu.peak_flops``: a datasheet
    table for GPUs, a cached matmul measurement on CPU); None: unknown. Call it outside any timed
    step: the first CPU lookup on a machine measures for about half a second."""
    from dslaunch.runtime.profiling.mfu import peak_flops

    peak = peak_flops(device, dtype)
    return peak.flops if peak is not None else None
