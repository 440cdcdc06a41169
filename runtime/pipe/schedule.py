"""Pipeline schedules: what each stage does, in order, as lists of instructions
(DeepSpeed's ``deepspeed.runtime.pipe.schedule``: the same instruction and schedule names, and the
same time steps).

A schedule is built per stage (``micro_batches``, ``stages``, ``stage_id``) and ``steps()`` yields
one list of instructions per time step of the whole pipeline, as DeepSpeed's do: every stage yields
the same number of steps (a list is empty while the stage waits for the pipe to fill or drain), and
a message sent in step ``t`` is received in step ``t`` (a send is issued in the step after the
compute that produced it). ``TrainSchedule`` is DeepSpeed's synchronous 1F1B: ``2 * (micro_batches
+ stages - 1)`` steps, stage ``s`` runs the forward of micro batch ``m`` in step ``2m + s`` and its
backward in step ``2m + 2 * stages - 1 - s``; the last step ends with the tied-weight and
data-parallel reductions and the optimizer step. ``InferenceSchedule`` is ``micro_batches + stages -
1`` forward steps. The engine executes the lists one instruction after the other
(``PipelineEngine._INSTRUCTION_MAP``).

Instructions carry both DeepSpeed's ``buffer_id`` (the slot, ``micro_batch % num_pipe_buffers()``)
and the ``micro_batch`` itself: the engine keys its state by the micro batch and the hang report
names it (``describe``).

Correctness rests on one property, checked for every schedule by ``tests/runtime/pipe/
test_schedule.py``'s simulator: with non-blocking sends, every stage's receives are matched by its
neighbour's sends in the same order, and the stages' orders have no cycle, so no stage waits
forever; the neighbours are the schedule's ``placement``'s (``placement.py``). Training schedules are
picked by name from ``SCHEDULES`` (the config's ``pipeline.schedule``). DeepSpeed 0.19.8's
``DualPipeVSchedule`` is answered from here but lives in ``vschedule.py`` (a ``DualPipeVModule``
runs it, not the registry); ``CommitP2P``, which its lists hold, does nothing in dslaunch's engine.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from dslaunch.runtime.pipe.placement import Placement, RoundRobin

__all__ = ["CommitP2P", "PipeInstruction", "BufferOpInstruction", "LoadMicroBatch", "ForwardPass", "BackwardPass",
           "SendActivation", "RecvActivation", "SendGrad", "RecvGrad", "ReduceGrads", "ReduceTiedGrads", "OptimizerStep", "PipeSchedule",
           "TrainSchedule", "InterleavedSchedule", "InferenceSchedule", "DataParallelSchedule", "SCHEDULES",
           "schedule_choices", "execution_order"]


@dataclass(frozen=True)
class PipeInstruction:
    """One thing a stage does. ``buffer_id``: the pipeline buffer (slot) it uses, DeepSpeed's field
    (-1: none); ``chunk``: which of the rank's chunks (virtual stages; 0 without them);
    ``micro_batch``: the micro batch it acts on (defaults to ``buffer_id``, as when every micro
    batch has its own buffer: DeepSpeed's ``LoadMicroBatch(buffer_id=0)`` still builds)."""

    buffer_id: int = -1
    chunk: int = 0
    micro_batch: int = -1

    doing = "running {name}"
    """What a stage running it does, for the hang report (``{mb}``: the micro batch, ``{prev}``,
    ``{next}``: the neighbouring stages)."""

    def __post_init__(self) -> None:
        if self.micro_batch < 0:
            object.__setattr__(self, "micro_batch", self.buffer_id)  # frozen: set once, here

    @property
    def name(self) -> str:
        return type(self).__name__

    def describe(self, stage: int, stages: int, placement: Placement | None = None) -> str:
        """``stage 2 waiting to receive activations of micro-batch 5 from stage 1``; ``placement``
        says where this chunk's neighbouring parts are (default: the neighbouring stages)."""
        def peer(step: int) -> int:
            found = placement.neighbour(stage, self.chunk, step) if placement is not None else None
            return found[0] if found is not None else (stage + step) % stages

        mb = f"micro-batch {self.micro_batch}" + (f" (chunk {self.chunk})" if self.chunk else "")
        return f"stage {stage} {self.doing.format(mb=mb, name=self.name, prev=peer(-1), next=peer(1))}"

    def __repr__(self) -> str:
        if self.buffer_id < 0:
            return f"{self.name}()"
        fields = [f"buffer_id={self.buffer_id}"]
        if self.micro_batch != self.buffer_id:
            fields.append(f"micro_batch={self.micro_batch}")
        if self.chunk:
            fields.append(f"chunk={self.chunk}")
        return f"{self.name}({', '.join(fields)})"


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


class CommitP2P(PipeInstruction):
    """DeepSpeed 0.19.8's: start the sends and receives queued since the last one and wait for them
    (its DualPipeV engine queues them). dslaunch's engine sends as it goes and posts its receives
    ahead, so it does nothing here; ``execution_order`` runs the receives before it."""

    doing = "exchanging messages"


class PipeSchedule:
    """The instructions of one stage for one batch of ``micro_batches`` (``chunks`` per rank:
    virtual stages, for schedules that allow them)."""

    chunks_allowed = False

    def __init__(self, micro_batches: int, stages: int, stage_id: int, chunks: int = 1):
        if micro_batches < 1 or stages < 1 or not 0 <= stage_id < stages or chunks < 1:
            raise ValueError(f"schedule of {micro_batches} micro batches for stage {stage_id} of {stages}")
        if chunks > 1 and not self.chunks_allowed:
            raise ValueError(f"{type(self).__name__} runs one chunk per stage, not {chunks}")
        self.micro_batches, self.stages, self.stage_id, self.chunks = micro_batches, stages, stage_id, chunks

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

    @property
    def is_first_stage(self) -> bool:
        return self.stage_id == 0

    @property
    def is_last_stage(self) -> bool:
        return self.stage_id == self.stages - 1

    def steps(self) -> Iterator[list[PipeInstruction]]:
        raise NotImplementedError

    def __iter__(self) -> Iterator[list[PipeInstruction]]:
        return self.steps()

    def num_pipe_buffers(self) -> int:
        """Micro batches whose activations this stage holds at once, at most."""
        return self.micro_batches

    def _valid(self, micro_batch: int) -> bool:
        return 0 <= micro_batch < self.micro_batches

    def _op(self, kind: type[PipeInstruction], micro_batch: int, chunk: int = 0) -> PipeInstruction:
        """``kind`` on ``micro_batch``, in its buffer (the buffers are used in turn, as DeepSpeed's)."""
        return kind(buffer_id=micro_batch % self.num_pipe_buffers(), chunk=chunk, micro_batch=micro_batch)

    @property
    def placement(self) -> Placement:
        """Which parts each rank holds (where a message goes): round-robin."""
        return RoundRobin(self.stages, self.chunks)

    def _ends(self, chunk: int) -> tuple[bool, bool]:
        """Whether this rank's ``chunk`` is the model's first part, and its last."""
        return self.placement.ends(self.stage_id, chunk)


_STEP = (ReduceTiedGrads, ReduceGrads, OptimizerStep)
"""What ends a training batch, in DeepSpeed's order (the engine completes the data-parallel
reduction before it sums tied gradients, whichever comes first: ``PipelineEngine._finish_reduction``)."""


class TrainSchedule(PipeSchedule):
    """Synchronous 1F1B (DeepSpeed's default), in lockstep time steps.

    Stage ``s`` forwards micro batch ``m`` in step ``2m + s`` and runs its backward in step ``2m +
    2 * stages - 1 - s``, so forward and backward steps alternate and a stage holds at most
    ``stages - stage_id`` micro batches' activations. The outputs of a step are sent in the next
    one: a forward step starts by sending the input gradients of the previous (backward) step and
    receiving its inputs; a backward step by receiving its output gradients and sending the
    previous (forward) step's outputs. The first and last stages load the micro batch (inputs,
    labels) before its forward. The bubble is ``(stages - 1) / (micro_batches + stages - 1)`` of
    the time.
    """

    def steps(self) -> Iterator[list[PipeInstruction]]:
        total = 2 * (self.micro_batches + self.stages - 1)
        has_prev, has_next = not self.is_first_stage, not self.is_last_stage
        prev = -1  # the micro batch of the previous step (invalid: none)
        for step in range(total):
            mb, forward = self._work(step)
            now, before = self._valid(mb), self._valid(prev)
            cmds: list[PipeInstruction] = []
            if forward:
                if before and has_prev:
                    cmds.append(self._op(SendGrad, prev))
                if now and has_prev:
                    cmds.append(self._op(RecvActivation, mb))
                if now and not (has_prev and has_next):
                    cmds.append(self._op(LoadMicroBatch, mb))
            else:
                if now and has_next:
                    cmds.append(self._op(RecvGrad, mb))
                if before and has_next:
                    cmds.append(self._op(SendActivation, prev))
            if now:
                cmds.append(self._op(ForwardPass if forward else BackwardPass, mb))
            if step == total - 1:
                cmds.extend(kind() for kind in _STEP)
            prev = mb
            yield cmds

    def _work(self, step: int) -> tuple[int, bool]:
        """(micro batch, is it a forward) of ``step``; the micro batch is out of range in the
        steps where this stage is idle."""
        if (step - self.stage_id) % 2 == 0:
            return (step - self.stage_id) // 2, True
        return (step + self.stage_id + 1) // 2 - self.stages, False

    def num_pipe_buffers(self) -> int:
        return max(2, min(self.stages - self.stage_id, self.micro_batches))


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

    Unlike DeepSpeed's schedules it does not run in lockstep: each list is one pass with its
    messages (sends right after the compute), and the last list is the step. A micro batch's
    buffer is the lowest one free at its forward.
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

    def _warmup(self) -> int:
        return min(2 * (self.stages - self.stage_id - 1) + (self.chunks - 1) * self.stages,
                   self.micro_batches * self.chunks)

    def steps(self) -> Iterator[list[PipeInstruction]]:
        total, warmup = self.micro_batches * self.chunks, self._warmup()
        passes = [(True, k) for k in range(warmup)]
        for i in range(total - warmup):
            passes += [(True, warmup + i), (False, i)]
        passes += [(False, k) for k in range(total - warmup, total)]
        held: dict[tuple[int, int], int] = {}  # (micro batch, chunk) -> its buffer, forward to backward
        for forward, k in passes:
            mb, chunk = self._order(k, forward)
            if forward:
                held[(mb, chunk)] = min(set(range(len(held) + 1)) - set(held.values()))
                yield self._forward(mb, chunk, held[(mb, chunk)])
            else:
                yield self._backward(mb, chunk, held.pop((mb, chunk)))
        yield [kind() for kind in _STEP]

    def _forward(self, mb: int, chunk: int, buffer: int) -> list[PipeInstruction]:
        first, last = self._ends(chunk)
        steps = [LoadMicroBatch] if first else [RecvActivation]
        if last and not first:
            steps.append(LoadMicroBatch)
        steps += [ForwardPass, *([] if last else [SendActivation])]
        return [kind(buffer_id=buffer, chunk=chunk, micro_batch=mb) for kind in steps]

    def _backward(self, mb: int, chunk: int, buffer: int) -> list[PipeInstruction]:
        first, last = self._ends(chunk)
        steps = [*([] if last else [RecvGrad]), BackwardPass, *([] if first else [SendGrad])]
        return [kind(buffer_id=buffer, chunk=chunk, micro_batch=mb) for kind in steps]

    def num_pipe_buffers(self) -> int:
        return max(1, min(self._warmup() + 1, self.micro_batches * self.chunks))


class InferenceSchedule(PipeSchedule):
    """Forward only (``eval_batch``), in lockstep: ``micro_batches + stages - 1`` steps (with
    ``chunks``: ``stages * chunks`` virtual stages instead of ``stages``); in step ``t`` the
    virtual stage ``v`` forwards micro batch ``t - v``, and sends it in step ``t + 1``. The first
    and last stages load each micro batch first; two buffers are used in turn.

    Within a step even stages send before they receive and odd ones receive first, as in
    DeepSpeed (whose sends block); with non-blocking sends either order is deadlock-free.
    """

    chunks_allowed = True

    def steps(self) -> Iterator[list[PipeInstruction]]:
        virtual = [chunk * self.stages + self.stage_id for chunk in range(self.chunks)]
        for step in range(self.micro_batches + self.stages * self.chunks - 1):
            loads, sends, recvs, forwards = [], [], [], []
            for chunk, v in enumerate(virtual):
                mb, first, last = step - v, *self._ends(chunk)
                if self._valid(mb - 1) and not last:
                    sends.append(self._op(SendActivation, mb - 1, chunk))
                if not self._valid(mb):
                    continue
                if first or last:
                    loads.append(self._op(LoadMicroBatch, mb, chunk))
                if not first:
                    recvs.append(self._op(RecvActivation, mb, chunk))
                forwards.append(self._op(ForwardPass, mb, chunk))
            exchange = sends + recvs if self.stage_id % 2 == 0 else recvs + sends
            yield loads + exchange + forwards

    def num_pipe_buffers(self) -> int:
        return 2


class DataParallelSchedule(PipeSchedule):
    """No pipeline: load, forward and backward each micro batch in one buffer, then reduce and
    step (DeepSpeed's example of a schedule; gradient accumulation on a single stage)."""

    def steps(self) -> Iterator[list[PipeInstruction]]:
        for mb in range(self.micro_batches):
            cmds = [kind(buffer_id=0, micro_batch=mb) for kind in (LoadMicroBatch, ForwardPass, BackwardPass)]
            if mb == self.micro_batches - 1:
                cmds += [ReduceGrads(), OptimizerStep()]
            yield cmds

    def num_pipe_buffers(self) -> int:
        return 1


def execution_order(schedule: PipeSchedule) -> list[PipeInstruction]:
    """The instructions in the order the engine runs them: step by step, each send moved ahead of
    the receives (and loads) before it in its step, never ahead of a pass.

    DeepSpeed's lockstep lists issue a send in the step after the pass that computed it, after
    that step's receive (its sends block, and the stages' parity orders them); here sends never
    wait (``isend``), so a stage sends as soon as it can instead of a round trip later. Sending
    earlier cannot make any stage wait longer, and each kind of message keeps its order.
    """
    out: list[PipeInstruction] = []
    for step in schedule.steps():
        held: list[PipeInstruction] = []  # receives and loads that the sends after them overtake
        for ins in step:
            if isinstance(ins, SendActivation | SendGrad):
                out.append(ins)
            elif isinstance(ins, RecvActivation | RecvGrad | LoadMicroBatch):
                held.append(ins)
            else:
                out += [*held, ins]
                held = []
        out += held
    return out


# The config's pipeline.schedule -> the training schedule it names.
SCHEDULES: dict[str, type[PipeSchedule]] = {"1f1b": TrainSchedule, "interleaved": InterleavedSchedule}


def schedule_choices() -> str:
    return ", ".join(repr(name) for name in SCHEDULES)


def __getattr__(name: str) -> type:
    # DeepSpeed's DualPipeVSchedule lives in ``vschedule.py``, which builds on this module.
    if name == "DualPipeVSchedule":
        from dslaunch.runtime.pipe.vschedule import DualPipeVSchedule

        return DualPipeVSchedule
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
