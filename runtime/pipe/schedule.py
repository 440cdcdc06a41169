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

__all__ = ["PipeInstruction", "BufferOpInstruction", "LoadMicroBatch", "ForwardPass", "BackwardPass",
           "SendActivation", "RecvActivation", "SendGrad", "RecvGrad", "ReduceGrads", "ReduceTiedGrads", "OptimizerStep", "PipeSchedule",
           "TrainSchedule", "InterleavedSchedule", "InferenceSchedule", "SCHEDULES", "schedule_choices"]


@dataclass(frozen=True)
class PipeInstruction:
    """One thing a stage does; ``buffer_id`` is the micro batch it acts on (-1: none), ``chunk``
    which of the rank's chunks (virtual stages; 0 without them)."""

    buffer_id: int = -1
    chunk: int = 0

    doing = "running {name}"
    """What a stage running it does, for the hang report (``{mb}``: the micro batch, ``{prev}``,
    ``{next}``: the neighbouring stages)."""

    @property
    def name(self) -> str:
        return type(self).__name__

    def describe(self, stage: int, stages: int) -> str:
        """``stage 2 waiting to receive activations of micro-batch 5 from stage 1``."""
        mb = f"micro-batch {self.buffer_id}" + (f" (chunk {self.chunk})" if self.chunk else "")
        what = self.doing.format(mb=mb, name=self.name, prev=(stage - 1) % stages, next=(stage + 1) % stages)
        return f"stage {stage} {what}"

    def __repr__(self) -> str:
        where = f", chunk={self.chunk}" if self.chunk else ""
        return f"{self.name}({self.buffer_id}{where})" if self.buffer_id >= 0 else f"{self.name}()"


class BufferOpInstruction(PipeInstruction):
    """An instruction on one micro batch (DeepSpeed's base class of those that carry a ``buffer_id``)."""


class LoadMicroBatch(BufferOpInstruction):
    """First stage: the inputs; last stage: the labels (both read the same batch)."""

    doing = "loading {mb}"


class ForwardPass(BufferOpInstruction):
    """Run this stage's layers on the micro batch (the last stage also computes the loss)."""

    doing = "in the forward pass of {mb}"


class BackwardPass(BufferOpInstruction):
    """Backpropagate the loss (last stage) or the received output gradients."""

    doing = "in the backward pass of {mb}"


class SendActivation(BufferOpInstruction):
    """Send the outputs to the next stage."""

    doing = "sending the activations of {mb} to stage {next}"


class RecvActivation(BufferOpInstruction):
    """Receive the inputs from the previous stage."""

    doing = "waiting to receive activations of {mb} from stage {prev}"


class SendGrad(BufferOpInstruction):
    """Send the gradients of the received inputs back to the previous stage."""

    doing = "sending the input gradients of {mb} to stage {prev}"


class RecvGrad(BufferOpInstruction):
    """Receive the gradients of the outputs from the next stage."""

    doing = "waiting to receive gradients of {mb} from stage {next}"


class ReduceGrads(PipeInstruction):
    """Finish the data-parallel gradient reduction of the step (the ZeRO strategy's)."""

    doing = "reducing gradients over the data-parallel replicas"


class ReduceTiedGrads(PipeInstruction):
    """Sum tied weights' gradients over the stages holding them."""

    doing = "summing tied weights' gradients over the stages holding them"


class OptimizerStep(PipeInstruction):
    """Clip, check overflow and update (the whole replica agrees on the norm)."""

    doing = "in the optimizer step (first waiting until its sends were received)"


