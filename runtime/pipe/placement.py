"""Which rank holds which part of a pipelined model: the one fact the module (what a rank builds),
the schedules (where a message goes) and the engine (which rank it sends to) must agree on.

The layers are cut into ``num_parts`` contiguous parts; part ``p`` feeds part ``p + 1``. Each of
``stages`` ranks holds ``chunks`` parts, its chunk ``c`` being one of them:

- ``RoundRobin(stages, chunks)``: chunk ``c`` of rank ``s`` is part ``c * stages + s`` (1F1B with
  one chunk; interleaved virtual stages with more). The last rank feeds the first one's next chunk.
- ``VShape(stages)``: DualPipeV's two chunks, part ``s`` and part ``2 * stages - 1 - s``: the
  activations go out over the ranks and come back, so rank 0 holds the first and the last part,
  and the last rank hands its first chunk's outputs to its second chunk itself.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Placement", "RoundRobin", "VShape"]


@dataclass(frozen=True)
class Placement:
    """``stages`` ranks of ``chunks`` parts each; subclasses say which."""

    stages: int
    chunks: int = 1

    @property
    def num_parts(self) -> int:
        return self.stages * self.chunks

    def part(self, stage: int, chunk: int) -> int:
        """The part that rank ``stage`` holds as its ``chunk``."""
        raise NotImplementedError

    def owner(self, part: int) -> tuple[int, int]:
        """(rank, chunk) holding ``part``."""
        raise NotImplementedError

    def ends(self, stage: int, chunk: int) -> tuple[bool, bool]:
        """Whether this chunk is the model's first part (it loads the inputs), and its last (the loss)."""
        part = self.part(stage, chunk)
        return part == 0, part == self.num_parts - 1

    def neighbour(self, stage: int, chunk: int, step: int) -> tuple[int, int] | None:
        """(rank, chunk) of the part ``step`` (+1: the next, -1: the previous) from this chunk's;
        None past either end of the model."""
        part = self.part(stage, chunk) + step
        return self.owner(part) if 0 <= part < self.num_parts else None


@dataclass(frozen=True)
class RoundRobin(Placement):
    def part(self, stage: int, chunk: int) -> int:
        return chunk * self.stages + stage

    def owner(self, part: int) -> tuple[int, int]:
        return part % self.stages, part // self.stages


@dataclass(frozen=True)
class VShape(Placement):
    chunks: int = 2

    def part(self, stage: int, chunk: int) -> int:
        return stage if chunk == 0 else 2 * self.stages - 1 - stage

    def owner(self, part: int) -> tuple[int, int]:
        return (part, 0) if part < self.stages else (2 * self.stages - 1 - part, 1)
