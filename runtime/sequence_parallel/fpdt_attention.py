"""FPDT attention (``deepspeed.sequence.fpdt_layer.FPDT_Attention`` and the two autograd functions
DeepSpeed's test calls, ``_FPDTGPUAttentionImpl_`` and ``_FPDTGPUOffloadingAttentionImpl_``).

A rank holds ``l`` tokens in FPDT's layout (``fpdt_input.py``), sequence first ``[l, b, hidden]``.
The sequence is processed in ``n`` chunks of ``l / n`` local tokens: per chunk the QKV projection,
one Ulysses all-to-all per tensor (``layout.py``: whole chunk of ``P * l / n`` positions, ``1/P`` of
the heads), rotary embeddings at the chunk's global positions, then causal attention over the key
chunks ``0..i`` merged with an online softmax (``fpdt_blocks.py``). Only chunk-sized projections
exist at once; the backward recomputes scores block by block from the saved ``q, k, v``, output
and log-sum-exp, as flash-attention does, and finishes chunk ``j``'s projection gradients as soon
as its last block is done.

The offloading variant keeps the saved chunks (``q, k, v``, outputs, log-sum-exps, the input and
the running ``dq``) in host memory and brings one to the compute device when a block needs it.

Limitations: attention dropout must be 0 and ``attention_mask`` ``None`` (causal only, as
DeepSpeed asserts); copies to and from the host are synchronous (DeepSpeed overlaps them on side
streams); on a CPU-only machine the "offload" is a copy within host memory.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch

from dslaunch.errors import UsageError
from dslaunch.runtime.sequence_parallel.fpdt_blocks import (
    block_attention,
    block_attention_backward,
    rotary,
    rotary_backward,
    update_out_and_lse,
)
from dslaunch.runtime.sequence_parallel.layout import kv_replication, replicate_kv_heads, seq_all_to_all

__all__ = ["FPDT_Attention", "_FPDTGPUAttentionImpl_", "_FPDTGPUOffloadingAttentionImpl_"]

_HEADS, _SEQ = 2, 1  # of the [b, s, h, d] chunks the all-to-alls move


@dataclass(frozen=True)
class _Shape:
    """The head geometry of one call."""

    projection: int  # query features (heads * head_dim)
    kv_projection: int  # key (and value) features
    head_dim: int
    kv_factor: int  # each key/value head repeated this often so the ranks split whole groups


class _Chunks:
    """Saved per-chunk tensors, on the compute device or (offloading) in host memory."""

    def __init__(self, offload: bool, device: torch.device) -> None:
        self.offload, self.device, self.items = offload, device, []

    def put(self, t: torch.Tensor) -> None:
        self.items.append(t.to("cpu") if self.offload else t)

    def set(self, i: int, t: torch.Tensor) -> None:
        self.items[i] = t.to("cpu") if self.offload else t

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.items[i].to(self.device)


def _check(attention_mask: Any, dropout: float, scatter_idx: int, gather_idx: int, rows: int, chunks: int) -> None:
    if attention_mask is not None:
        raise UsageError("FPDT attention is causal and takes no attention_mask; pass None")
    if dropout:
        raise UsageError(f"FPDT attention: attention_dropout={dropout} is not supported; set it to 0")
    if scatter_idx != _HEADS or gather_idx not in (0, 1):
        raise UsageError(f"FPDT attention: scatter_idx={scatter_idx}, gather_idx={gather_idx}; FPDT splits heads "
                         "(scatter_idx=2) and gathers the sequence (gather_idx=0)")
    if chunks < 1 or rows % chunks:
        raise UsageError(f"FPDT attention: {rows} local tokens do not split into {chunks} chunks; the sequence "
                         "must be a multiple of the FPDT chunk size")


def _split_heads(t: torch.Tensor, head_dim: int) -> torch.Tensor:
    """``[c, b, n * d]`` to ``[b, c, n, d]``."""
    return t.unflatten(-1, (-1, head_dim)).transpose(0, 1)


def _rope_tables(rotary_pos_emb: Any) -> tuple[torch.Tensor, torch.Tensor] | None:
    if rotary_pos_emb is None:
        return None
    # Megatron's [s, 1, 1, d] tables, batch axis first like the chunks: [1, s, 1, d]
    return rotary_pos_emb[0].permute(1, 0, 2, 3), rotary_pos_emb[1].permute(1, 0, 2, 3)


def _forward(ctx: Any, x: torch.Tensor, attention_mask: Any, rotary_pos_emb: Any, spg: Any, scatter_idx: int,
             gather_idx: int, projection_size: int, head_dim: int, kv_projection_size: int, weight: torch.Tensor,
             bias: torch.Tensor | None, dropout: float, num_chunks: int, offload: bool) -> torch.Tensor:
    import torch.distributed as dist

    _check(attention_mask, dropout, scatter_idx, gather_idx, x.shape[0], num_chunks)
    ranks = dist.get_world_size(spg)
    shape = _Shape(projection_size, kv_projection_size, head_dim,
                   kv_replication(projection_size // head_dim, kv_projection_size // head_dim, ranks))
    tables, scale = _rope_tables(rotary_pos_emb), head_dim ** -0.5
    saved = {name: _Chunks(offload, x.device) for name in ("x", "q", "k", "v", "out", "lse")}
    outputs = []
    for i, rows in enumerate(x.chunk(num_chunks)):
        qkv = torch.nn.functional.linear(rows, weight, bias)
        q, k, v = (_split_heads(t, head_dim) for t in qkv.split([projection_size, kv_projection_size,
                                                                   kv_projection_size], dim=-1))
        q = seq_all_to_all(q.contiguous(), spg, _HEADS, _SEQ)
        k, v = (seq_all_to_all(replicate_kv_heads(t, shape.kv_factor, _HEADS).contiguous(), spg, _HEADS, _SEQ)
                for t in (k, v))
        if tables is not None:
            span = slice(q.shape[1] * i, q.shape[1] * (i + 1))
            q, k = (rotary(t, tables[0][:, span], tables[1][:, span]) for t in (q, k))
        for name, t in (("x", rows), ("q", q), ("k", k), ("v", v)):
            saved[name].put(t)
        out = lse = None
        for j in range(i + 1):
            keys, values = (k, v) if j == i else (saved["k"][j], saved["v"][j])
            out, lse = update_out_and_lse(out, lse, *block_attention(q, keys, values, scale, causal=j == i))
        saved["out"].put(out)
        saved["lse"].put(lse[..., 0].transpose(1, 2))
        outputs.append(seq_all_to_all(out.to(x.dtype), spg, _SEQ, _HEADS))
    ctx.saved, ctx.shape, ctx.tables, ctx.spg = saved, shape, tables, spg
    ctx.weight, ctx.bias, ctx.num_chunks, ctx.offload = weight, bias, num_chunks, offload
    return torch.cat(outputs, dim=1)


def _chunk_projection_grads(ctx: Any, i: int, dq: torch.Tensor, dk: torch.Tensor,
                            dv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Chunk ``i``'s finished head-layout ``dq, dk, dv`` back to the sequence layout, through the
    rotary embedding and the QKV projection: ``(d_x, d_weight, d_bias)`` of the chunk."""
    shape, spg = ctx.shape, ctx.spg
    if ctx.tables is not None:
        span = slice(dq.shape[1] * i, dq.shape[1] * (i + 1))
        dq, dk = (rotary_backward(t, ctx.tables[0][:, span], ctx.tables[1][:, span]) for t in (dq, dk))
    dtype = ctx.saved["x"].items[i].dtype
    dq = seq_all_to_all(dq.to(dtype).contiguous(), spg, _SEQ, _HEADS)
    dk, dv = (seq_all_to_all(t.to(dtype).contiguous(), spg, _SEQ, _HEADS) for t in (dk, dv))
    if shape.kv_factor > 1:  # the copies of a replicated head each got a share of its gradient
        dk, dv = (t.unflatten(_HEADS, (-1, shape.kv_factor)).sum(_HEADS + 1) for t in (dk, dv))
    d_qkv = torch.cat([t.transpose(0, 1).flatten(2) for t in (dq, dk, dv)], dim=-1)  # [c, b, features]
    rows = ctx.saved["x"][i]
    flat = d_qkv.reshape(-1, d_qkv.shape[-1]).float()
    d_weight = flat.t() @ rows.reshape(-1, rows.shape[-1]).float()
    return (d_qkv @ ctx.weight).to(rows.dtype), d_weight, flat.sum(0)