class PipeSchedule:
    """The instructions of one stage for one batch of ``micro_batches`` (``chunks`` per rank:
    virtual stages, for schedules that interleave them)."""

    chunks_allowed = False

    def __init__(self, micro_batches: int, stages: int, stage_id: int, chunks: int = 1):
        if micro_batches < 1 or stages < 1 or not 0 <= stage_id < stages or chunks < 1:
            raise ValueError(f"schedule of {micro_batches} micro batches for stage {stage_id} of {stages}")
        self.micro_batches, self.stages, self.stage_id, self.chunks = micro_batches, stages, stage_id, chunks
        self.is_first_stage, self.is_last_stage = stage_id == 0, stage_id == stages - 1

    # DeepSpeed's names for the same facts (its schedules expose them as properties)
    @property
    def stage(self) -> int:
        return self.stage_id

    @property
    def num_stages(self) -> int:
        return self.stages

    @property
    def num_micro_batches(self) -> int:
        return self.micro_batches

    def steps(self) -> Iterator[list[PipeInstruction]]:
        raise NotImplementedError

    def __iter__(self) -> Iterator[list[PipeInstruction]]:
        return self.steps()

    def num_pipe_buffers(self) -> int:
        """Micro batches whose activations this stage holds at once, at most."""
        return self.micro_batches

    def _ends(self, chunk: int) -> tuple[bool, bool]:
        """Whether this rank's ``chunk`` is the model's first part, and its last."""
        return (self.is_first_stage and chunk == 0,
                self.is_last_stage and chunk == self.chunks - 1)

    def _forward(self, mb: int, chunk: int = 0) -> list[PipeInstruction]:
        first, last = self._ends(chunk)
        steps = [LoadMicroBatch(mb, chunk)] if first else [RecvActivation(mb, chunk)]
        if last and not first:
            steps.append(LoadMicroBatch(mb, chunk))
        return [*steps, ForwardPass(mb, chunk), *([] if last else [SendActivation(mb, chunk)])]

    def _backward(self, mb: int, chunk: int = 0) -> list[PipeInstruction]:
        first, last = self._ends(chunk)
        recv = [] if last else [RecvGrad(mb, chunk)]
        return [*recv, BackwardPass(mb, chunk), *([] if first else [SendGrad(mb, chunk)])]


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


class InterleavedSchedule(PipeSchedule):
    """Interleaved 1F1B (Narayanan et al. 2021, Megatron-LM's): each rank holds ``chunks`` model
    parts (``PipelineModule(virtual_stages=...)``), so a micro batch crosses the ranks ``chunks``
    times in smaller steps and the fill and drain take ``chunks`` times less: the bubble is
    ``(stages - 1) / (chunks * micro_batches + stages - 1)`` of the time, against 1F1B's
    ``(stages - 1) / (micro_batches + stages - 1)``. Not in DeepSpeed.

    Forwards go through the chunks in groups of ``stages`` micro batches (chunk 0 for micro
    batches 0..stages-1, then chunk 1 for them, ...), backwards in the same groups from the last
    chunk; a rank first runs ``2 * (stages - stage_id - 1) + (chunks - 1) * stages`` forwards,
    then one forward and one backward in turn. ``micro_batches`` must be a multiple of ``stages``.
    Costs more activation memory and ``chunks`` times more messages than 1F1B.
    """

    chunks_allowed = True

    def __init__(self, micro_batches: int, stages: int, stage_id: int, chunks: int = 1):
        super().__init__(micro_batches, stages, stage_id, chunks)
        if micro_batches % stages:
            raise ValueError(f"interleaved schedule: {micro_batches} micro batches is not a multiple of "
                             f"{stages} stages")

    def _order(self, k: int, forward: bool) -> tuple[int, int]:
        """(micro batch, chunk) of this rank's k-th forward (or backward)."""
        group = self.stages * self.chunks
        chunk = (k // self.stages) % self.chunks
        return (k // group) * self.stages + k % self.stages, chunk if forward else self.chunks - 1 - chunk

    def steps(self) -> Iterator[list[PipeInstruction]]:
        total = self.micro_batches * self.chunks
        warmup = min(2 * (self.stages - self.stage_id - 1) + (self.chunks - 1) * self.stages, total)
        for k in range(warmup):
            yield self._forward(*self._order(k, True))
        for i in range(total - warmup):
            yield self._forward(*self._order(warmup + i, True))
            yield self._backward(*self._order(i, False))
        for k in range(total - warmup, total):
            yield self._backward(*self._order(k, False))
        yield [ReduceGrads(), ReduceTiedGrads(), OptimizerStep()]

    def num_pipe_buffers(self) -> int:
        total = self.micro_batches * self.chunks
        return max(1, min(2 * (self.stages - self.stage_id - 1) + (self.chunks - 1) * self.stages + 1, total))


class InferenceSchedule(PipeSchedule):
    """Forward only (``eval_batch``): every micro batch passes each stage (and chunk) in order."""

    chunks_allowed = True

    def steps(self) -> Iterator[list[PipeInstruction]]:
        for mb in range(self.micro_batches):
            for chunk in range(self.chunks):
                yield self._forward(mb, chunk)

    def num_pipe_buffers(self) -> int:
        return 1


# The config's pipeline.schedule -> the training schedule it names.
SCHEDULES: dict[str, type[PipeSchedule]] = {"1f1b": TrainSchedule, "interleaved": InterleavedSchedule}


def schedule_choices() -> str:
    return ", ".join(repr(name) for name in SCHEDULES)
