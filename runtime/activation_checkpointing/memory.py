"""``LiveBytes``: how much memory the tensors created inside a block take, now and at most.

A torch dispatch mode sees the output of every op run under it (forward and, on CPU, backward: it
runs on the calling thread). Each new tensor storage is counted from its creation until it is freed
(a finalizer on the storage); views and in-place results share a counted storage and add nothing.
Tensors that existed before (parameters, gradient buffers, optimizer state) are not counted, so on
a training step it measures activations: what the forward keeps, what the recompute makes, the
gradients being produced. Used by the activation-checkpointing benchmark and tests; slow (Python
per op), for measuring only. ``measure_step``: one training step of an engine under it.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

__all__ = ["LiveBytes", "StepBytes", "measure_step"]


class LiveBytes(TorchDispatchMode):
    """``with LiveBytes() as m: ...``; then ``m.live`` (bytes alive now) and ``m.peak``."""

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = 0
        self._seen: WeakIdKeyDictionary = WeakIdKeyDictionary()

    def _freed(self, n: int) -> None:
        self.live -= n

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func.is_view:
            return out
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                st = t.untyped_storage()
                if st not in self._seen:
                    n = st.nbytes()
                    self._seen[st] = n
                    self.live += n
                    self.peak = max(self.peak, self.live)
                    weakref.finalize(st, self._freed, n)
        return out


@dataclass(frozen=True)
class StepBytes:
    """Bytes of the tensors one step's forward + backward created: alive when the loss was
    computed, alive after backward (what outlives it: fresh gradient buffers), alive at most."""

    held_after_forward: int
    after_backward: int
    peak: int


def measure_step(engine: Any, batch: Any) -> StepBytes:
    """One forward (``engine(batch)`` returns the loss), backward and step of ``engine``; the forward
    and backward measured by ``LiveBytes`` (the optimizer step is not)."""
    tracker = LiveBytes()
    with tracker:
        loss = engine(batch)
        held = tracker.live
        engine.backward(loss)
        del loss
        kept = tracker.live
    engine.step()
    return StepBytes(held, kept, tracker.peak)
