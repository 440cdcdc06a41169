"""The degree of every parallel axis, and the one check of their product against the world.

``ParallelDims`` holds what the user chose (pipeline stages, tensor slices, sequence ranks,
expert ranks); the data-parallel degree is what the world leaves. ``problem(world)`` names the keys
that set the degrees in one line when they do not fit; the caller raises it as its own error
(``UsageError`` for a ``PipelineModule`` argument, ``ConfigError`` for a config key).

Rank order (slowest to fastest): pipe, data, sequence, tensor, as DeepSpeed and Megatron place
them (tensor slices of one layer on neighbouring ranks, then the sequence, then the replicas).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dslaunch.runtime.parallel.topology import ProcessTopology

__all__ = ["ParallelDims", "mpu_problem"]


@dataclass(frozen=True)
class ParallelDims:
    """Degrees of the axes other than data (each >= 1) and the key that set each, for messages."""

    pipe: int = 1
    tensor: int = 1
    sequence: int = 1
    expert: int = 1
    """Ranks holding different experts; they are data ranks (expert divides the data degree)."""
    keys: tuple[tuple[str, str], ...] = ()
    """(axis, the argument or config key that set it): ``(("pipe", "num_stages"),)``."""

    @property
    def replica_size(self) -> int:
        """Ranks per data-parallel index: pipe x sequence x tensor."""
        return self.pipe * self.sequence * self.tensor

    def data(self, world: int) -> int:
        """The data-parallel degree the world leaves."""
        return world // self.replica_size

    def problem(self, world: int) -> str | None:
        """Why these degrees do not fit a world of ``world`` ranks (one line), or None."""
        keys = dict(self.keys)
        named = [f"{keys.get(axis, axis)}={getattr(self, axis)}" for axis in ("pipe", "sequence", "tensor")
                 if getattr(self, axis) != 1 or axis in keys]
        if any(getattr(self, a) < 1 for a in ("pipe", "tensor", "sequence", "expert")):
            return f"{', '.join(named)}: every parallel degree must be at least 1"
        if world % self.replica_size:
            return f"{' x '.join(named)} must divide the world size {world}"
        if self.data(world) % self.expert:
            return (f"{keys.get('expert', 'expert')}={self.expert} must divide the data-parallel size "
                    f"{self.data(world)} (the world's {world} ranks / {self.replica_size} per replica)")
        return None

    def topology(self, world: int) -> ProcessTopology:
        """The ranks on the axes this job has: pipe and data always, sequence and model (tensor,
        DeepSpeed's name in checkpoint files) where their degree is above 1."""
        axes, dims = ["pipe", "data"], [self.pipe, self.data(world)]
        for axis, name in (("sequence", "sequence"), ("tensor", "model")):
            if getattr(self, axis) > 1:
                axes.append(name)
                dims.append(getattr(self, axis))
        return ProcessTopology(axes, dims)


def mpu_problem(mpu: Any, world: int) -> str | None:
    """Why a Megatron-style mpu does not tile the world (one line naming its methods), or None.

    Data x model-parallel ranks must divide the world: equal for DeepSpeed's grid (its model group
    is a whole replica); a Megatron mpu whose model size counts tensor slices only leaves the
    pipeline stages as the quotient."""
    data, model = mpu.get_data_parallel_world_size(), mpu.get_model_parallel_world_size()
    if data >= 1 and model >= 1 and world % (data * model) == 0:
        return None
    return (f"initialize(mpu=...): the mpu's get_data_parallel_world_size() {data} x "
            f"get_model_parallel_world_size() {model} = {data * model} does not divide the world of {world} ranks")
