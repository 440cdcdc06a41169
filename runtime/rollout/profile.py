"""The timing profile of one rollout (``HybridEngineRolloutConfig(enable_profiling=True)``,
``HybridEngineRollout.get_last_profile()``): DeepSpeed 0.19.8's keys, in milliseconds.

The phases (prompt expansion, generation, post-processing) are host intervals taken after a device
synchronize. Inside generation each top-level forward of the model is timed: the first is the
prefill, the others decode steps. On a synchronized device (CPU) those are host intervals; on CUDA
they are events, so no forward waits for the device.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

__all__ = ["ForwardTimer", "PhaseClock", "forward_timer", "rollout_profile"]


class PhaseClock:
    """Host times of the phase boundaries, each after the device finished its queued work; a
    disabled clock marks nothing (and synchronizes nothing). Starts with its first mark."""

    def __init__(self, accelerator: Any, enabled: bool = True):
        self._accelerator, self.enabled = accelerator, enabled
        self.marks: list[float] = []
        self.mark()

    def mark(self) -> None:
        if self.enabled:
            self._accelerator.synchronize()
            self.marks.append(time.perf_counter())


class ForwardTimer:
    """Start and end of every top-level forward of a module (hooks added by ``forward_timer``)."""

    def __init__(self, accelerator: Any):
        self._events = None if accelerator.use_host_timers() else accelerator.Event
        self._start: Any = None
        self.spans: list[tuple[Any, Any]] = []

    def _now(self) -> Any:
        if self._events is None:
            return time.perf_counter()
        event = self._events(enable_timing=True)
        event.record()
        return event

    def started(self, *_: Any) -> None:
        self._start = self._now()

    def ended(self, *_: Any) -> None:
        self.spans.append((self._start, self._now()))

    def stages(self) -> tuple[float | None, float | None, int]:
        """(prefill ms, decode ms summed, decode forwards); (None, None, 0) without a forward.
        Read after a device synchronize (events must have completed)."""
        if not self.spans:
            return None, None, 0
        ms = [(end - start) * 1000.0 if self._events is None else start.elapsed_time(end) for start, end in self.spans]
        return ms[0], sum(ms[1:]), len(ms) - 1


@contextmanager
def forward_timer(module: torch.nn.Module, accelerator: Any) -> Iterator[ForwardTimer]:
    """A ``ForwardTimer`` on ``module`` for the ``with`` block; the hooks are removed after it."""
    timer = ForwardTimer(accelerator)
    handles = (module.register_forward_pre_hook(timer.started), module.register_forward_hook(timer.ended))
    try:
        yield timer
    finally:
        for handle in handles:
            handle.remove()


def rollout_profile(clock: PhaseClock, timer: ForwardTimer, output_ids: torch.Tensor, prompts: int,
                    samples: int, prompt_len: int) -> dict[str, Any]:
    """DeepSpeed's profile dictionary from the clock's four marks (start, prompts expanded, generated,
    batch built) and the forwards' times."""
    start, expanded, generated, done = clock.marks
    generation_ms, total_ms = (generated - expanded) * 1000.0, (done - start) * 1000.0
    prefill_ms, decode_ms, decodes = timer.stages()
    overhead_ms = generation_ms if prefill_ms is None else max(0.0, generation_ms - prefill_ms - decode_ms)
    response_len = int(output_ids.shape[1] - prompt_len)
    tokens = int(output_ids.shape[0] * response_len)
    return {
        "prompt_expansion_ms": (expanded - start) * 1000.0,
        "generation_ms": generation_ms,
        "prefill_forward_ms": prefill_ms,
        "decode_forward_ms": decode_ms,
        "generation_overhead_ms": overhead_ms,
        "num_decode_forwards": decodes,
        "post_processing_ms": (done - generated) * 1000.0,
        "total_ms": total_ms,
        "num_generated_tokens": tokens,
        "tokens_per_second": tokens / (total_ms / 1000.0) if total_ms > 0.0 else 0.0,
        "batch_size": prompts,
        "num_samples_per_prompt": samples,
        "prompt_length": prompt_len,
        "response_length": response_len,
    }
