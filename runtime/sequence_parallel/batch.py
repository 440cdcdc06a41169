"""One rank's part of a batch whose sequences are split over a sequence group.

``shard_batch`` turns ``labels`` into ``shift_labels`` (the next token's label at each position,
shifted before the split: the last position of a shard predicts the first token of the next
shard), pads the sequence to a multiple of the group's size (pad-and-mask: padded positions
come last, their labels are ignored and causal attention keeps them out of every real
position's context, so the loss and the gradients are those of the unpadded sequence) and keeps
this rank's ``1/N`` of every ``[batch, sequence, ...]`` tensor. ``position_ids`` count the
whole sequence (made when missing), so each rank's tokens keep their global positions.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from dslaunch.errors import UsageError
from dslaunch.runtime.sequence_parallel.loss import IGNORE_INDEX

__all__ = ["shard_batch", "padded_length"]

_PAD_VALUES = {"labels": IGNORE_INDEX, "shift_labels": IGNORE_INDEX, "attention_mask": 0}


def padded_length(length: int, ranks: int) -> int:
    """``length`` rounded up to a multiple of ``ranks``."""
    return -(-length // ranks) * ranks


def shard_batch(batch: Mapping[str, Any], rank: int, ranks: int, pad_token_id: int = 0) -> dict[str, Any]:
    """Rank ``rank``'s part of ``batch`` (a dict with ``input_ids`` ``[batch, sequence]``).

    Tensors are cut on dimension 1; other values are kept whole. ``labels`` become
    ``shift_labels``; padding is ``pad_token_id`` for ``input_ids``, -100 for labels, 0 for an
    ``attention_mask`` and other tensors, and the next positions for ``position_ids``.

    Raises:
        UsageError: no ``input_ids``, or a tensor whose dimension 1 is not the sequence length.
    """
    if "input_ids" not in batch or not torch.is_tensor(batch["input_ids"]) or batch["input_ids"].dim() < 2:
        raise UsageError("sequence parallelism: each batch needs input_ids of shape [batch, sequence]; got keys "
                         f"{sorted(batch)}")
    b, length = batch["input_ids"].shape[:2]
    out = dict(batch)
    if "position_ids" not in out:
        out["position_ids"] = torch.arange(length, device=batch["input_ids"].device).expand(b, length)
    if "labels" in out:
        labels = out.pop("labels")
        out["shift_labels"] = torch.nn.functional.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)
    full = padded_length(length, ranks)
    chunk = full // ranks
    for key, value in out.items():
        if not torch.is_tensor(value):
            continue
        if value.dim() < 2 or value.shape[1] != length:
            raise UsageError(f"sequence parallelism: batch[{key!r}] has shape {tuple(value.shape)}; every tensor "
                             f"must be [batch, sequence, ...] with input_ids' sequence length {length}")
        out[key] = _padded(key, value, full - length, pad_token_id)[:, rank * chunk:(rank + 1) * chunk].contiguous()
    return out


def _padded(key: str, value: torch.Tensor, extra: int, pad_token_id: int) -> torch.Tensor:
    if extra == 0:
        return value
    if key == "position_ids":
        step = torch.arange(1, extra + 1, device=value.device, dtype=value.dtype)
        return torch.cat([value, value[:, -1:] + step], dim=1)
    fill = pad_token_id if key == "input_ids" else _PAD_VALUES.get(key, 0)
    pad = value.new_full((value.shape[0], extra, *value.shape[2:]), fill)
    return torch.cat([value, pad], dim=1)