def _backward(ctx: Any, grad_output: torch.Tensor) -> tuple[Any, ...]:
    saved, spg, n = ctx.saved, ctx.spg, ctx.num_chunks
    scale = ctx.shape.head_dim ** -0.5
    d_out = _Chunks(ctx.offload, grad_output.device)
    for rows in grad_output.chunk(n, dim=1):
        d_out.put(seq_all_to_all(rows.contiguous(), spg, _HEADS, _SEQ))
    dq = _Chunks(ctx.offload, grad_output.device)
    for i in range(n):
        dq.put(torch.zeros(saved["q"].items[i].shape, dtype=torch.float32, device=grad_output.device))
    d_x = []
    d_weight = torch.zeros(ctx.weight.shape, dtype=torch.float32, device=ctx.weight.device)
    d_bias = torch.zeros(ctx.weight.shape[0], dtype=torch.float32, device=ctx.weight.device)
    for j in range(n):  # key/value chunk j: every query chunk at or after it
        k, v = saved["k"][j], saved["v"][j]
        dk = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
        dv = torch.zeros_like(dk)
        for i in range(j, n):
            dq_i, dk_i, dv_i = block_attention_backward(d_out[i], saved["q"][i], k, v, saved["out"][i],
                                                        saved["lse"][i], scale, causal=i == j)
            dq.set(i, dq[i] + dq_i)
            dk += dk_i
            dv += dv_i
        # chunk j has had its last block (its diagonal): all three of its gradients are final
        dx_j, dw_j, db_j = _chunk_projection_grads(ctx, j, dq[j], dk, dv)
        d_x.append(dx_j)
        d_weight += dw_j
        d_bias += db_j
    weight_grad = d_weight.to(ctx.weight.dtype) if ctx.needs_input_grad[11] else None
    bias_grad = (d_bias.to(ctx.bias.device, ctx.bias.dtype)
                 if ctx.bias is not None and ctx.needs_input_grad[12] else None)
    return (torch.cat(d_x, dim=0), *[None] * 10, weight_grad, bias_grad, None, None, None)


