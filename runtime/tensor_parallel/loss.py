"""Vocab-parallel cross-entropy: the loss of logits split over the vocabulary across the
tensor-parallel group, without ever gathering them whole (``tensor_parallel.loss_parallel``).

Each rank holds the logits of its slice of the vocabulary ``[vocab_start, vocab_start + width)``.
Per token, three numbers are reduced over the group: the max logit (MAX, for a stable exp), the
sum of the shifted exps and the target's shifted logit (SUM; only the rank holding the target
contributes it). ``loss = log(sum exp) - target logit``; the gradient of this rank's slice is its
softmax minus the target's one-hot, computed locally (Megatron's and torchtitan's loss parallel).

``causal_lm_loss`` wraps it in Hugging Face's ``loss_function`` signature (``ForCausalLMLoss``:
labels shifted by one, ``ignore_index``, ``num_items_in_batch``), which AutoTP training installs
on the model when ``loss_parallel`` is on.

collective: every function here runs on every rank of the tensor group, with logits of the same
number of tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from dslaunch.runtime.comm import comm

__all__ = ["vocab_parallel_cross_entropy", "causal_lm_loss", "shifted_labels", "causal_lm_mean"]

IGNORE_INDEX = -100  # PyTorch's and Hugging Face's default


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token loss ``[N]`` of local logits ``[N, width]`` (fp32) against global targets ``[N]``."""

    @staticmethod
    def forward(ctx: Any, local: torch.Tensor, target: torch.Tensor, vocab_start: int, group: Any) -> torch.Tensor:
        peak = local.max(dim=-1).values
        comm.all_reduce(peak, op=torch.distributed.ReduceOp.MAX, group=group)
        shifted = local - peak.unsqueeze(-1)
        index = target - vocab_start
        mine = (index >= 0) & (index < local.shape[-1])  # ignored targets (negative) are nobody's
        index = index.masked_fill(~mine, 0)
        picked = shifted.gather(-1, index.unsqueeze(-1)).squeeze(-1).masked_fill(~mine, 0.0)
        exps = shifted.exp()
        total = exps.sum(dim=-1)
        both = torch.stack([total, picked])  # one all-reduce for the two sums
        comm.all_reduce(both, group=group)
        total, picked = both[0], both[1]
        exps /= total.unsqueeze(-1)  # this slice of the softmax, kept for backward
        ctx.save_for_backward(exps, index, mine)
        return total.log() - picked

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        softmax, index, mine = ctx.saved_tensors
        out = softmax.clone()
        rows = torch.arange(out.shape[0], device=out.device)
        out[rows, index] -= mine.to(out.dtype)
        return out * grad.unsqueeze(-1), None, None, None


def vocab_parallel_cross_entropy(local_logits: torch.Tensor, target: torch.Tensor, vocab_start: int, group: Any,
                                 ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """The cross-entropy of each token, from this rank's slice of the logits.

    Args:
        local_logits: ``[..., width]``, this rank's vocabulary columns (computed in fp32).
        target: ``[...]``, token ids over the whole vocabulary; ``ignore_index`` for none.
        vocab_start: the first vocabulary id of this rank's slice.
        group: the tensor-parallel group the vocabulary is split over.
        ignore_index: targets with this id get loss 0 and no gradient.

    Returns:
        The per-token loss, shaped as ``target`` (0 where ignored), the same on every rank.

    collective: every rank of ``group``.
    """
    keep = target != ignore_index
    target = target.masked_fill(~keep, -1)  # below every rank's slice, whatever ignore_index is
    losses = _VocabParallelCrossEntropy.apply(local_logits.float().reshape(-1, local_logits.shape[-1]),
                                              target.reshape(-1), vocab_start, group)
    return losses.reshape(target.shape) * keep


def shifted_labels(labels: torch.Tensor, shift_labels: torch.Tensor | None, ignore_index: int) -> torch.Tensor:
    """Hugging Face's causal-LM targets: ``shift_labels`` when given, else ``labels`` shifted by one
    (tokens < n predict n; the last predicts nothing)."""
    return F.pad(labels, (0, 1), value=ignore_index)[..., 1:] if shift_labels is None else shift_labels


def causal_lm_mean(total: torch.Tensor, targets: torch.Tensor, ignore_index: int,
                   num_items_in_batch: Any) -> torch.Tensor:
    """Hugging Face's ``ForCausalLMLoss`` from the summed token losses ``total``: the mean over the
    counted ``targets``, or the sum over ``num_items_in_batch`` (the Trainer's accumulation)."""
    if num_items_in_batch is None:
        return total / (targets != ignore_index).sum()
    return total / (num_items_in_batch.to(total.device) if torch.is_tensor(num_items_in_batch)
                    else num_items_in_batch)


def causal_lm_loss(vocab_start: int, group: Any) -> Callable[..., torch.Tensor]:
    """Hugging Face's ``ForCausalLMLoss`` over vocab-parallel logits: a model's ``loss_function``.

    The returned function takes ``(logits, labels, vocab_size=None, num_items_in_batch=None,
    ignore_index=-100, shift_labels=None, **kwargs)`` as Hugging Face's does: the mean over the
    tokens that count (or the sum over ``num_items_in_batch``, as the Trainer's gradient
    accumulation passes it).
    """

    def loss(logits: torch.Tensor, labels: torch.Tensor | None = None, vocab_size: int | None = None,
             num_items_in_batch: Any = None, ignore_index: int = IGNORE_INDEX,
             shift_labels: torch.Tensor | None = None, **kwargs: Any) -> torch.Tensor:
        targets = shifted_labels(labels, shift_labels, ignore_index).to(logits.device)
        total = vocab_parallel_cross_entropy(logits, targets, vocab_start, group, ignore_index).sum()
        return causal_lm_mean(total, targets, ignore_index, num_items_in_batch)

    return loss
