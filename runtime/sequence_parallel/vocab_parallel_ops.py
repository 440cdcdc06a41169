"""DeepSpeed's ``deepspeed.sequence.vocab_parallel_ops``: per-token log-probabilities, entropy and
KL divergence of logits split by vocabulary over a tensor-parallel group, never gathered whole.

RL losses (policy log-probabilities of the sampled tokens, entropy bonuses) and on-policy
distillation (KL between student and teacher) run on each rank's shard of the logits. Per row, the
group agrees on two numbers (the max logit, MAX; the sum of shifted exps, SUM), which give the
log-partition ``log Z``; whatever else a result needs is one more SUM of a per-row partial. Results
are fp32, one per token (or per requested id), the same on every rank of the group; masking and
reduction are the caller's.

Backward needs no communication: every rank back-propagates the same loss (as for the
vocab-parallel cross-entropy), so each local logit's gradient follows from the logits and the saved
row statistics. No fp32 copy of the logits is kept or made whole: every pass over them takes row
chunks of at most 2**24 elements (the collectives carry only per-row values, so uneven shards issue
the same ones). A row whose logits are all ``-inf`` has no distribution: entropy and KL are NaN there,
and its logits get a zero gradient so that callers can mask it (padding). As DeepSpeed's.

collective: every function runs on every rank of ``tp_group`` (none without one), with logits of
the same shape outside the vocabulary dimension.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from dslaunch.runtime.sequence_parallel.cross_entropy import group_reduce, resolve_vocab_shard

__all__ = ["vocab_parallel_logprobs", "vocab_parallel_entropy", "vocab_parallel_kl_div"]

# fp32 temporaries of one pass over the logits stay this many elements, whatever the token count
_CHUNK = 1 << 24


def _slices(logits: torch.Tensor) -> list[slice]:
    step = max(1, _CHUNK // max(1, logits.shape[-1]))
    return [slice(i, i + step) for i in range(0, logits.shape[0], step)]


def _per_row(logits: torch.Tensor, fn: Callable[[slice], torch.Tensor]) -> torch.Tensor:
    parts = [fn(rows) for rows in _slices(logits)]
    return torch.cat(parts) if parts else logits.new_zeros(0, dtype=torch.float32)


@dataclass(frozen=True)
class _Stats:
    """One split logits ``[N, V]``, the group's ``log Z`` per row and which rows are undefined (all
    ``-inf`` on every rank: computed as uniform, their results masked)."""

    logits: torch.Tensor
    log_z: torch.Tensor
    undefined: torch.Tensor

    @classmethod
    def of(cls, logits: torch.Tensor, group: Any) -> _Stats:
        peak = group_reduce(_per_row(logits, lambda r: logits[r].float().amax(dim=-1)), group, dist.ReduceOp.MAX)
        undefined = peak == float("-inf")
        peak = peak.masked_fill(undefined, 0.0)
        shifted = cls(logits, peak, undefined)
        total = group_reduce(_per_row(logits, lambda r: shifted.log_probs(r).exp().sum(dim=-1)), group)
        return cls(logits, peak + total.log(), undefined)

    def log_probs(self, rows: slice) -> torch.Tensor:
        """Rows ``rows`` of this shard's log-softmax columns, fp32."""
        return self.logits[rows].float().masked_fill(self.undefined[rows, None], 0.0) - self.log_z[rows, None]


def _rows(logits: torch.Tensor) -> torch.Tensor:
    return logits.detach().reshape(-1, logits.shape[-1])


