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

from typing import Any

import torch

from dslaunch import kernels
from dslaunch.kernels.reference import SCALE_BYTES
from dslaunch.runtime.comm import comm
from dslaunch.runtime.heartbeat import wait_all

__all__ = ["padded_numel", "compressed_all_reduce"]

def padded_numel(numel: int, world_size: int) -> int:
    """``numel`` rounded up so every rank's chunk is a whole number of bytes of signs."""
    unit = 8 * world_size
    return -(-numel // unit) * unit


def _error_fed_scale(x: torch.Tensor, error: torch.Tensor, fed: bool = False) -> float:
    """``x += error`` (unless ``fed``: done already); the scale ``||x|| / sqrt(n)`` (torch's norm: the
    same on every path)."""
    if not fed:
        x.add_(error)
    return float(torch.linalg.vector_norm(x).div_(x.numel() ** 0.5))


def compressed_all_reduce(x: torch.Tensor, worker_error: torch.Tensor, server_error: torch.Tensor,
                          world_size: int, group: Any = None, error_fed: bool = False) -> torch.Tensor:
    """The average of ``x`` over the group, 1-bit compressed with error feedback, in place.

    Args:
        x: flat fp32, ``padded_numel`` elements; overwritten with the (approximate) average.
        worker_error: same size; this rank's compression error, updated.
        server_error: ``x.numel() // world_size``; this rank's server-side error, updated.
        world_size: the size of ``group``.
        error_fed: ``x`` already holds ``x + worker_error`` (a caller that adds it in the pass that
            makes ``x``, on cache-sized pieces).

    collective: all ranks of ``group``, same sizes.
    """
    n = x.numel()
    chunk = n // world_size
    pack, unpack = kernels.get("onebit_pack", x.device), kernels.get("onebit_unpack", x.device)
    row_bytes = chunk // 8 + SCALE_BYTES
    send = torch.empty(world_size, row_bytes, dtype=torch.uint8, device=x.device)
    pack(x, worker_error, send, _error_fed_scale(x, worker_error, error_fed))
    recv = torch.empty_like(send)
    wait_all((comm.all_to_all_single(recv, send, group=group, async_op=True),), "1-bit all_to_all")
    # server: average the decompressed chunks of all workers (each worker's scale times its signs),
    # into x's first chunk (x itself is consumed: its error is kept, it is overwritten below)
    mine = x[:chunk]
    unpack(recv, mine, True)
    row = torch.empty(1, row_bytes, dtype=torch.uint8, device=x.device)
    pack(mine, server_error, row, _error_fed_scale(mine, server_error))
    gathered = torch.empty(world_size, row_bytes, dtype=torch.uint8, device=x.device)
    wait_all((comm.all_gather_into_tensor(gathered.view(-1), row.view(-1), group=group, async_op=True),),
             "1-bit all_gather")
    unpack(gathered, x, False)
    return x
