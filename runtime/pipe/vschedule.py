"""DualPipeV's schedule (DeepSpeed 0.19.8's ``deepspeed.runtime.pipe.schedule.DualPipeVSchedule``;
``schedule.py`` answers that name from here).

Each rank holds two parts of the model in a V (``placement.VShape``): a micro batch goes forward
through the ranks' first chunks (phase 0), turns on the last rank, comes back through their second
chunks (phase 1) and ends in the loss on rank 0; the gradients go the same way back. Running one
phase's forward next to the other phase's backward fills part of 1F1B's bubble (simulated, backward
twice a forward, at 4 ranks: idle 7 forwards of a stage against 1F1B's 9). The steps are
DeepSpeed's (DeepSeek's DualPipeV order): rank ``r`` of ``P`` first runs ``2 * (P - r - 1)``
phase-0 forwards, then forwards of both phases, then forward/backward pairs of opposite phases,
then drains the backwards. The instruction lists are DeepSpeed's, ``CommitP2P`` included (the
points where its engine starts and waits for the messages queued since the last one).

Limitations: without DualPipe's split of each backward into input- and weight-gradient passes
(DeepSpeed keeps them together too: its weight steps are empty commits), and without overlapping
one phase's computation with the other's communication inside a pair (the engine runs a pair's
two passes one after the other).
"""

from __future__ import annotations

from collections.abc import Iterator

from dslaunch.runtime.pipe.placement import Placement, VShape
from dslaunch.runtime.pipe.schedule import (
    _STEP,
    BackwardPass,
    CommitP2P,
    ForwardPass,
    LoadMicroBatch,
    PipeInstruction,
    PipeSchedule,
    RecvActivation,
    RecvGrad,
    SendActivation,
    SendGrad,
)

__all__ = ["DualPipeVSchedule"]

Cmds = list[PipeInstruction]


class DualPipeVSchedule(PipeSchedule):
    """The instructions of rank ``stage_id`` (it holds stages ``stage_id`` and ``2 * stages - 1 -
    stage_id``) for ``micro_batches`` micro batches, at least ``2 * stages``. ``forward_only``:
    ``eval_batch``'s (no backward, no gradients, no step). An instruction's ``chunk`` is its phase
    (DeepSpeed's ``phase``), its ``buffer_id`` ``phase * micro_batches + micro_batch``.

    Raises:
        ValueError: fewer than ``2 * stages`` micro batches (as DeepSpeed).
    """

    chunks_allowed = True

    def __init__(self, micro_batches: int, stages: int, stage_id: int, forward_only: bool = False):
        super().__init__(micro_batches, stages, stage_id, chunks=2)
        if micro_batches < 2 * stages:
            raise ValueError(f"DualPipeV needs at least 2 * {stages} micro-batches, got {micro_batches}")
        self.forward_only = forward_only

    @property
    def placement(self) -> Placement:
        return VShape(self.stages)

    def num_pipe_buffers(self) -> int:
        return 2 * self.micro_batches

    def steps(self) -> Iterator[Cmds]:
        v, rank = _Stream(self), self.stage_id
        down = self.stages - 1 - rank  # ranks after this one
        last = down == 0
        for _ in range(2 * down):  # fill: phase 0 only
            yield v.fwd(0)
        yield v.recv(RecvActivation, 0)
        for i in range(rank + 1):  # both phases; the last rank keeps its last phase-1 output a step
            yield (v.fwd(0, recv=False, send=False) + v.recv(RecvActivation, 0)
                   + v.fwd(1, send=not last or i < rank) + v.send(SendActivation, 0))
        for _ in range(down):
            yield v.bwd(1) + v.recv(RecvActivation, 1) + v.weight() + v.fwd(1, recv=False)
        for i in range(self.micro_batches - 2 * self.stages + rank + 1):  # steady: F0 B1, F1 B0
            if i == 0 and last:
                head = (v.fwd(0, recv=False, send=False) + v.send(SendActivation, 1) + v.bwd(1, send=False)
                        + v.send(SendActivation, 0) + v.send(SendGrad, 1))
            else:
                head = v.pair(0, 1, recv=i > 0)
            yield head + v.pair(1, 0)
        for _ in range(down):
            yield v.bwd(1) + v.pair(1, 0)
        for _ in range(rank + 1):
            yield v.bwd(1) + v.bwd(0)
        for _ in range(down):
            yield v.weight() + v.bwd(0)
        for _ in range(rank + 1):
            yield v.weight()
        yield [CommitP2P(), *([] if self.forward_only else [kind() for kind in _STEP])]


class _Stream:
    """Builds one rank's instructions: the next micro batch of each (instruction, phase) in turn,
    and no message where the neighbouring part is on no other rank."""

    def __init__(self, schedule: DualPipeVSchedule):
        self.s = schedule
        self.next: dict[tuple[type, int], int] = {}

    def _op(self, kind: type[PipeInstruction], phase: int) -> PipeInstruction:
        mb = self.next.get((kind, phase), 0)
        self.next[(kind, phase)] = mb + 1
        return kind(buffer_id=phase * self.s.micro_batches + mb, chunk=phase, micro_batch=mb)

    def _remote(self, phase: int, step: int) -> bool:
        peer = self.s.placement.neighbour(self.s.stage_id, phase, step)
        return peer is not None and peer[0] != self.s.stage_id

    def recv(self, kind: type, phase: int) -> Cmds:
        grads = kind is RecvGrad
        return [self._op(kind, phase)] if self._remote(phase, 1 if grads else -1) and not (
            grads and self.s.forward_only) else []

    def send(self, kind: type, phase: int) -> Cmds:
        grads = kind is SendGrad
        return [self._op(kind, phase)] if self._remote(phase, -1 if grads else 1) and not (
            grads and self.s.forward_only) else []

    def forward(self, phase: int) -> Cmds:
        fwd = self._op(ForwardPass, phase)
        if not self.s.placement.ends(self.s.stage_id, phase)[0]:
            return [fwd]
        return [LoadMicroBatch(buffer_id=fwd.buffer_id, chunk=phase, micro_batch=fwd.micro_batch), fwd]

    def backward(self, phase: int) -> Cmds:
        return [] if self.s.forward_only else [self._op(BackwardPass, phase)]

    def fwd(self, phase: int, recv: bool = True, send: bool = True) -> Cmds:
        return ((self.recv(RecvActivation, phase) if recv else []) + [CommitP2P()] + self.forward(phase)
                + (self.send(SendActivation, phase) if send else []))

    def bwd(self, phase: int, send: bool = True) -> Cmds:
        return (self.recv(RecvGrad, phase) + [CommitP2P()] + self.backward(phase)
                + (self.send(SendGrad, phase) if send else []))

    def pair(self, f: int, b: int, recv: bool = True) -> Cmds:
        """The forward of phase ``f`` next to the backward of phase ``b``, their messages together."""
        return ((self.recv(RecvActivation, f) if recv else []) + self.recv(RecvGrad, b) + [CommitP2P()]
                + self.forward(f) + self.backward(b) + self.send(SendActivation, f) + self.send(SendGrad, b))

    def weight(self) -> Cmds:
        """DualPipe's weight-gradient pass: kept inside the backward here, so only its commit."""
        return [] if self.s.forward_only else [CommitP2P()]
