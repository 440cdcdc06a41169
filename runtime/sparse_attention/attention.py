"""``SparseSelfAttention`` and ``BertSparseSelfAttention``: attention through a block-sparse layout.

DeepSpeed's modules (``deepspeed.ops.sparse_attention``): scores ``q @ k^T`` only on the layout's
kept tiles (``MatMul`` sdd), the block-sparse ``Softmax`` with scale ``head_dim ** -0.5`` and the
masks, then the probabilities times ``v`` (``MatMul`` dsd). The layout is built once for
``max_seq_length`` (the ``master_layout`` buffer) and cut to each sequence length's top-left
corner; the first forward broadcasts it from rank 0 when torch.distributed is initialised (random
layouts differ per rank otherwise: collective, every rank's first forward).

Differences from DeepSpeed: any float dtype (DeepSpeed asserts fp16), any device torch runs on
(DeepSpeed: CUDA with Triton), and each module keeps its own ops per sequence length (DeepSpeed
shares one class-wide cache keyed by length only, so two modules of different layouts at one
length share the first one's ops).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from dslaunch.errors import SparsityConfigError
from dslaunch.kernels.block_sparse import MatMul, Softmax
from dslaunch.runtime.sparse_attention.layouts import FixedSparsityConfig, SparsityConfig

__all__ = ["SparseSelfAttention", "BertSparseSelfAttention"]


class SparseSelfAttention(nn.Module):
    """Block-sparse self-attention of ``[batch, heads, seq, head_dim]`` queries, keys and values.

    Args:
        sparsity_config: the layout (a ``SparsityConfig`` subclass); its ``num_heads`` must be
            the heads of the inputs when ``different_layout_per_head`` is set.
        key_padding_mask_mode: ``"add"`` (the mask is added, e.g. -10000 at padding) or ``"mul"``
            (0 marks padding).
        attn_mask_mode: ``"mul"`` (0 marks a masked pair) or ``"add"``.
        max_seq_length: the longest sequence the module will see (size of ``master_layout``).

    Raises:
        SparsityConfigError: no layout (``SparsityConfig`` itself has none) or a bad mode.
    """

    def __init__(self, sparsity_config: SparsityConfig | None = None, key_padding_mask_mode: str = "add",
                 attn_mask_mode: str = "mul", max_seq_length: int = 2048):
        super().__init__()
        self.sparsity_config = SparsityConfig(num_heads=4) if sparsity_config is None else sparsity_config
        for name, mode in (("key_padding_mask_mode", key_padding_mask_mode), ("attn_mask_mode", attn_mask_mode)):
            if mode not in ("add", "mul"):
                raise SparsityConfigError(f"{name}={mode!r}: must be 'add' or 'mul'")
        self.register_buffer("master_layout", self.sparsity_config.make_layout(max_seq_length))
        self._need_layout_synchronization = True
        self.key_padding_mask_mode = key_padding_mask_mode
        self.attn_mask_mode = attn_mask_mode
        self.ops: dict[int, tuple[MatMul, MatMul, Softmax]] = {}

    def get_layout(self, L: int) -> torch.Tensor:  # noqa: N803 (DeepSpeed's name)
        """The layout for sequence length ``L`` (on CPU); synchronised from rank 0 on first use.

        Raises:
            SparsityConfigError: ``L`` is not a multiple of the block size or over ``max_seq_length``.
        """
        if self._need_layout_synchronization and dist.is_available() and dist.is_initialized():
            dist.broadcast(self.master_layout, src=0)
            self._need_layout_synchronization = False
        block = self.sparsity_config.block
        if L % block != 0:
            raise SparsityConfigError(f"sequence length {L} is not a multiple of the block size {block}; pad it "
                                      "(SparseAttentionUtils.pad_to_block_size)")
        if L // block > self.master_layout.shape[-1]:
            raise SparsityConfigError(f"sequence length {L} is over max_seq_length "
                                      f"{self.master_layout.shape[-1] * block}; raise max_seq_length")
        return self.master_layout[..., :L // block, :L // block].cpu()

    def get_ops(self, H: int, L: int) -> tuple[MatMul, MatMul, Softmax]:  # noqa: N803 (DeepSpeed's names)
        """The (scores, context, softmax) ops for length ``L``, built on first use.

        Raises:
            SparsityConfigError: the layout's heads are not ``H``.
        """
        if L not in self.ops:
            layout = self.get_layout(L)
            if layout.shape[0] != H:
                raise SparsityConfigError(f"the inputs have {H} heads but the sparsity config has num_heads="
                                          f"{layout.shape[0]}; make them equal")
            block = self.sparsity_config.block
            self.ops[L] = (MatMul(layout, block, "sdd", trans_a=False, trans_b=True),
                           MatMul(layout, block, "dsd", trans_a=False, trans_b=False),
                           Softmax(layout, block))
        return self.ops[L]

    def transpose_key_for_scores(self, x: torch.Tensor, L: int) -> torch.Tensor:  # noqa: N803
        """Keys given as ``[batch, heads, head_dim, seq]`` turned to ``[batch, heads, seq, head_dim]``."""
        return x.permute(0, 1, 3, 2) if x.size(2) != L else x

    def transpose_mask_for_sparse(self, qtype: torch.dtype, x: torch.Tensor,
                                  is_key_padding_mask: bool = False) -> torch.Tensor:
        """A mask in the queries' dtype, with its singleton dimensions dropped (a key padding mask
        keeps its batch dimension: ``[batch, 1, 1, seq]`` -> ``[batch, seq]``)."""
        x = x.type(qtype)
        if is_key_padding_mask:
            for d in range(x.dim() - 1, 0, -1):
                x = x.squeeze(dim=d)
            return x
        return x.squeeze()

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, rpe: torch.Tensor | None = None,
                key_padding_mask: torch.Tensor | None = None, attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Attention context ``[batch, heads, seq, head_dim]``.

        Args:
            query: ``[batch, heads, seq, head_dim]``.
            key: the same shape (or ``[batch, heads, head_dim, seq]``).
            value: the same shape as ``query``.
            rpe: relative position embedding ``[batch, heads, seq, seq]``, added to the scores.
            key_padding_mask: ``[batch, seq]`` (or with singleton dimensions, e.g. ``[batch, 1, 1, seq]``).
            attn_mask: ``[seq, seq]``.

        Returns:
            The context, in the queries' dtype.

        Raises:
            SparsityConfigError: cross-attention (shapes differ) or lengths the layout cannot take.
        """
        _, num_heads, tgt_len, head_dim = query.size()
        key = self.transpose_key_for_scores(key, tgt_len)
        if query.shape != key.shape or key.shape != value.shape:
            raise SparsityConfigError(f"self-attention only: query {tuple(query.shape)}, key {tuple(key.shape)} and "
                                      f"value {tuple(value.shape)} must have one shape")
        if key_padding_mask is not None:
            key_padding_mask = self.transpose_mask_for_sparse(query.dtype, key_padding_mask, is_key_padding_mask=True)
        if attn_mask is not None:
            attn_mask = self.transpose_mask_for_sparse(query.dtype, attn_mask)
        scores_op, context_op, softmax = self.get_ops(num_heads, tgt_len)
        probs = softmax(scores_op(query, key), scale=float(head_dim) ** -0.5, rpe=rpe,
                        key_padding_mask=key_padding_mask, attn_mask=attn_mask,
                        key_padding_mask_mode=self.key_padding_mask_mode, attn_mask_mode=self.attn_mask_mode)
        return context_op(probs, value)