def _apply_forward(ctx: Any, layernorm_output: torch.Tensor, attention_mask: Any, inference_params: Any,
                   rotary_pos_emb: Any, spg: Any, scatter_idx: int, gather_idx: int, hidden_size: int,
                   projection_size: int, hidden_size_per_attention_head: int, kv_projection_size: int,
                   qkv_linear_weight: torch.Tensor, qkv_linear_bias: torch.Tensor | None, dropout: float,
                   num_chunks: int = 8, cpu_offloading: bool = True, *, offload: bool) -> torch.Tensor:
    # DeepSpeed's argument list; the class picks ``offload``, whatever ``cpu_offloading`` says
    return _forward(ctx, layernorm_output, attention_mask, rotary_pos_emb, spg, scatter_idx, gather_idx,
                    projection_size, hidden_size_per_attention_head, kv_projection_size, qkv_linear_weight,
                    qkv_linear_bias, dropout, num_chunks, offload=offload)


class _FPDTGPUAttentionImpl_(torch.autograd.Function):
    """FPDT's chunked attention with the saved chunks kept on the compute device.

    ``apply(layernorm_output, attention_mask, inference_params, rotary_pos_emb, spg, scatter_idx,
    gather_idx, hidden_size, projection_size, hidden_size_per_attention_head, kv_projection_size,
    qkv_linear_weight, qkv_linear_bias, dropout, num_chunks=8, cpu_offloading=True)``, DeepSpeed's
    arguments: ``layernorm_output`` is ``[l, b, hidden]`` in FPDT's layout, the result
    ``[b, l, heads, head_dim]``. ``rotary_pos_emb`` is ``(cos, sin)`` over the global sequence
    (``[S, 1, 1, rot_dim]`` each) or ``None``.

    collective: forward and backward on every rank of ``spg``.
    """

    forward = staticmethod(functools.partial(_apply_forward, offload=False))
    backward = staticmethod(_backward)


