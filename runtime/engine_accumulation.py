"""The engine's accumulation clock: which micro step ends an accumulation window (the boundary,
where gradients are reduced across ranks and ``step()`` updates the weights), and what moves it.

The engine counts ``gradient_accumulation_steps`` micro steps per window (``step()`` counts them),
unless the script decides each boundary itself (``set_gradient_accumulation_boundary``). Inside
``no_sync()`` backward leaves the gradients on each rank (stages 0/1). The batch-size setters start
a new window of the new size.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from dslaunch.errors import NoSyncError
from dslaunch.runtime.config import DeepSpeedConfig, with_batch

__all__ = ["EngineAccumulation"]


class EngineAccumulation:
    """Mixed into ``DeepSpeedEngine``: reads and sets its ``_config``, ``micro_steps``, ``zero``
    and the clock's state (``_boundary``, ``_sync``, ``_window_start``)."""

    _config: DeepSpeedConfig
    zero: Any
    micro_steps: int
    _boundary: bool | None
    _sync: bool
    _window_start: int

    def is_gradient_accumulation_boundary(self) -> bool:
        if self._boundary is not None:
            return self._boundary
        return (self.micro_steps - self._window_start + 1) % self._config.gradient_accumulation_steps == 0

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        """Decide the accumulation boundary yourself from now on, as DeepSpeed's (accelerate does).

        Set it before each micro step's forward/backward: False for the micro steps that only
        accumulate, True for the last one, then call ``step()`` (which steps only when it is True).
        The engine's own count (``gradient_accumulation_steps``) is no longer used.
        """
        self._boundary = bool(is_boundary)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Skip gradient reduction inside the block (stages 0/1; stages 2 and 3 raise NoSyncError).

        ``step()`` may count non-boundary micro steps inside it (DeepSpeed refuses any step there);
        a boundary ``step()`` raises NoSyncError, as does nesting (a ``UsageError`` and an
        ``AssertionError``, as DeepSpeed asserts).
        """
        if not self._sync:
            raise NoSyncError("no_sync context manager reentry is unsupported: no_sync() is already active")
        self.zero.begin_micro_step(self.is_gradient_accumulation_boundary(), sync=False)
        self._sync = False
        try:
            yield
        finally:
            self._sync = True

    def set_train_batch_size(self, train_batch_size: int) -> None:
        """Train on ``train_batch_size`` samples per optimizer step from now on, by changing the
        accumulation steps (the micro batch stays), as DeepSpeed's (Megatron-DeepSpeed's batch-size
        ramp-up calls it). Call it between optimizer steps: the next window is the new size.

        Raises:
            BatchSizeError: (a ``ValueError``, as DeepSpeed's) ``train_batch_size`` is not a multiple
                of the micro batch times the data-parallel ranks; nothing changes then.
        """
        self._use_batch(with_batch(self._config, train_batch_size=train_batch_size,
                                   train_micro_batch_size_per_gpu=self._config.train_micro_batch_size_per_gpu))

    def set_train_micro_batch_size(self, micro_batch_size: int) -> None:
        """Use ``micro_batch_size`` samples per rank per micro step from now on; the accumulation
        steps stay, so the global batch follows (as DeepSpeed's). A data loader already built
        keeps its batch size: build a new one (``deepspeed_io``).

        Raises:
            BatchSizeError: ``micro_batch_size`` is not a positive integer; nothing changes then.
        """
        self._use_batch(with_batch(self._config, train_micro_batch_size_per_gpu=micro_batch_size,
                                   gradient_accumulation_steps=self._config.gradient_accumulation_steps))

    def _use_batch(self, config: DeepSpeedConfig) -> None:
        self._config, self._window_start = config, self.micro_steps
