"""Per-row cross-entropy in Triton (the ``"cross_entropy"`` op): one pass over a row's logits in
forward (an online max and sum of exponentials: the log-sum-exp, then the loss), one read and one
write in backward (``(softmax - one-hot) * scale`` straight into the logits' dtype). Memory: the
logits as given and one fp32 log-sum-exp per row; no fp32 ``[rows, vocab]`` tensor.

Limitations: ``logits`` must be contiguous ``[rows, vocab]`` (the caller makes them so); no second
derivative.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

__all__ = ["cross_entropy_rows"]

_BLOCK = 1024


@triton.jit
def _forward_kernel(LOGITS, TARGET, LSE, LOSS, vocab, ignore_index, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = LOGITS + row * vocab
    peak = float("-inf")
    total = 0.0
    for lo in range(0, vocab, BLOCK):
        cols = lo + tl.arange(0, BLOCK)
        x = tl.load(base + cols, mask=cols < vocab, other=float("-inf")).to(tl.float32)
        new_peak = tl.maximum(peak, tl.max(x, axis=0))
        total = total * tl.exp(peak - new_peak) + tl.sum(tl.exp(x - new_peak), axis=0)
        peak = new_peak
    lse = peak + tl.log(total)
    tl.store(LSE + row, lse)
    target = tl.load(TARGET + row)
    counted = target != ignore_index
    picked = tl.load(base + tl.where(counted, target, 0)).to(tl.float32)
    tl.store(LOSS + row, tl.where(counted, lse - picked, 0.0))


@triton.jit
def _backward_kernel(LOGITS, TARGET, LSE, SCALE, GRAD, vocab, ignore_index, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    target = tl.load(TARGET + row)
    scale = tl.load(SCALE + row)
    scale = tl.where(target != ignore_index, scale, 0.0)
    lse = tl.load(LSE + row)
    for lo in range(0, vocab, BLOCK):
        cols = lo + tl.arange(0, BLOCK)
        inside = cols < vocab
        x = tl.load(LOGITS + row * vocab + cols, mask=inside, other=0.0).to(tl.float32)
        g = (tl.exp(x - lse) - tl.where(cols == target, 1.0, 0.0)) * scale
        tl.store(GRAD + row * vocab + cols, g.to(GRAD.dtype.element_ty), mask=inside)


class _TritonCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, target: torch.Tensor, ignore_index: int) -> torch.Tensor:
        rows, vocab = logits.shape
        lse = logits.new_empty(rows, dtype=torch.float32)
        loss = torch.empty_like(lse)
        if rows:
            _forward_kernel[(rows,)](logits, target, lse, loss, vocab, ignore_index, BLOCK=_BLOCK)
        ctx.save_for_backward(logits, target, lse)
        ctx.ignore_index = ignore_index
        return loss

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        if torch.is_grad_enabled():
            raise RuntimeError("the chunked cross-entropy has no second derivative (backward with create_graph)")
        logits, target, lse = ctx.saved_tensors
        out = torch.empty_like(logits)
        rows, vocab = logits.shape
        if rows:
            _backward_kernel[(rows,)](logits, target, lse, grad.float().contiguous(), out, vocab, ctx.ignore_index,
                                      BLOCK=_BLOCK)
        return out, None, None


def cross_entropy_rows(logits: torch.Tensor, target: torch.Tensor, ignore_index: int = -100,
                       block_rows: int | None = None) -> torch.Tensor:
    """The ``"cross_entropy"`` op (``block_rows`` is the torch reference's and is ignored here)."""
    return _TritonCrossEntropy.apply(logits.contiguous(), target.contiguous(), ignore_index)