def _weighted(probs: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """``sum_j p_j v_j`` per row, a term counted 0 where ``p_j`` is 0 (never ``0 * -inf``)."""
    return torch.where(probs > 0, probs * values, torch.zeros_like(probs)).sum(dim=-1)


def _gradient(like: torch.Tensor, undefined: torch.Tensor,
              fn: Callable[[slice], torch.Tensor]) -> torch.Tensor:
    """The gradient of a split logits ``like`` (its shape and dtype), built chunk by chunk; 0 on
    undefined rows."""
    flat = _rows(like)
    out = torch.empty_like(flat)
    for rows in _slices(flat):
        out[rows] = fn(rows).masked_fill(undefined[rows, None], 0.0).to(out.dtype)
    return out.view(like.shape)


class _LogProbs(torch.autograd.Function):

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, index: torch.Tensor, group: Any, vocab_start: int,
                keep: torch.Tensor) -> torch.Tensor:
        stats = _Stats.of(_rows(logits), group)
        local = index - vocab_start
        mine = keep & (local >= 0) & (local < stats.logits.shape[-1])
        local = local.masked_fill(~mine, 0)
        picked = (stats.logits.gather(-1, local).float() - stats.log_z[:, None]).masked_fill(~mine, 0.0)
        out = group_reduce(picked, group)  # every kept id is one rank's; ignored ids stay 0
        ctx.save_for_backward(logits, stats.log_z, stats.undefined, local, mine, keep)
        return out.masked_fill(stats.undefined[:, None] & keep, float("nan"))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        logits, log_z, undefined, local, mine, keep = ctx.saved_tensors
        stats = _Stats(_rows(logits), log_z, undefined)
        grad = grad * keep
        total = grad.sum(dim=-1, keepdim=True)

        def rows_grad(rows: slice) -> torch.Tensor:  # d log p_i / dx_j = 1[i=j] - p_j
            out = -stats.log_probs(rows).exp() * total[rows]
            return out.scatter_add_(-1, local[rows], grad[rows] * mine[rows])

        return _gradient(logits, undefined, rows_grad), None, None, None, None


class _Entropy(torch.autograd.Function):

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, group: Any) -> torch.Tensor:
        stats = _Stats.of(_rows(logits), group)

        def partial(rows: slice) -> torch.Tensor:
            log_p = stats.log_probs(rows)
            return -_weighted(log_p.exp(), log_p)

        entropy = group_reduce(_per_row(stats.logits, partial), group)
        ctx.save_for_backward(logits, stats.log_z, stats.undefined, entropy)
        return entropy.masked_fill(stats.undefined, float("nan"))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, None]:
        logits, log_z, undefined, entropy = ctx.saved_tensors
        stats = _Stats(_rows(logits), log_z, undefined)

        def rows_grad(rows: slice) -> torch.Tensor:  # dH/dx_j = -p_j (log p_j + H)
            log_p = stats.log_probs(rows)
            p = log_p.exp()
            return -torch.where(p > 0, p * (log_p + entropy[rows, None]), torch.zeros_like(p)) * grad[rows, None]

        return _gradient(logits, undefined, rows_grad), None


class _KLDiv(torch.autograd.Function):
    """``KL(a || b) = sum_j a_j (log a_j - log b_j)`` of two identically split logits."""

    @staticmethod
    def forward(ctx: Any, a_logits: torch.Tensor, b_logits: torch.Tensor, group: Any) -> torch.Tensor:
        a, b = _Stats.of(_rows(a_logits), group), _Stats.of(_rows(b_logits), group)

        def partial(rows: slice) -> torch.Tensor:
            log_a = a.log_probs(rows)
            return _weighted(log_a.exp(), log_a - b.log_probs(rows))

        kl = group_reduce(_per_row(a.logits, partial), group)
        undefined = a.undefined | b.undefined
        ctx.save_for_backward(a_logits, b_logits, a.log_z, a.undefined, b.log_z, b.undefined, kl)
        return kl.masked_fill(undefined, float("nan"))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        a_logits, b_logits, a_z, a_undefined, b_z, b_undefined, kl = ctx.saved_tensors
        a, b = _Stats(_rows(a_logits), a_z, a_undefined), _Stats(_rows(b_logits), b_z, b_undefined)
        undefined = a_undefined | b_undefined

        def grad_a(rows: slice) -> torch.Tensor:  # a_j (log a_j - log b_j - KL)
            log_a = a.log_probs(rows)
            p = log_a.exp()
            terms = torch.where(p > 0, p * (log_a - b.log_probs(rows) - kl[rows, None]), torch.zeros_like(p))
            return terms.nan_to_num(nan=0.0) * grad[rows, None]

        def grad_b(rows: slice) -> torch.Tensor:  # b_j - a_j
            return (b.log_probs(rows).exp() - a.log_probs(rows).exp()) * grad[rows, None]

        return _gradient(a_logits, undefined, grad_a), _gradient(b_logits, undefined, grad_b), None


