"""FPDT's chunked MLP and LM-head loss (``deepspeed.sequence.fpdt_layer.FPDT_FFN`` and
``FPDT_LogitsLoss``).

Both run a long local sequence ``[l, b, hidden]`` a chunk of rows at a time, so the ``[l, b, ffn]``
intermediate or the ``[l, b, vocab]`` logits never exist whole; their backward recomputes one
chunk's activations and differentiates it (activation checkpointing per chunk), accumulating the
weight gradients in float32.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from dslaunch.errors import UsageError
from dslaunch.runtime.sequence_parallel.loss import own_rows_summed

__all__ = ["FPDT_FFN", "FPDT_LogitsLoss"]


def _chunks(rows: int, count: int, what: str) -> None:
    if count < 1 or rows % count:
        raise UsageError(f"{what}: {rows} local tokens do not split into {count} equal chunks")


def _rows_per_chunk(rows: int, size: int) -> None:
    if size < 1 or rows % size:
        raise UsageError(f"FPDT_FFN: {rows} local tokens are not a multiple of chunk_size={size}")


def _mlp(x: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor, w2: torch.Tensor, b2: torch.Tensor | None) -> torch.Tensor:
    # Megatron's bias-gelu is the tanh approximation
    return F.linear(F.gelu(F.linear(x, w1, b1), approximate="tanh"), w2, b2)


def _leaf(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.detach().requires_grad_()


class FPDT_FFN(torch.autograd.Function):
    """``gelu(x @ w1.T + b1) @ w2.T (+ b2)`` over ``[l, b, hidden]`` rows, ``chunk_size`` rows at a time.

    ``apply(x, w1, b1, w2, b2, add_bias, chunk_size)`` returns ``(result, b2)`` with ``add_bias``
    false (the caller adds it, Megatron's skip-bias-add) and ``(result + b2, None)`` with it true.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor, w2: torch.Tensor, b2: torch.Tensor,
                add_bias: bool, chunk_size: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        _rows_per_chunk(x.shape[0], chunk_size)
        out_bias = b2 if add_bias else None
        result = torch.cat([_mlp(rows, w1, b1, w2, out_bias) for rows in x.split(chunk_size)])
        ctx.save_for_backward(x, w1, b1, w2, b2)
        ctx.add_bias, ctx.chunk_size = add_bias, chunk_size
        return result, (None if add_bias else b2)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor, grad_bias: torch.Tensor | None) -> tuple[Any, ...]:
        x, w1, b1, w2, b2 = ctx.saved_tensors
        weights = [_leaf(t) for t in (w1, b1, w2)]
        grads = [torch.zeros(t.shape, dtype=torch.float32, device=t.device) for t in (w1, b1, w2)]
        grad_x = torch.empty_like(x)
        with torch.enable_grad():
            for start in range(0, x.shape[0], ctx.chunk_size):
                rows = slice(start, start + ctx.chunk_size)
                chunk = _leaf(x[rows])
                out = _mlp(chunk, *weights[:2], weights[2], None)
                found = torch.autograd.grad(out, [chunk, *weights], grad_output[rows])
                grad_x[rows] = found[0]
                for total, part in zip(grads, found[1:], strict=True):
                    total += part
        # the bias of the result (added here) or of the returned bias (added by the caller)
        grad_b2 = grad_output.sum((0, 1)) if ctx.add_bias else grad_bias
        return (grad_x, *(g.to(t.dtype) for g, t in zip(grads, (w1, b1, w2), strict=True)),
                None if grad_b2 is None else grad_b2.to(b2.dtype), None, None)


class FPDT_LogitsLoss(torch.autograd.Function):
    """Per-token cross-entropy of the LM head over FPDT's sequence, gathered from every rank.

    ``apply(lm_output, labels, logit_weights, rank, spg_size, spg, num_chunk)``: ``lm_output`` is
    this rank's ``[l, b, hidden]``, ``labels`` its ``[b, l]``, ``logit_weights`` the ``[vocab,
    hidden]`` head. Returns the float32 losses ``[l * spg_size, b]``, rank 0's positions first (the
    loss-mask order of ``FPDT_InputConstruct``). The backward is the all-gather's: this rank's rows
    of the gradient summed over ``spg`` (``loss.own_rows_summed``), so a loss every rank reduces the
    same way leaves each rank ``spg_size`` times its share, which the engine's average over data x
    sequence makes the whole sequence's gradient (DeepSpeed keeps the rank's own rows: its engine
    sums over the sequence ranks).

    collective: forward on every rank of ``spg``.
    """

    @staticmethod
    def forward(ctx: Any, lm_output: torch.Tensor, labels: torch.Tensor, logit_weights: torch.Tensor, rank: int,
                spg_size: int, spg: Any, num_chunk: int) -> torch.Tensor:
        import torch.distributed as dist

        _chunks(lm_output.shape[0], num_chunk, "FPDT_LogitsLoss")
        labels = labels.t()
        with torch.no_grad():
            loss = torch.cat([_token_loss(rows, labels_chunk, logit_weights) for rows, labels_chunk in
                              zip(lm_output.chunk(num_chunk), labels.chunk(num_chunk), strict=True)])
        # the saved activations wait in host memory, as DeepSpeed's do
        ctx.save_for_backward(lm_output.to("cpu"), labels, logit_weights)
        ctx.group, ctx.num_chunk, ctx.device = spg if spg_size > 1 else None, num_chunk, lm_output.device
        if spg_size == 1:
            return loss
        parts = [torch.empty_like(loss) for _ in range(spg_size)]
        dist.all_gather(parts, loss.contiguous(), group=spg)
        return torch.cat(parts)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[Any, ...]:
        lm_output, labels, weights = ctx.saved_tensors
        grad_output = own_rows_summed(grad_output, lm_output.shape[0], ctx.group)
        head = _leaf(weights)
        grad_head = torch.zeros(weights.shape, dtype=torch.float32, device=weights.device)
        grad_lm = []
        with torch.enable_grad():
            for rows, labels_chunk, grad in zip(lm_output.chunk(ctx.num_chunk), labels.chunk(ctx.num_chunk),
                                                grad_output.chunk(ctx.num_chunk), strict=True):
                chunk = _leaf(rows.to(ctx.device))
                found = torch.autograd.grad(_token_loss(chunk, labels_chunk, head), [chunk, head], grad)
                grad_lm.append(found[0])
                grad_head += found[1]
        return torch.cat(grad_lm), None, grad_head.to(weights.dtype), None, None, None, None


def _token_loss(rows: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Cross-entropy ``[c, b]`` of ``[c, b, hidden]`` rows under the head, logits in float32."""
    logits = F.linear(rows, weights).float()
    return F.cross_entropy(logits.flatten(0, 1), labels.reshape(-1), reduction="none").view(labels.shape)