class _FPDTGPUOffloadingAttentionImpl_(torch.autograd.Function):
    """``_FPDTGPUAttentionImpl_`` with the saved chunks in host memory between uses (same
    arguments and result).

    collective: forward and backward on every rank of ``spg``.
    """

    forward = staticmethod(functools.partial(_apply_forward, offload=True))
    backward = staticmethod(_backward)


class FPDT_Attention(torch.nn.Module):
    """Megatron's self-attention block as FPDT: QKV projection, chunked Ulysses attention, output
    projection.

    Args:
        config: has ``kv_channels``, ``num_attention_heads``, ``num_key_value_heads``,
            ``hidden_size`` and ``attention_dropout`` (Megatron's transformer config).
        first_weight: the QKV projection ``[q + 2 * kv features, hidden]``.
        first_bias: its bias or ``None``.
        second_weight: the output projection ``[hidden, q features]``.
        second_bias: its bias.
        sequence_process_group: the sequence-parallel group.
        gather_idx: DeepSpeed's; the sequence (0).
        scatter_idx: DeepSpeed's; the heads (2).
        return_bias: return the output bias apart, unadded (Megatron's skip-bias-add).
        chunk_size: the global tokens per attention chunk (``ds_sequence_parallel_fpdt_chunk_size``).
        enable_offloading: DeepSpeed's (its double buffering); ``forward``'s ``cpu_offloading`` picks.

    collective: forward and backward on every rank of the sequence group.
    """

    def __init__(self, config: Any, first_weight: torch.Tensor, first_bias: torch.Tensor | None,
                 second_weight: torch.Tensor, second_bias: torch.Tensor | None, sequence_process_group: Any,
                 gather_idx: int = 0, scatter_idx: int = 2, return_bias: bool = True, chunk_size: int = 65536,
                 enable_offloading: bool = True) -> None:
        super().__init__()
        self.spg, self.scatter_idx, self.gather_idx, self.config = sequence_process_group, scatter_idx, gather_idx, config
        self.projection_size = config.kv_channels * config.num_attention_heads
        self.hidden_size_per_attention_head = self.projection_size // config.num_attention_heads
        self.kv_projection_size = config.kv_channels * config.num_key_value_heads
        self.hidden_size = config.hidden_size
        self.qkv_linear_weight, self.qkv_linear_bias = first_weight, first_bias
        self.qkv_dense_weight, self.qkv_dense_bias = second_weight, second_bias
        self.reture_bias = return_bias  # DeepSpeed's spelling: callers may read it
        self.dropout, self.chunk_size, self.double_buffer = config.attention_dropout, chunk_size, enable_offloading

    def forward(self, layernorm_output: torch.Tensor, attention_mask: Any, inference_params: Any,
                rotary_pos_emb: Any, cpu_offloading: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(output [l, b, hidden], bias or None)`` for this rank's ``[l, b, hidden]`` input.

        Raises:
            UsageError: the local tokens times the ranks is not a multiple of ``chunk_size``, a mask
                or nonzero dropout is given.
        """
        import torch.distributed as dist

        total = layernorm_output.shape[0] * dist.get_world_size(self.spg)
        if total % self.chunk_size:
            raise UsageError(f"FPDT_Attention: the sequence ({total} tokens over the group) is not a multiple of "
                             f"chunk_size={self.chunk_size}")
        self.num_chunks_attn = total // self.chunk_size
        impl = _FPDTGPUOffloadingAttentionImpl_ if cpu_offloading and self.num_chunks_attn > 1 else _FPDTGPUAttentionImpl_
        output = impl.apply(layernorm_output, attention_mask, inference_params, rotary_pos_emb, self.spg,
                            self.scatter_idx, self.gather_idx, self.hidden_size, self.projection_size,
                            self.hidden_size_per_attention_head, self.kv_projection_size, self.qkv_linear_weight,
                            self.qkv_linear_bias, self.dropout, self.num_chunks_attn, cpu_offloading)
        output = output.flatten(2).transpose(0, 1) @ self.qkv_dense_weight.t()
        if not self.reture_bias and self.qkv_dense_bias is not None:
            output = output + self.qkv_dense_bias
        return output, self.qkv_dense_bias if self.reture_bias else None
