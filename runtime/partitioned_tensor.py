"""``PartitionedTensor`` (DeepSpeed's ``deepspeed.runtime.utils.PartitionedTensor``): one tensor
split flat and near-evenly over a process group, each rank keeping its piece, with ``full()`` to
put it back together and ``to_meta()``/``from_meta()`` to ship the piece and its layout.

The layout tensor is DeepSpeed's (``[ndim, *shape, num_parts, rank, *offsets]``, int64), so a meta
made by either side reads on the other. Collective: the constructor is local, ``full()`` gathers
over the group and must be called on every rank of it.
"""

from __future__ import annotations

import itertools
import math

import torch
import torch.distributed as dist

from dslaunch.runtime.pipe.module import partition_uniform

__all__ = ["PartitionedTensor"]


class PartitionedTensor:
    """``tensor`` flattened and cut by ``partition_uniform(numel, group size)``; this rank keeps
    piece ``rank`` in ``local_data``."""

    def __init__(self, tensor: torch.Tensor, group: dist.ProcessGroup | None, partition_meta: object = None):
        del partition_meta  # DeepSpeed's signature has it and never reads it
        self.group = group
        self.num_parts = dist.get_world_size(group=group)
        self.rank = dist.get_rank(group=group)
        self.orig_size = list(tensor.size())
        self.orig_device = tensor.device
        self.partition = partition_uniform(num_items=tensor.numel(), num_parts=self.num_parts)
        start, stop = self.partition[self.rank], self.partition[self.rank + 1]
        self.local_data = tensor.detach().reshape(-1)[start:stop].clone()

    @property
    def even_split(self) -> bool:
        return math.prod(self.orig_size) % self.num_parts == 0

    @classmethod
    def from_meta(cls, meta: torch.Tensor, local_part: torch.Tensor, group: dist.ProcessGroup | None,
                  device: torch.device | str | None = None) -> PartitionedTensor:
        """The piece ``local_part`` of the tensor whose layout ``meta`` (from ``to_meta()``) gives."""
        if meta.dtype != torch.long:
            raise ValueError(f"PartitionedTensor.from_meta: meta must be int64 (to_meta()'s), not {meta.dtype}")
        values = meta.tolist()
        ndim = values[0]
        shape, (num_parts, rank), offsets = values[1:1 + ndim], values[1 + ndim:3 + ndim], values[3 + ndim:]
        world, own_rank = dist.get_world_size(group=group), dist.get_rank(group=group)
        if (num_parts, rank) != (world, own_rank) or len(offsets) != num_parts + 1:
            raise ValueError(f"PartitionedTensor.from_meta: meta is piece {rank} of {num_parts}, but this is rank "
                             f"{own_rank} of a group of {world}; pass the meta this rank's piece was made with")
        part = cls.__new__(cls)
        part.group, part.num_parts, part.rank = group, num_parts, rank
        part.orig_size, part.partition = shape, offsets
        part.orig_device = torch.device(device) if device is not None else local_part.device
        part.local_data = local_part.detach()
        return part

    def full(self, device: torch.device | str | None = None) -> torch.Tensor:
        """The whole tensor, gathered from every rank's piece (collective over the group)."""
        sizes = [stop - start for start, stop in itertools.pairwise(self.partition)]
        widest = max(sizes)
        # Pad each piece to the widest so one all_gather serves even and uneven splits alike.
        padded = torch.zeros(widest * self.num_parts, dtype=self.local_data.dtype, device=self.local_data.device)
        mine = torch.zeros(widest, dtype=self.local_data.dtype, device=self.local_data.device)
        mine[:sizes[self.rank]] = self.local_data
        dist.all_gather_into_tensor(padded, mine, group=self.group)
        pieces = [padded[i * widest:i * widest + size] for i, size in enumerate(sizes)]
        whole = torch.cat(pieces).view(self.orig_size)
        return whole.to(device if device is not None else self.orig_device)

    def to_meta(self) -> torch.Tensor:
        """The layout as an int64 tensor: ``[ndim, *shape, num_parts, rank, *offsets]``."""
        meta = [len(self.orig_size), *self.orig_size, self.num_parts, self.rank, *self.partition]
        return torch.tensor(meta, dtype=torch.long, device=self.orig_device)

    def data(self) -> torch.Tensor:
        return self.local_data

    def local_size(self) -> torch.Size:
        return self.local_data.size()

    def full_size(self) -> list[int]:
        return self.orig_size
