"""The per-block math of FPDT's chunked causal attention: one query chunk against one key/value
chunk, forward (output and log-sum-exp) and backward, the online-softmax merge of blocks
(``update_out_and_lse``) and rotary embeddings with their transpose.

DeepSpeed calls flash-attn's private kernels here, which exist only on a GPU; these are plain
torch in float32 (matmuls, one block of scores at a time), so FPDT runs on any device. Tensors are
``[b, s, h, d]`` (flash-attn's layout); log-sum-exps are ``[b, h, s]``. Key/value heads fewer than
query heads (grouped-query attention) are expanded for the block and their gradients summed back.
"""

from __future__ import annotations

import torch

__all__ = ["block_attention", "block_attention_backward", "update_out_and_lse", "rotary", "rotary_backward"]


def _expand(kv: torch.Tensor, heads: int) -> torch.Tensor:
    return kv if kv.shape[2] == heads else kv.repeat_interleave(heads // kv.shape[2], dim=2)


def _probabilities(q: torch.Tensor, k: torch.Tensor, scale: float, causal: bool,
                   lse: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax probabilities ``[b, h, sq, sk]`` and the log-sum-exp ``[b, h, sq]`` (``lse`` given: the
    probabilities normalised by it instead, as the backward needs)."""
    scores = torch.einsum("bqhd,bkhd->bhqk", q.float(), _expand(k, q.shape[2]).float()) * scale
    if causal:
        # the diagonal block: query t sees keys 0..t of the block (both chunks start together)
        hidden = torch.ones(q.shape[1], k.shape[1], dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(hidden, float("-inf"))
    if lse is None:
        lse = torch.logsumexp(scores, dim=-1)
    return torch.exp(scores - lse.unsqueeze(-1)), lse


def block_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                    causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of query block ``q`` over key/value block ``k, v`` alone.

    Args:
        q: ``[b, sq, h, d]``.
        k: ``[b, sk, hk, d]``; ``hk`` divides ``h``.
        v: like ``k``.
        scale: the softmax scale (``d ** -0.5``).
        causal: the diagonal block (``sq == sk``, same positions): query ``t`` sees keys ``<= t``.

    Returns:
        The float32 output ``[b, sq, h, d]`` and log-sum-exp ``[b, h, sq]`` of the block.
    """
    probs, lse = _probabilities(q, k, scale, causal, None)
    return torch.einsum("bhqk,bkhd->bqhd", probs, _expand(v, q.shape[2]).float()), lse


def block_attention_backward(d_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                             out: torch.Tensor, lse: torch.Tensor, scale: float,
                             causal: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One block's share of the gradients of the whole (merged) attention output.

    Args:
        d_out: the gradient of the query chunk's final output, ``[b, sq, h, d]``.
        q, k, v: as for ``block_attention``.
        out: the query chunk's final output over every block (float32).
        lse: the query chunk's final log-sum-exp ``[b, h, sq]``.
        scale: the softmax scale.
        causal: the diagonal block.

    Returns:
        float32 ``dq`` ``[b, sq, h, d]``, ``dk`` and ``dv`` ``[b, sk, hk, d]`` from this block.
    """
    heads, groups = q.shape[2], q.shape[2] // k.shape[2]
    probs, _ = _probabilities(q, k, scale, causal, lse)
    d_out = d_out.float()
    dv = torch.einsum("bhqk,bqhd->bkhd", probs, d_out)
    d_probs = torch.einsum("bqhd,bkhd->bhqk", d_out, _expand(v, heads).float())
    # softmax backward with the row term sum_j P_ij dP_ij = sum_d dO * O (the final output)
    row = (d_out * out.float()).sum(-1).transpose(1, 2).unsqueeze(-1)
    d_scores = probs * (d_probs - row) * scale
    dq = torch.einsum("bhqk,bkhd->bqhd", d_scores, _expand(k, heads).float())
    dk = torch.einsum("bhqk,bqhd->bkhd", d_scores, q.float())
    if groups > 1:
        dk, dv = (t.unflatten(2, (k.shape[2], groups)).sum(3) for t in (dk, dv))
    return dq, dk, dv


def update_out_and_lse(out: torch.Tensor | None, lse: torch.Tensor | None, block_out: torch.Tensor,
                       block_lse: torch.Tensor, slice_: object = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge one block's attention into the running output of a query chunk (online softmax).

    Args:
        out: the running float32 output ``[b, s, h, d]``, ``None`` for the first block.
        lse: the running log-sum-exp, ``[b, s, h, 1]`` (DeepSpeed's layout), ``None`` at first.
        block_out: the block's output ``[b, s, h, d]``.
        block_lse: the block's log-sum-exp ``[b, h, s]``.
        slice_: an index into ``out``/``lse`` to merge into (not with the first block).

    Returns:
        The merged ``(out, lse)``.

    Raises:
        ValueError: ``slice_`` with the first block.
    """
    block_lse = block_lse.transpose(1, 2).unsqueeze(-1).float()
    if out is None or lse is None:
        if slice_ is not None:
            raise ValueError("update_out_and_lse: the first block cannot name a slice_ (there is nothing to merge into)")
        return block_out.float(), block_lse.contiguous()

    def merge(o: torch.Tensor, m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # logaddexp rather than lse + log1p(exp(.)): exact when a running row is still empty (-inf)
        merged = torch.logaddexp(m, block_lse)
        return torch.exp(m - merged) * o + torch.exp(block_lse - merged) * block_out.float(), merged

    if slice_ is None:
        return merge(out, lse)
    out[slice_], lse[slice_] = merge(out[slice_], lse[slice_])
    return out, lse


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def _rotate_half_transposed(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((second, -first), dim=-1)


def rotary(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of the first ``cos.shape[-1]`` features of ``t`` (the rest pass through):
    ``t * cos + rotate_half(t) * sin``, halves rotated as Megatron's (and DeepSpeed's) tables expect."""
    width = cos.shape[-1]
    rotated = t[..., :width] * cos + _rotate_half(t[..., :width]) * sin
    return torch.cat((rotated, t[..., width:]), dim=-1)


def rotary_backward(grad: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The gradient of ``rotary``'s input from its output's (the rotation's transpose)."""
    width = cos.shape[-1]
    rotated = grad[..., :width] * cos + _rotate_half_transposed(grad[..., :width] * sin)
    return torch.cat((rotated, grad[..., width:]), dim=-1)
