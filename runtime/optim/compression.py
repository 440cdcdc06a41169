"""1-bit compressed all-reduce with worker and server error feedback (the 1-bit optimizers' exchange).

The algorithm of DeepSpeed's ``compressed_allreduce`` (Tang et al., "1-bit Adam", 2021), on any
backend through ``dslaunch.comm`` (two collectives per call):

1. worker: ``x += worker_error``; one scale ``||x|| / sqrt(n)``; ``worker_error = x - scale * sign(x)``;
   the signs packed 8 to a byte; the buffer is cut into one chunk per rank, chunk r to rank r
   (``all_to_all_single``), each chunk followed by the 4 bytes of the sender's scale;
2. server (rank r, its chunk): the average of the decompressed chunks of every rank, plus
   ``server_error``; compressed again (one scale per chunk), its error kept in ``server_error``;
3. every server's packed chunk and scale go to every rank (``all_gather_into_tensor``); each rank
   decompresses the whole buffer: the same result on every rank.

Per rank it sends about n/8 bytes twice, against the 8n bytes of a ring all-reduce of fp32 (2(W-1)/W
of 4n): ~32x less. ``sign(0)`` is +1. The buffer is padded to a multiple of 8 * world size.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from dslaunch import comm
from dslaunch.runtime.heartbeat import wait_all

__all__ = ["packbits", "unpackbits", "padded_numel", "compressed_all_reduce"]

_SCALE_BYTES = 4  # an fp32 scale travels as 4 bytes behind its chunk of signs


def packbits(nonneg: torch.Tensor) -> torch.Tensor:
    """Bools (``x >= 0``; numel a multiple of 8) -> uint8, first element in the high bit.

    Plain torch (8 shifted ORs over strided columns: ~2x faster here than a multiply-and-sum).
    """
    bits = nonneg.view(-1, 8).view(torch.uint8)
    packed = bits[:, 0] << 7
    for i in range(1, 8):
        packed |= bits[:, i] << (7 - i)
    return packed


@functools.cache
def _sign_table(device: torch.device) -> torch.Tensor:
    """Row b: the 8 signs (+1/-1, fp32) that byte b packs."""
    b = torch.arange(256, dtype=torch.int64).unsqueeze(1)
    bits = (b >> torch.arange(7, -1, -1)).bitwise_and_(1)
    return bits.float().mul_(2.0).sub_(1.0).to(device)


def unpackbits(packed: torch.Tensor) -> torch.Tensor:
    """uint8 -> signs as fp32 +1/-1 (8 per byte, high bit first): one table lookup per byte."""
    signs = _sign_table(packed.device)[packed.reshape(-1).long()]
    return signs.view(*packed.shape[:-1], -1)


def padded_numel(numel: int, world_size: int) -> int:
    """``numel`` rounded up so every rank's chunk is a whole number of bytes of signs."""
    unit = 8 * world_size
    return -(-numel // unit) * unit


def _compress(x: torch.Tensor, error: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Add ``error`` to ``x``, return (packed signs, scale as a 1-element tensor); the new error is
    left in ``error``. ``x`` is consumed."""
    x.add_(error)
    scale = torch.linalg.vector_norm(x).div_(x.numel() ** 0.5).reshape(1)
    nonneg = x >= 0
    # error = x - scale * sign(x) = x + scale - 2 * scale * [x >= 0]
    s = float(scale)
    torch.add(x, nonneg, alpha=-2.0 * s, out=error).add_(s)
    return packbits(nonneg), scale


def _with_scales(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """(rows, bytes) of signs and (rows,) fp32 scales -> (rows, bytes + 4) uint8."""
    return torch.cat([packed, scales.reshape(-1, 1).contiguous().view(torch.uint8)], dim=1)


def _split_scales(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return rows[:, :-_SCALE_BYTES], rows[:, -_SCALE_BYTES:].contiguous().view(torch.float32).reshape(-1)


def compressed_all_reduce(x: torch.Tensor, worker_error: torch.Tensor, server_error: torch.Tensor,
                          world_size: int, group: Any = None) -> torch.Tensor:
    """The average of ``x`` over the group, 1-bit compressed with error feedback, in place.

    Args:
        x: flat fp32, ``padded_numel`` elements; overwritten with the (approximate) average.
        worker_error: same size; this rank's compression error, updated.
        server_error: ``x.numel() // world_size``; this rank's server-side error, updated.
        world_size: the size of ``group``.

    collective: all ranks of ``group``, same sizes.
    """
    n = x.numel()
    chunk = n // world_size
    packed, scale = _compress(x, worker_error)
    send = _with_scales(packed.view(world_size, chunk // 8), scale.expand(world_size))
    recv = torch.empty_like(send)
    wait_all((comm.all_to_all_single(recv, send, group=group, async_op=True),), "1-bit all_to_all")
    signs, scales = _split_scales(recv)
    # server: average the decompressed chunks of all workers (each worker's scale times its signs)
    mine = unpackbits(signs).mul_(scales.reshape(-1, 1)).sum(dim=0).div_(world_size)
    server_packed, server_scale = _compress(mine, server_error)
    row = _with_scales(server_packed.view(1, -1), server_scale).view(-1)
    gathered = torch.empty(world_size * row.numel(), dtype=torch.uint8, device=x.device)
    wait_all((comm.all_gather_into_tensor(gathered, row, group=group, async_op=True),), "1-bit all_gather")
    signs, scales = _split_scales(gathered.view(world_size, -1))
    x.view(world_size, chunk).copy_(unpackbits(signs)).mul_(scales.reshape(-1, 1))
    return x