def vocab_parallel_logprobs(vocab_parallel_logits: torch.Tensor, index: torch.Tensor, tp_group: Any = None,
                            vocab_start_index: int | None = None, vocab_end_index: int | None = None,
                            global_vocab_size: int | None = None, ignore_index: int = -100) -> torch.Tensor:
    """Log-probabilities (fp32) of the token ids ``index`` under the split logits.

    ``index`` is shaped as the logits without their last dimension (one id per position, e.g. the
    sampled tokens), or with a trailing ``k`` (e.g. a teacher's top-k ids); the same on every rank.
    An id equal to ``ignore_index`` gives 0. ``global_vocab_size`` (with explicit bounds) skips the
    collective check of the shard bounds, as a caller that checked them once passes it.

    Raises:
        ValueError: ``index`` of another shape, bounds given alone or not tiling the vocabulary,
            an id outside the vocabulary.
    """
    logits_shape = vocab_parallel_logits.shape[:-1]
    single = index.shape == logits_shape
    if not single and index.shape[:-1] != logits_shape:
        raise ValueError(f"index {tuple(index.shape)} must be the logits' shape without the vocabulary "
                         f"{tuple(logits_shape)}, optionally followed by a top-k dimension")
    if global_vocab_size is None:
        vocab_start_index, _, global_vocab_size = resolve_vocab_shard(
            vocab_parallel_logits.shape[-1], vocab_start_index, vocab_end_index, tp_group, vocab_parallel_logits.device)
    elif vocab_start_index is None or vocab_end_index is None:
        raise ValueError("global_vocab_size needs explicit vocab_start_index and vocab_end_index")
    index = index.long()
    keep = index != ignore_index
    if bool((keep & ((index < 0) | (index >= global_vocab_size))).any()):
        raise ValueError(f"index holds ids outside the vocabulary [0, {global_vocab_size})")
    rows = index.reshape(-1, 1) if single else index.reshape(-1, index.shape[-1])
    out = _LogProbs.apply(vocab_parallel_logits, rows, tp_group, vocab_start_index, keep.reshape(rows.shape))
    return out.view(index.shape)


def vocab_parallel_entropy(vocab_parallel_logits: torch.Tensor, tp_group: Any = None) -> torch.Tensor:
    """The entropy (fp32) of each position's softmax over the split vocabulary."""
    return _Entropy.apply(vocab_parallel_logits, tp_group).view(vocab_parallel_logits.shape[:-1])


def vocab_parallel_kl_div(student_logits: torch.Tensor, teacher_logits: torch.Tensor, reverse: bool = False,
                          tp_group: Any = None) -> torch.Tensor:
    """Per-position KL divergence (fp32) of identically split student and teacher logits:
    ``KL(teacher || student)``, or ``KL(student || teacher)`` (mode-seeking, on-policy
    distillation's) with ``reverse``. Apply any temperature to both first; gradients reach the
    teacher's logits too unless they are detached. A token one side masks to ``-inf`` where the
    other has probability makes the KL ``+inf``, as ``torch.nn.functional.kl_div``.

    Raises:
        ValueError: the two logits' shapes differ.
    """
    if student_logits.shape != teacher_logits.shape:
        raise ValueError(f"student_logits {tuple(student_logits.shape)} and teacher_logits "
                         f"{tuple(teacher_logits.shape)} must have the same shape and split")
    if reverse:
        kl = _KLDiv.apply(student_logits, teacher_logits, tp_group)
    else:  # the same divergence, its arguments (and their gradients) the other way round
        kl = _KLDiv.apply(teacher_logits, student_logits, tp_group)
    return kl.view(student_logits.shape[:-1])
