"""The engine's accumulation clock: which micro step ends an accumulation window (the boundary,
where gradients are reduced across ranks and ``step()`` updates the weights), and what moves it.

The engine counts ``gradient_accumulation_steps`` micro steps per window (``step()`` counts them),
unless the script decides each boundary itself (``set_gradient_accumulation_boundary``), or, with
``managed_gradient_accumulation: false`` (DeepSpeed 0.19's key), every ``step()`` is a boundary
however many backwards came before it: no backward knows it is the window's last, so the gradients
the backwards left on the rank (stages 0/1; stages 2/3 reduce every micro step anyway) are reduced
by that ``step()``, in one pass, to the same bits as the boundary backward's reduction with
``gradient_accumulation_steps`` of them. ``gradient_accumulation_steps`` then still divides each
loss and sizes ``train_batch_size``, as DeepSpeed's.

Inside ``no_sync()`` backward leaves the gradients on each rank (stages 0/1); inside
``coalesce_grad_reduction()`` too, at every stage, and its end reduces their sum once; with
``enable_backward_allreduce = False`` (DeepSpeed's attribute, what external micro-batch schedulers
set) too, until the script calls ``allreduce_gradients()``. The batch-size setters start a new
window of the new size.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from dslaunch.errors import AccumulationBoundaryError, NoSyncError, NotInDslaunchError
from dslaunch.runtime.config import DeepSpeedConfig, with_batch

__all__ = ["EngineAccumulation", "MEMORY_OPT_ALLREDUCE_SIZE"]

MEMORY_OPT_ALLREDUCE_SIZE = 500_000_000  # DeepSpeed's default bucket for allreduce_gradients (elements)


class EngineAccumulation:
    """Mixed into ``DeepSpeedEngine``: reads its ``_config``, ``micro_steps`` and ``zero``; owns the
    clock's state (``_init_accumulation``)."""

    _config: DeepSpeedConfig
    zero: Any
    micro_steps: int
    pipeline_parallelism = False  # DeepSpeed's attribute (the pipeline engine's is True)

    def _init_accumulation(self) -> None:
        self._sync = True  # False inside no_sync()
        self._coalescing = False  # inside coalesce_grad_reduction()
        self._backward_allreduce = True  # enable_backward_allreduce
        # set_gradient_accumulation_boundary's override (None: the engine counts); DeepSpeed's name,
        # which scripts and its tests read
        self._is_gradient_accumulation_boundary: bool | None = None
        self._window_start = 0  # the micro step the accumulation windows count from (set_train_batch_size)
        self._stepping = False  # inside step(): the boundary where the script owns it
        self._window_backwards = 0  # backwards since the last step (global_samples where the script owns it)
        self._step_samples = 0  # the last boundary step's window's samples (its StepRecord)

    def managed_gradient_accumulation(self) -> bool:
        """The config's ``managed_gradient_accumulation``: True when the engine counts the micro steps
        of a window; False when every ``step()`` is a boundary."""
        return self._config.managed_gradient_accumulation

    def is_gradient_accumulation_boundary(self) -> bool:
        """Whether the current micro step ends an accumulation window; with
        ``managed_gradient_accumulation: false`` True only while ``step()`` runs (as DeepSpeed's)."""
        if not self._config.managed_gradient_accumulation:
            return self._stepping
        if self._is_gradient_accumulation_boundary is not None:
            return self._is_gradient_accumulation_boundary
        return (self.micro_steps - self._window_start + 1) % self._config.gradient_accumulation_steps == 0

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        """Decide the accumulation boundary yourself from now on, as DeepSpeed's (accelerate does).

        Set it before each micro step's forward/backward: False for the micro steps that only
        accumulate, True for the last one, then call ``step()`` (which steps only when it is True).
        The engine's own count (``gradient_accumulation_steps``) is no longer used.

        Raises:
            AccumulationBoundaryError: (an ``AssertionError``, as DeepSpeed's) with
                ``managed_gradient_accumulation: false``, where every ``step()`` is the boundary.
        """
        if not self._config.managed_gradient_accumulation:
            raise AccumulationBoundaryError(
                "set_gradient_accumulation_boundary() is not supported with managed_gradient_accumulation false: "
                "every step() is the accumulation boundary there; call step() after the window's last backward")
        self._is_gradient_accumulation_boundary = bool(is_boundary)

    @property
    def enable_backward_allreduce(self) -> bool:
        """Whether ``backward()`` reduces the gradients across ranks (DeepSpeed's attribute, default
        True). Set it False to drive the reduction yourself: from then on, at every ZeRO stage, each
        backward leaves its gradients on this rank, summed there, until ``allreduce_gradients()``
        reduces that sum (collective) as the boundary backward would have; ``step()`` at a boundary
        with gradients not yet reduced raises ``UsageError`` rather than letting ranks diverge.
        Setting it True again ends the holding at the next ``allreduce_gradients()`` or ``step()``.

        Raises:
            NotInDslaunchError: set False under pipeline parallelism (``train_batch()`` schedules
                its own reductions; DeepSpeed's pipeline engine keeps it False for that reason).
        """
        return self._backward_allreduce

    @enable_backward_allreduce.setter
    def enable_backward_allreduce(self, enabled: bool) -> None:
        if not enabled and self.pipeline_parallelism:
            raise NotInDslaunchError("enable_backward_allreduce = False under pipeline parallelism: train_batch() "
                                     "reduces the gradients at the end of its micro batches itself")
        if not enabled and self._backward_allreduce:
            self.zero.hold_reductions()
        self._backward_allreduce = bool(enabled)

    def allreduce_gradients(self, bucket_size: int = MEMORY_OPT_ALLREDUCE_SIZE) -> None:
        """Reduce across ranks the gradients the backwards since the last reduction left on this
        rank (``enable_backward_allreduce = False``), as DeepSpeed's; nothing to do after a
        ``backward()`` that reduced already. ``bucket_size`` is accepted for DeepSpeed's signature:
        the buckets are the config's (``reduce_bucket_size``).

        collective: all ranks."""
        del bucket_size
        self._end_window(reduce=True)

    def _end_window(self, reduce: bool) -> None:
        """End a window of held gradients (reducing them unless ``reduce`` is False); hold again
        where the script turned ``enable_backward_allreduce`` off."""
        self.zero.end_window(reduce=reduce)
        if not self._backward_allreduce:
            self.zero.hold_reductions()

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Skip gradient reduction inside the block (stages 0/1; stages 2 and 3 raise NoSyncError).

        ``step()`` may count non-boundary micro steps inside it (DeepSpeed refuses any step there);
        a boundary ``step()`` raises NoSyncError, as does nesting, also in
        ``coalesce_grad_reduction()`` (a ``UsageError`` and an ``AssertionError``, as DeepSpeed asserts).
        """
        if not self._sync or self._coalescing:
            raise NoSyncError("no_sync context manager reentry is unsupported: no_sync() or "
                              "coalesce_grad_reduction() is already active")
        self.zero.begin_micro_step(self.is_gradient_accumulation_boundary(), sync=False)
        self._sync = False
        try:
            yield
        finally:
            self._sync = True

    @contextlib.contextmanager
    def coalesce_grad_reduction(self) -> Iterator[None]:
        """Reduce the gradients of every backward inside the block once, when it ends (DeepSpeed 0.19's).

        Each ``backward()`` (or a script's ``loss.backward()``) inside leaves its gradients on this
        rank, summed there (``safe_get_full_grad`` reads this rank's sum); the end of the block
        reduces that sum across ranks in one pass, as the boundary micro step's backward would.
        Then call ``step()``, which updates where the micro step is a boundary (as always:
        ``gradient_accumulation_steps`` 1, or ``set_gradient_accumulation_boundary(True)``). One
        block per optimizer step; a block that raises drops the window's gradients (it starts no
        reduction: the peers may not have got there). At stages 0 and 1 that is the accumulation
        they always do; at stages 2 and 3 it replaces a reduction per backward by one (each rank's
        sum, in the parameters' dtype as DeepSpeed's, is reduced: equal to stage 1's accumulation,
        and to stage 2's own up to rounding). Unlike DeepSpeed, ZeRO stage 0 and fp16/bf16 at every
        stage are supported.

        collective: all ranks (the block's end reduces).

        Raises:
            AccumulationBoundaryError: with ``managed_gradient_accumulation: false`` (every
                ``step()`` reduces already); an ``AssertionError``, as DeepSpeed's.
            NoSyncError: nested in ``no_sync()`` or in itself, or ``step()`` inside the block.
            NotInDslaunchError: (a ``NotImplementedError``, as DeepSpeed's) under pipeline
                parallelism, or with ``layout_invariant`` (the fixed tree adds the ranks' micro
                steps one by one).
        """
        if not self._config.managed_gradient_accumulation:
            raise AccumulationBoundaryError(
                "coalesce_grad_reduction is not supported with managed_gradient_accumulation false: the script "
                "owns the accumulation boundary there already, and every step() reduces what its backwards left")
        if self.pipeline_parallelism:
            raise NotInDslaunchError("coalesce_grad_reduction is not supported under pipeline parallelism: "
                                     "train_batch() runs the micro batches and reduces at their end itself")
        if self._config.layout_invariant.enabled:
            raise NotInDslaunchError("coalesce_grad_reduction is not supported with layout_invariant: its fixed "
                                     "tree adds each micro step's reduced gradient, not a rank's sum of them")
        if not self._sync or self._coalescing:
            raise NoSyncError("coalesce_grad_reduction cannot be nested inside another no_sync context "
                              "(no_sync() or coalesce_grad_reduction() is already active)")
        self.zero.hold_reductions()
        self._coalescing = True
        ended = False
        try:
            yield
            ended = True
        finally:
            self._coalescing = False
            self._end_window(reduce=ended)
            if not ended:  # raised, maybe on this rank only: no collective its peers may never join
                self.zero.zero_grad()

    @contextlib.contextmanager
    def _step_window(self) -> Iterator[bool]:
        """``step()``'s clock: yields whether this micro step is a boundary (where the script owns
        the boundary, after reducing what the window's backwards left on the rank).

        Raises:
            NoSyncError: inside ``coalesce_grad_reduction()``, or at a boundary inside ``no_sync()``
                (the gradients are not reduced across ranks, so the ranks would diverge; DeepSpeed
                asserts on any step there).
        """
        if self._coalescing:
            raise NoSyncError("It is illegal to call Engine.step() inside no_sync context manager: "
                              "coalesce_grad_reduction() reduces the block's gradients when it ends; "
                              "call step() after the with-block")
        self._stepping = True
        try:
            boundary = self.is_gradient_accumulation_boundary()
            if boundary and not self._sync:
                raise NoSyncError("It is illegal to call Engine.step() inside no_sync context manager at a "
                                  "gradient accumulation boundary: the gradients are not reduced across "
                                  "ranks, so the ranks would diverge; leave no_sync() before the boundary "
                                  "micro step")
            if not self._config.managed_gradient_accumulation:
                self._end_window(reduce=True)
            yield boundary
        finally:
            self._stepping = False

    def _window_samples(self) -> int:
        """Samples the window that this boundary step ends trained on: ``train_batch_size``, or where
        the script owns the boundary, a micro batch on every data-parallel rank per backward (as
        DeepSpeed's, which counts only ``engine.backward``; dslaunch counts ``loss.backward()`` too)."""
        backwards, self._window_backwards = self._window_backwards, 0
        self._step_samples = self._config.train_batch_size
        if not self._config.managed_gradient_accumulation:
            self._step_samples = self._config.train_batch_size // self._config.gradient_accumulation_steps * backwards
        return self._step_samples

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
