"""DualPipeV (DeepSpeed 0.19.8's ``deepspeed.runtime.pipe.dualpipev``, DeepSeek-V3's V-shaped
pipeline): ``DualPipeVModule`` and ``DualPipeVEngine``.

``DualPipeVModule`` is a ``PipelineModule`` whose layers are cut into ``2 * num_stages`` stages,
rank ``r`` building stage ``r`` and stage ``2 * num_stages - 1 - r`` (``placement.VShape``): rank
0 holds the first and the last stage, so it reads the inputs and the labels and computes the loss,
and layers tied between the first and the last stage are one module there, with no gradient
exchange. ``initialize`` returns a ``DualPipeVEngine`` for it: the pipeline engine running
``vschedule.DualPipeVSchedule`` (training and ``eval_batch``). Everything else is the pipeline
engine's: ZeRO-1/2 on the data axis, fp16/bf16, clipping, activation checkpointing, checkpoints
(one file per layer, so they load into a ``PipelineModule`` of another shape and back).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from dslaunch.errors import UsageError
from dslaunch.runtime.pipe.checks import check_dualpipev
from dslaunch.runtime.pipe.engine import PipelineEngine
from dslaunch.runtime.pipe.module import PipelineModule
from dslaunch.runtime.pipe.placement import Placement, VShape
from dslaunch.runtime.pipe.schedule import PipeSchedule
from dslaunch.runtime.pipe.vschedule import DualPipeVSchedule

__all__ = ["DualPipeVModule", "DualPipeVEngine"]


class DualPipeVModule(PipelineModule):
    """A ``PipelineModule`` (same arguments) cut into ``2 * num_stages`` stages placed in a V.

    ``num_stages`` (or the topology's ``pipe`` axis) counts ranks, as for ``PipelineModule``; the
    partition method balances the ``2 * num_stages`` stages. ``forward(x, chunk=1)`` (or, as in
    DeepSpeed, ``activate_phase(1)`` then ``forward(x)``) runs the rank's second stage;
    ``phase_bounds`` are the two stages' layer ranges.

    Raises:
        UsageError: ``virtual_stages`` (the V decides the parts), fewer layers than ``2 * num_stages``,
            and whatever ``PipelineModule`` refuses.

    collective: construct on every rank, with the same arguments.
    """

    def __init__(self, layers: Any, *args: Any, **kwargs: Any):
        if "virtual_stages" in kwargs:
            raise UsageError("DualPipeVModule: virtual_stages does not apply (each rank holds two stages placed in "
                             "a V); remove it, or use PipelineModule(virtual_stages=...) for interleaved stages")
        super().__init__(layers, *args, virtual_stages=2, **kwargs)

    def _placement(self) -> Placement:
        return VShape(self.num_stages)

    active_phase = 0
    """DeepSpeed's: the stage ``forward`` runs without ``chunk`` (0: this rank's first, 1: its second)."""

    def activate_phase(self, phase: int) -> None:
        """DeepSpeed's: make ``forward(x)`` run this rank's stage of ``phase`` (0 or 1)."""
        if phase not in (0, 1):
            raise UsageError(f"DualPipeVModule.activate_phase: phase is 0 or 1, got {phase!r}")
        self.active_phase = phase

    @property
    def phase_bounds(self) -> list[tuple[int, int]]:
        """DeepSpeed's: the global layer range (start, stop) of this rank's stage of each phase."""
        return [(self.parts[p], self.parts[p + 1]) for p in (self.placement.part(self.stage_id, c) for c in (0, 1))]

    def forward(self, inputs: Any, chunk: int | None = None) -> Any:
        """This rank's stage of ``chunk`` (default: the active phase's) on ``inputs``."""
        return super().forward(inputs, self.active_phase if chunk is None else chunk)


class DualPipeVEngine(PipelineEngine):
    """The pipeline engine for a ``DualPipeVModule``: ``train_batch`` and ``eval_batch`` run the
    DualPipeV schedule; the loss is computed on (and reported from) stage 0.

    collective: construct, ``train_batch`` and ``eval_batch`` on all ranks.

    Raises:
        ConfigError: fewer than ``2 * stages`` ``gradient_accumulation_steps``, a ``pipeline.schedule``
            other than the default, a model that is not a ``DualPipeVModule``, and what
            ``PipelineEngine`` refuses.
    """

    def __init__(self, model: DualPipeVModule, config: Any, **kwargs: Any):
        if not isinstance(model, DualPipeVModule):
            raise UsageError(f"DualPipeVEngine runs a DualPipeVModule, not a {type(model).__name__}; build the "
                             "model with deepspeed.pipe.DualPipeVModule (or use PipelineEngine)")
        super().__init__(model, config, **kwargs)

    @staticmethod
    def _check_schedule(model: PipelineModule, config: Any) -> None:
        check_dualpipev(model, config)

    def _train_schedule(self) -> PipeSchedule:
        return DualPipeVSchedule(self.micro_batches, self.num_stages, self.stage_id)

    def _inference_schedule(self, micro_batches: int) -> PipeSchedule:
        return DualPipeVSchedule(micro_batches, self.num_stages, self.stage_id, forward_only=True)

    def eval_batch(self, data_iter: Iterator, return_logits: bool = False, compute_loss: bool = True,
                   reduce_output: str | None = "avg", bcast_loss: bool = True,
                   num_micro_batches: int | None = None) -> Any:
        """``PipelineEngine.eval_batch`` with the DualPipeV schedule: at least ``2 * stages`` micro
        batches. collective: call on all ranks."""
        micro = self.micro_batches if num_micro_batches is None else int(num_micro_batches)
        if micro < 2 * self.num_stages:  # before any stage reads data or posts a receive
            raise UsageError(f"eval_batch(num_micro_batches={micro}): DualPipeV needs at least 2 * {self.num_stages} "
                             "micro batches (twice the pipeline stages)")
        return super().eval_batch(data_iter, return_logits, compute_loss, reduce_output, bcast_loss,
                                  num_micro_batches)
