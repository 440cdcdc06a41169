"""FPDT's load-balanced token layout (``deepspeed.sequence.fpdt_layer.FPDT_InputConstruct``).

FPDT cuts the global sequence into ``P * n`` chunks of ``C / P`` tokens (``C`` is
``ds_sequence_parallel_fpdt_chunk_size``, ``n = S / C`` the chunks per rank, ``P`` the sequence
ranks). Rank ``r`` holds chunks ``r, r + P, r + 2P, ...``: its ``j``-th local chunk is global chunk
``j * P + r``. The Ulysses all-to-all of local chunk ``j`` then gathers global chunks ``j * P`` to
``j * P + P - 1``, i.e. the contiguous ``j``-th block of ``C`` tokens, so the attention of chunk
``j`` only needs blocks ``0..j`` and every rank does the same amount of causal work (a plain
contiguous split would leave the last rank with most of it).
"""

from __future__ import annotations

from typing import Any

import torch

from dslaunch.errors import UsageError

__all__ = ["FPDT_InputConstruct", "fpdt_token_order"]


def fpdt_token_order(seq_len: int, chunk_size: int, sp_size: int, device: Any = None) -> torch.Tensor:
    """The global positions of every rank's tokens, rank 0's first: ``order.view(P, -1)[r]`` are
    rank ``r``'s positions in its local order.

    Args:
        seq_len: the global sequence length ``S``.
        chunk_size: ``ds_sequence_parallel_fpdt_chunk_size`` (``C``): the tokens one attention chunk
            covers after the all-to-all (``C / P`` per rank).
        sp_size: the sequence-parallel ranks ``P``.
        device: where the index tensor lives.

    Returns:
        A ``long`` tensor of ``S`` positions.

    Raises:
        UsageError: ``S`` is not a multiple of ``C``, or ``C`` not a multiple of ``P``.
    """
    if chunk_size < 1 or seq_len % chunk_size:
        raise UsageError(f"FPDT: the sequence length {seq_len} is not a multiple of "
                         f"ds_sequence_parallel_fpdt_chunk_size={chunk_size}")
    if chunk_size % sp_size:
        raise UsageError(f"FPDT: ds_sequence_parallel_fpdt_chunk_size={chunk_size} does not split over "
                         f"{sp_size} sequence-parallel ranks; use a multiple of {sp_size}")
    local_chunk, per_rank = chunk_size // sp_size, seq_len // chunk_size
    # [rank, local chunk, token]: global chunk j * P + r starts at (j * P + r) * local_chunk
    rank = torch.arange(sp_size, device=device).view(-1, 1, 1)
    chunk = torch.arange(per_rank, device=device).view(1, -1, 1)
    token = torch.arange(local_chunk, device=device).view(1, 1, -1)
    return ((chunk * sp_size + rank) * local_chunk + token).flatten()


class FPDT_InputConstruct(torch.nn.Module):
    """One rank's tokens, labels and position ids in FPDT's load-balanced layout.

    Args:
        tokens: ``[b, S]`` token ids (any ``[b, S, ...]`` tensor is reordered the same way).
        labels: ``[b, S]`` or ``None``.
        loss_mask: ``[b, S]`` or ``None``; as DeepSpeed, ``generate`` returns it for the whole
            sequence, every rank's positions in rank order (the order ``FPDT_LogitsLoss``'s
            gathered loss has), not this rank's share.
        attention_mask: returned unchanged (FPDT attention is causal and takes no mask).
        position_ids: ``[b, S]`` or ``None``.
        args: an object with ``ds_sequence_parallel_fpdt_chunk_size`` (Megatron's args).
        sp_size: the sequence-parallel ranks.
        sp_rank: this rank in the sequence group.

    Raises:
        UsageError: the sequence length does not split into chunks over the ranks.
    """

    def __init__(self, tokens: torch.Tensor, labels: torch.Tensor | None, loss_mask: torch.Tensor | None,
                 attention_mask: Any, position_ids: torch.Tensor | None, args: Any, sp_size: int,
                 sp_rank: int) -> None:
        super().__init__()
        self.tokens, self.labels, self.loss_mask = tokens, labels, loss_mask
        self.attention_mask, self.position_ids = attention_mask, position_ids
        self.global_seq_len, self.batch_size = tokens.shape[1], tokens.shape[0]
        self.sp_size, self.sp_rank, self.device = sp_size, sp_rank, tokens.device
        fpdt_chunk = getattr(args, "ds_sequence_parallel_fpdt_chunk_size", None)
        if not isinstance(fpdt_chunk, int):
            raise UsageError("FPDT_InputConstruct: args.ds_sequence_parallel_fpdt_chunk_size must be an int "
                             f"(got {fpdt_chunk!r})")
        self.order = fpdt_token_order(self.global_seq_len, fpdt_chunk, sp_size, tokens.device)
        self.num_chunk_per_gpu = self.global_seq_len // fpdt_chunk
        self.local_seq_len = self.global_seq_len // sp_size
        self.chunk_size = fpdt_chunk // sp_size

    def generate(self) -> tuple[Any, Any, Any, Any, Any]:
        """``(tokens, labels, loss_mask, attention_mask, position_ids)`` for this rank (``None`` stays
        ``None``); the loss mask covers the whole sequence, reordered."""
        mine = self.order.view(self.sp_size, -1)[self.sp_rank]

        def pick(t: torch.Tensor | None, index: torch.Tensor) -> torch.Tensor | None:
            return None if t is None else t[:, index]

        return (pick(self.tokens, mine), pick(self.labels, mine), pick(self.loss_mask, self.order),
                self.attention_mask, pick(self.position_ids, mine))