class BertSparseSelfAttention(nn.Module):
    """A BERT self-attention layer (query, key and value projections) with block-sparse attention.

    Args:
        config: a BERT config (``hidden_size``, ``num_attention_heads``).
        sparsity_config: the layout; default ``FixedSparsityConfig(num_heads=4)`` as in DeepSpeed.

    Raises:
        SparsityConfigError: ``hidden_size`` is not a multiple of ``num_attention_heads``.
    """

    def __init__(self, config: Any, sparsity_config: SparsityConfig | None = None):
        super().__init__()
        if config.hidden_size % config.num_attention_heads != 0:
            raise SparsityConfigError(f"hidden_size {config.hidden_size} is not a multiple of num_attention_heads "
                                      f"{config.num_attention_heads}")
        self.num_attention_heads = config.num_attention_heads
        self.attention_head_size = config.hidden_size // config.num_attention_heads
        self.all_head_size = self.num_attention_heads * self.attention_head_size
        self.query = nn.Linear(config.hidden_size, self.all_head_size)
        self.key = nn.Linear(config.hidden_size, self.all_head_size)
        self.value = nn.Linear(config.hidden_size, self.all_head_size)
        layout = FixedSparsityConfig(num_heads=4) if sparsity_config is None else sparsity_config
        self.sparse_self_attention = SparseSelfAttention(layout)

    def transpose_for_scores(self, x: torch.Tensor) -> torch.Tensor:
        """``[batch, seq, hidden]`` -> ``[batch, heads, seq, head_size]``."""
        x = x.view(*x.size()[:-1], self.num_attention_heads, self.attention_head_size)
        return x.permute(0, 2, 1, 3)

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """The context ``[batch, seq, hidden]``.

        Args:
            hidden_states: ``[batch, seq, hidden]``, ``seq`` a multiple of the block size.
            attention_mask: the key padding mask, e.g. BERT's extended mask ``[batch, 1, 1, seq]``
                (added to the scores: 0 to keep, a large negative number at padding).

        Returns:
            The attention context, heads concatenated.
        """
        q, k, v = (self.transpose_for_scores(proj(hidden_states)) for proj in (self.query, self.key, self.value))
        context = self.sparse_self_attention(q, k, v, key_padding_mask=attention_mask)
        context = context.permute(0, 2, 1, 3).contiguous()
        return context.view(*context.size()[:-2], self.all_head_size)
