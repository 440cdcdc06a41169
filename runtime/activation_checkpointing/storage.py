"""Where a checkpointed function's inputs wait for the recompute: as they are, in host memory, or
split over the model-parallel group.

``keep(t, policy)`` returns a ``Kept``; ``Kept.restore()`` gives back a tensor with the same values,
shape, dtype and device. Only floating-point tensors with at least one element per model-parallel
rank are moved or split (DeepSpeed's rule: integer ids and masks stay whole where they are).

- as they are: a reference, no copy (the default).
- ``cpu_checkpointing``: a host copy (pinned on CUDA, copied back without blocking); the original
  can then be freed by its owner. Also without a model-parallel group (DeepSpeed only moves
  partitioned activations, so without an mpu its ``cpu_checkpointing`` keeps nothing in host memory).
- ``partition_activations``: with a model-parallel group of size m (the tensor-parallel group where
  the mpu has one), each rank keeps 1/m of the flattened tensor (padded to a multiple of m) and
  ``restore`` all-gathers the pieces. The input must be the same on every rank of the group (the
  replicated activations of tensor parallelism). collective: ``restore`` on every rank of the group.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["KeepPolicy", "Kept", "keep"]


@dataclass(frozen=True)
class KeepPolicy:
    """How inputs are kept: host memory and/or a model-parallel split."""

    cpu: bool = False
    group: Any = None
    """The model-parallel group to split over; None: no split."""
    rank: int = 0
    size: int = 1

    @property
    def moves(self) -> bool:
        return self.cpu or self.size > 1


@dataclass
class Kept:
    """One kept input: ``data`` is the whole tensor, a host copy, or this rank's piece."""

    data: Any
    shape: torch.Size | None = None
    device: torch.device | None = None
    policy: KeepPolicy | None = None
    """Set when ``data`` was moved or split; None: ``data`` is the input itself."""

    def restore(self) -> Any:
        if self.policy is None:
            return self.data
        piece = self.data.to(self.device, non_blocking=True)
        if self.policy.size > 1:
            parts = [torch.empty_like(piece) for _ in range(self.policy.size)]
            dist.all_gather(parts, piece, group=self.policy.group)
            piece = torch.cat(parts)
        return piece[: self.shape.numel()].view(self.shape)

    def nbytes(self) -> int:
        """Bytes this holds (0 for a non-tensor)."""
        return self.data.numel() * self.data.element_size() if torch.is_tensor(self.data) else 0


def _movable(t: Any, policy: KeepPolicy) -> bool:
    return torch.is_tensor(t) and t.is_floating_point() and t.numel() >= policy.size


def keep(t: Any, policy: KeepPolicy) -> Kept:
    """Keep ``t`` (any value) for the recompute as ``policy`` says."""
    if not policy.moves or not _movable(t, policy):
        return Kept(t)
    flat = t.detach().reshape(-1)
    if policy.size > 1:
        per = -(-flat.numel() // policy.size)
        flat = torch.nn.functional.pad(flat, (0, per * policy.size - flat.numel()))
        flat = flat.narrow(0, policy.rank * per, per)
    if policy.cpu:
        host = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=flat.is_cuda)
        flat = host.copy_(flat, non_blocking=True)
    else:
        flat = flat.clone()  # drop the reference to the whole tensor
    return Kept(flat, t.shape, t.device, policy)
