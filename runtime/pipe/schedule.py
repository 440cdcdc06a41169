"""Pipeline schedules: what each stage does, in order, as a list of instructions
(DeepSpeed's ``deepspeed.runtime.pipe.schedule``: same instruction and schedule names).

A schedule is built per stage (``micro_batches``, ``stages``, ``stage_id``) and ``steps()`` yields
lists of instructions; the engine executes them one by one (``PipelineEngine._INSTRUCTION_MAP``).
Instructions carry the micro batch they act on (``buffer_id`` in DeepSpeed's names).

Correctness rests on one property, checked for every schedule by ``tests/runtime/pipe/
test_schedule.py``'s simulator: with non-blocking sends, every stage's receives are matched by its
neighbour's sends in the same order, and the stages' orders have no cycle, so no stage waits
forever. Schedules are picked by name from ``SCHEDULES`` (the config's ``pipeline.schedule``).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

__all__ = ["PipeInstruction", "LoadMicroBatch", "ForwardPass", "BackwardPass", "SendActivation", "RecvActivation",
           "SendGrad", "RecvGrad", "ReduceGrads", "ReduceTiedGrads", "OptimizerStep", "PipeSchedule",
           "TrainSchedule", "InferenceSchedule", "SCHEDULES", "schedule_choices"]


@dataclass(frozen=True)
class PipeInstruction:
    """One thing a stage does; ``buffer_id`` is the micro batch it acts on (-1: none)."""

    buffer_id: int = -1

    @property
    def name(self) -> str:
        return type(self).__name__

    def __repr__(self) -> str:
        return f"{self.name}({self.buffer_id})" if self.buffer_id >= 0 else f"{self.name}()"


class LoadMicroBatch(PipeInstruction):
    """First stage: the inputs; last stage: the labels (both read the same batch)."""


class ForwardPass(PipeInstruction):
    """Run this stage's layers on the micro batch (the last stage also computes the loss)."""


class BackwardPass(PipeInstruction):
    """Backpropagate the loss (last stage) or the received output gradients."""


class SendActivation(PipeInstruction):
    """Send the outputs to the next stage."""


class RecvActivation(PipeInstruction):
    """Receive the inputs from the previous stage."""


class SendGrad(PipeInstruction):
    """Send the gradients of the received inputs back to the previous stage."""


class RecvGrad(PipeInstruction):
    """Receive the gradients of the outputs from the next stage."""


class ReduceGrads(PipeInstruction):
    """Finish the data-parallel gradient reduction of the step (the ZeRO strategy's)."""


class ReduceTiedGrads(PipeInstruction):
    """Sum tied weights' gradients over the stages holding them."""


class OptimizerStep(PipeInstruction):
    """Clip, check overflow and update (the whole replica agrees on the norm)."""


class PipeSchedule:
    """The instructions of one stage for one batch of ``micro_batches``."""

    def __init__(self, micro_batches: int, stages: int, stage_id: int):
        if micro_batches < 1 or stages < 1 or not 0 <= stage_id < stages:
            raise ValueError(f"schedule of {micro_batches} micro batches for stage {stage_id} of {stages}")
        self.micro_batches, self.stages, self.stage_id = micro_batches, stages, stage_id
        self.is_first_stage, self.is_last_stage = stage_id == 0, stage_id == stages - 1

    def steps(self) -> Iterator[list[PipeInstruction]]:
        raise NotImplementedError

    def __iter__(self) -> Iterator[list[PipeInstruction]]:
        return self.steps()

    def num_pipe_buffers(self) -> int:
        """Micro batches whose activations this stage holds at once, at most."""
        return self.micro_batches

    def _forward(self, mb: int) -> list[PipeInstruction]:
        first = [LoadMicroBatch(mb)] if self.is_first_stage else [RecvActivation(mb)]
        if self.is_last_stage and not self.is_first_stage:
            first.append(LoadMicroBatch(mb))
        return [*first, ForwardPass(mb), *([] if self.is_last_stage else [SendActivation(mb)])]

    def _backward(self, mb: int) -> list[PipeInstruction]:
        recv = [] if self.is_last_stage else [RecvGrad(mb)]
        return [*recv, BackwardPass(mb), *([] if self.is_first_stage else [SendGrad(mb)])]


class TrainSchedule(PipeSchedule):
    """1F1B (DeepSpeed's default): ``stages - stage_id - 1`` forwards to fill the pipe, then one
    forward and one backward in turn, then the remaining backwards; then the step.

    A stage holds at most ``stages - stage_id`` micro batches' activations; the bubble is
    ``(stages - 1) / (micro_batches + stages - 1)`` of the time.
    """

    def steps(self) -> Iterator[list[PipeInstruction]]:
        warmup = min(self.stages - self.stage_id - 1, self.micro_batches)
        for mb in range(warmup):
            yield self._forward(mb)
        for i in range(self.micro_batches - warmup):
            yield self._forward(warmup + i)
            yield self._backward(i)
        for mb in range(self.micro_batches - warmup, self.micro_batches):
            yield self._backward(mb)
        yield [ReduceGrads(), ReduceTiedGrads(), OptimizerStep()]

    def num_pipe_buffers(self) -> int:
        return max(1, min(self.stages - self.stage_id, self.micro_batches))


class InferenceSchedule(PipeSchedule):
    """Forward only (``eval_batch``): every micro batch passes each stage in order."""

    def steps(self) -> Iterator[list[PipeInstruction]]:
        for mb in range(self.micro_batches):
            yield self._forward(mb)

    def num_pipe_buffers(self) -> int:
        return 1


# The config's pipeline.schedule -> the training schedule it names.
SCHEDULES: dict[str, type[PipeSchedule]] = {"1f1b": TrainSchedule}


def schedule_choices() -> str:
    return ", ".join(repr(name) for name in SCHEDULES)
