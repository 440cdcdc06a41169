"""DeepSpeed's ``deepspeed.sequence.cross_entropy``: cross-entropy over logits split by vocabulary
(tensor-parallel ranks) and by sequence (sequence-parallel ranks), with DeepSpeed's signatures.

The per-token loss is dslaunch's vocab-parallel one (``runtime/tensor_parallel/loss.py``: three
reductions per token over the tensor group, never the whole logits). This module adds DeepSpeed's
API around it: the shard bounds (inferred from even shards, or given and checked once over the
group), targets out of the vocabulary refused, the ``none``/``sum``/``mean`` reductions summed
over the sequence group, the per-token losses gathered over the sequence
(``gather_sequence_loss``), Hugging Face's ``loss_function`` (``VocabParallelCausalLMLoss``) and
its installation on a model (``configure_vocab_parallel_loss``). ``backend="liger"`` is refused
in one line, as the config's ``vocab_parallel_ce_backend`` is (DeepSpeed falls back to torch).

collective: every function runs on every rank of the groups it is given.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.nn.functional import all_reduce

from dslaunch.errors import NotInDslaunchError
from dslaunch.runtime.sequence_parallel.loss import own_rows_summed
from dslaunch.runtime.tensor_parallel import loss as tp_loss

__all__ = ["vocab_parallel_cross_entropy", "vocab_sequence_parallel_cross_entropy", "VocabParallelCrossEntropyLoss",
           "VocabParallelCausalLMLoss", "configure_vocab_parallel_loss", "validate_vocab_parallel_loss"]

_REDUCTIONS = ("none", "sum", "mean")


def is_parallel(group: Any) -> bool:
    """Whether ``group`` spans more than this rank (None or a world of one: no collective)."""
    return group is not None and dist.is_initialized() and dist.get_world_size(group) > 1


def group_reduce(value: torch.Tensor, group: Any, op: Any = None) -> torch.Tensor:
    """``value`` all-reduced in place over ``group`` (``op``: SUM when None); as it is without a
    parallel group. No gradient: statistics and partial sums, not a differentiable sum."""
    if is_parallel(group):
        dist.all_reduce(value, op=dist.ReduceOp.SUM if op is None else op, group=group)
    return value


def _check_backend(backend: str) -> None:
    if backend == "liger":
        raise NotInDslaunchError("backend='liger' is not in dslaunch (DeepSpeed's Liger kernel backend); the "
                                 "vocab-parallel loss is dslaunch's own: use backend='torch'")
    if backend != "torch":
        raise ValueError(f"backend: expected 'torch', got {backend!r}")


def resolve_vocab_shard(local_size: int, start: int | None, end: int | None, tp_group: Any,
                        device: torch.device) -> tuple[int, int, int]:
    """``(start, end, global vocabulary size)`` of this rank's vocabulary columns: inferred from even
    shards when ``start`` is None, and checked over the group to tile ``[0, vocabulary)``.

    Raises:
        ValueError: one of ``start``/``end`` alone, uneven shards without bounds, bounds that do not
            match the local width or do not tile the vocabulary (every rank raises together).

    collective: every rank of ``tp_group`` (none without one).
    """
    if (start is None) != (end is None):
        raise ValueError("vocab_start_index and vocab_end_index must be given together")
    if not is_parallel(tp_group):
        start, end = (0, local_size) if start is None else (start, end)
        if (start, end) != (0, local_size):
            raise ValueError(f"without tensor parallelism the shard must be the whole local vocabulary "
                             f"[0, {local_size}), got [{start}, {end})")
        return start, end, local_size
    world, rank = dist.get_world_size(tp_group), dist.get_rank(tp_group)
    mine = torch.tensor([-1 if start is None else start, -1 if end is None else end, local_size], device=device)
    every = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(every, mine, group=tp_group)
    shards = [tuple(t.tolist()) for t in every]
    if start is None:
        if len({size for _, _, size in shards}) != 1:
            raise ValueError("uneven vocabulary shards need explicit vocab_start_index and vocab_end_index")
        start, end = rank * local_size, (rank + 1) * local_size
        shards = [(r * local_size, (r + 1) * local_size, local_size) for r in range(world)]
    expected = 0
    for r, (lo, hi, size) in enumerate(shards):
        if hi - lo != size or size <= 0 or lo != expected:
            raise ValueError(f"vocabulary shards must tile [0, vocabulary) in rank order with the local widths; "
                             f"tensor rank {r} has [{lo}, {hi}) for {size} columns")
        expected = hi
    return start, end, expected


class _GatherSequence(torch.autograd.Function):
    """Per-token losses of every sequence rank, concatenated on dim 0. Backward: this rank's rows
    of the gradient summed over the ranks (``loss.own_rows_summed``; DeepSpeed's legacy
    ``sum_gradients=False`` keeps the slice alone, 1/N of the gradient under dslaunch's average)."""

    @staticmethod
    def forward(ctx: Any, local: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group, ctx.n = group, local.shape[0]
        out = local.new_empty((local.shape[0] * dist.get_world_size(group), *local.shape[1:]))
        dist.all_gather_into_tensor(out, local.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return own_rows_summed(grad, ctx.n, ctx.group), None


def sequence_sum(value: torch.Tensor, sp_group: Any) -> torch.Tensor:
    """The sum over the sequence group; its backward all-reduces the gradient (every rank's loss
    reads every rank's value), the convention of ``loss.py``. DeepSpeed's ``_global_sp_sum`` passes
    the gradient as it is: 1/N of the whole sequence's under dslaunch's average."""
    return all_reduce(value, group=sp_group) if is_parallel(sp_group) else value


def vocab_parallel_cross_entropy(vocab_parallel_logits: torch.Tensor, target: torch.Tensor, tp_group: Any = None,
                                 sp_group: Any = None, vocab_start_index: int | None = None,
                                 vocab_end_index: int | None = None, global_vocab_size: int | None = None,
                                 ignore_index: int = -100, reduction: str = "mean",
                                 gather_sequence_loss: bool = False, backend: str = "torch") -> torch.Tensor:
    """Cross-entropy of ``vocab_parallel_logits`` (``[..., local vocabulary]``) against ``target``.

    ``reduction``: ``"none"`` per-token losses (0 where ignored; gathered over ``sp_group`` with
    ``gather_sequence_loss``), ``"sum"`` their sum over the sequence group, ``"mean"`` that sum over
    the counted tokens of the sequence group. ``global_vocab_size`` (with explicit bounds) skips the
    collective check of the shard bounds, as a caller that checked them once passes it.

    Raises:
        ValueError: mismatched shapes, an unknown reduction, bad bounds, a target outside the
            vocabulary (not ``ignore_index``).
        NotInDslaunchError: ``backend="liger"``.
    """
    if vocab_parallel_logits.shape[:-1] != target.shape:
        raise ValueError(f"vocab_parallel_logits {tuple(vocab_parallel_logits.shape)} and target "
                         f"{tuple(target.shape)} must match outside the vocabulary dimension")
    if reduction not in _REDUCTIONS:
        raise ValueError(f"reduction: expected one of {_REDUCTIONS}, got {reduction!r}")
    _check_backend(backend)
    if gather_sequence_loss and reduction != "none":
        raise ValueError("gather_sequence_loss needs reduction='none'")
    if global_vocab_size is None:
        vocab_start_index, vocab_end_index, global_vocab_size = resolve_vocab_shard(
            vocab_parallel_logits.shape[-1], vocab_start_index, vocab_end_index, tp_group,
            vocab_parallel_logits.device)
    elif vocab_start_index is None:
        raise ValueError("global_vocab_size needs explicit vocab_start_index and vocab_end_index")
    outside = (target != ignore_index) & ((target < 0) | (target >= global_vocab_size))
    if bool(outside.any()):
        raise ValueError(f"target holds ids outside the vocabulary [0, {global_vocab_size})")
    if is_parallel(tp_group):
        losses = tp_loss.vocab_parallel_cross_entropy(vocab_parallel_logits, target, vocab_start_index, tp_group,
                                                      ignore_index)
    else:  # the whole vocabulary here: torch's loss (fp32, as the split one computes)
        losses = F.cross_entropy(vocab_parallel_logits.float().flatten(0, -2), target.flatten(),
                                 ignore_index=ignore_index, reduction="none").view(target.shape)
    if reduction == "none":
        if not gather_sequence_loss:
            return losses
        if sp_group is None:
            raise ValueError("gather_sequence_loss needs sp_group")
        return _GatherSequence.apply(losses, sp_group)
    total = sequence_sum(losses.sum(), sp_group)
    if reduction == "sum":
        return total
    counted = (target != ignore_index).sum().to(losses.dtype)
    return total / group_reduce(counted, sp_group).clamp_min(1)


def vocab_sequence_parallel_cross_entropy(vocab_parallel_logits: torch.Tensor, target: torch.Tensor, sp_group: Any,
                                          tp_group: Any = None, vocab_start_index: int | None = None,
                                          vocab_end_index: int | None = None, ignore_index: int = -100,
                                          reduction: str = "none", gather_sequence_loss: bool = True,
                                          backend: str = "torch") -> torch.Tensor:
    """DeepSpeed-Ulysses' loss: per-token losses of the whole sequence, gathered over ``sp_group``;
    backward sums each rank's rows over the group (DeepSpeed keeps this rank's slice: see
    ``loss.py``)."""
    if gather_sequence_loss and reduction != "none":
        raise ValueError("gather_sequence_loss needs reduction='none'")
    if gather_sequence_loss and sp_group is None:
        raise ValueError("gather_sequence_loss needs sp_group")
    losses = vocab_parallel_cross_entropy(vocab_parallel_logits, target, tp_group=tp_group, sp_group=sp_group,
                                          vocab_start_index=vocab_start_index, vocab_end_index=vocab_end_index,
                                          ignore_index=ignore_index, reduction=reduction, backend=backend)
    return _GatherSequence.apply(losses, sp_group) if gather_sequence_loss else losses


class VocabParallelCrossEntropyLoss(nn.Module):
    """``vocab_parallel_cross_entropy`` as a module (its keywords fixed at construction)."""

    def __init__(self, tp_group: Any = None, sp_group: Any = None, vocab_start_index: int | None = None,
                 vocab_end_index: int | None = None, ignore_index: int = -100, reduction: str = "mean",
                 gather_sequence_loss: bool = False, backend: str = "torch"):
        super().__init__()
        self.options = {"tp_group": tp_group, "sp_group": sp_group, "vocab_start_index": vocab_start_index,
                        "vocab_end_index": vocab_end_index, "ignore_index": ignore_index, "reduction": reduction,
                        "gather_sequence_loss": gather_sequence_loss, "backend": backend}

    def forward(self, vocab_parallel_logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_cross_entropy(vocab_parallel_logits, target, **self.options)


class VocabParallelCausalLMLoss:
    """Hugging Face's causal-LM ``loss_function`` over a vocabulary-split LM head: labels shifted by
    one (or ``shift_labels``), the mean over counted tokens, or the sum over ``num_items_in_batch``.
    The shard bounds are checked once, at the first call; a later call with another shard raises.

    Leave ``sp_group`` None under the engine's sequence parallelism (it weighs the shards' means
    itself); give it only where this loss is the one reduction over a hand-built TP x SP mesh.
    """

    def __init__(self, tp_group: Any = None, sp_group: Any = None, vocab_start_index: int | None = None,
                 vocab_end_index: int | None = None, ignore_index: int = -100, backend: str = "torch"):
        _check_backend(backend)
        self.tp_group, self.sp_group, self.ignore_index, self.backend = tp_group, sp_group, ignore_index, backend
        self.vocab_start_index, self.vocab_end_index = vocab_start_index, vocab_end_index
        self._shard: tuple[Any, ...] | None = None  # (local width, start, end, vocabulary) once checked

    def _vocabulary(self, local_size: int, device: torch.device) -> int:
        if self._shard is None:
            start, end, vocab = resolve_vocab_shard(local_size, self.vocab_start_index, self.vocab_end_index,
                                                    self.tp_group, device)
            self.vocab_start_index, self.vocab_end_index, self._shard = start, end, (local_size, start, end, vocab)
        elif self._shard[:3] != (local_size, self.vocab_start_index, self.vocab_end_index):
            raise RuntimeError("VocabParallelCausalLMLoss: the vocabulary shard changed after its first call; "
                               "make one instance per shard")
        return self._shard[3]

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor | None = None, vocab_size: int | None = None,
                 shift_labels: torch.Tensor | None = None, num_items_in_batch: Any = None,
                 **kwargs: Any) -> torch.Tensor:
        if shift_labels is None:
            if labels is None:
                raise ValueError("VocabParallelCausalLMLoss needs labels or shift_labels")
            shift_labels, logits = labels[..., 1:], logits[..., :-1, :]
        vocab = self._vocabulary(logits.shape[-1], logits.device)
        loss = vocab_parallel_cross_entropy(logits.contiguous(), shift_labels.contiguous().to(logits.device),
                                            tp_group=self.tp_group, sp_group=self.sp_group,
                                            vocab_start_index=self.vocab_start_index,
                                            vocab_end_index=self.vocab_end_index, global_vocab_size=vocab,
                                            ignore_index=self.ignore_index,
                                            reduction="mean" if num_items_in_batch is None else "sum")
        if num_items_in_batch is None:
            return loss
        return loss / torch.as_tensor(num_items_in_batch, device=loss.device, dtype=loss.dtype).clamp_min(1)


def _install(model: nn.Module, loss_fn: Any) -> Any:
    """Set ``model.loss_function`` to ``loss_fn``; returns the one it replaced.

    Raises:
        ValueError: the model has no writable ``loss_function`` (the head must gather its output).
    """
    if not hasattr(model, "loss_function"):
        raise ValueError(f"{type(model).__name__} has no loss_function to replace: a vocabulary-split LM head "
                         "needs one; gather the head's output instead")
    before = model.loss_function
    try:
        model.loss_function = loss_fn
    except (AttributeError, TypeError) as exc:
        raise ValueError(f"{type(model).__name__}.loss_function cannot be replaced ({exc}); gather the head's "
                         "output instead") from None
    if model.loss_function is not loss_fn:
        model.loss_function = before
        raise ValueError(f"{type(model).__name__}.loss_function ignores assignment; gather the head's output instead")
    return before


def validate_vocab_parallel_loss(model: nn.Module) -> None:
    """Check that ``model.loss_function`` can be replaced, and leave it as it was."""
    model.loss_function = _install(model, VocabParallelCausalLMLoss())


def configure_vocab_parallel_loss(model: nn.Module, vocab_parallel_head: Any, sp_group: Any = None,
                                  ignore_index: int = -100, backend: str = "torch") -> nn.Module:
    """Install ``VocabParallelCausalLMLoss`` for ``vocab_parallel_head`` (its ``mp_group`` and
    ``vocab_start_index``/``vocab_end_index``) as ``model.loss_function``; the one replaced stays
    at ``model._deepspeed_original_loss_function``."""
    loss_fn = VocabParallelCausalLMLoss(tp_group=vocab_parallel_head.mp_group, sp_group=sp_group,
                                        vocab_start_index=vocab_parallel_head.vocab_start_index,
                                        vocab_end_index=vocab_parallel_head.vocab_end_index,
                                        ignore_index=ignore_index, backend=backend)
    before = _install(model, loss_fn)
    if not hasattr(model, "_deepspeed_original_loss_function"):
        model._deepspeed_original_loss_function = before
    return model
