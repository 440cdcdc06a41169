"""``DistributedAttention``: DeepSpeed-Ulysses' attention over a sequence split between ranks.

Each rank of the sequence group holds ``1/P`` of the positions of ``query``, ``key`` and
``value`` (all heads). One all-to-all per tensor gives each rank the whole sequence for ``1/P``
of the heads; the local attention runs there unchanged (it sees the whole sequence, so causal
masks and softmax are exact); a last all-to-all returns the output to the sequence layout.

Layout, as DeepSpeed's: ``scatter_idx`` is the head dimension (2 for ``[b, s, h, d]`` or
``[s, b, h, d]``); the sequence dimension is ``1 - batch_dim_idx`` when ``forward`` is given
``batch_dim_idx`` (0: batch first, 1: sequence first), else ``gather_idx`` (DeepSpeed's older
calls, sequence first at ``gather_idx=0``). The output has the input's layout; an output whose
heads are merged into the last dimension (``[b, s, h*d]``) comes back the same way.
"""

from __future__ import annotations

from typing import Any

import torch

from dslaunch.errors import UsageError
from dslaunch.runtime.sequence_parallel.layout import kv_replication, replicate_kv_heads, seq_all_to_all

__all__ = ["DistributedAttention"]


class DistributedAttention(torch.nn.Module):
    """``local_attention(q, k, v, *args, **kwargs)`` on the whole sequence, for a sequence split over
    ``sequence_process_group``.

    Args:
        local_attention: attention over whole sequences, for the heads it is given. With fewer
            key/value heads than query heads it must handle the grouping itself (as
            ``scaled_dot_product_attention(enable_gqa=True)`` does).
        sequence_process_group: the ranks that split one sequence (``groups._get_sequence_parallel_group()``).
        scatter_idx: the head dimension of the inputs.
        gather_idx: the sequence dimension when ``forward`` gets no ``batch_dim_idx``.

    Key/value heads fewer than the group's ranks (or a count it does not divide) are repeated so
    each rank gets whole query groups (``layout.kv_replication``); the query heads must be a
    multiple of the group size.

    collective: ``forward`` and its backward on every rank of the sequence group.

    Limitations: DeepSpeed's ``rotary_pos_emb`` argument (Megatron's sequence-first rotary tables)
    and ``sp_stream`` overlap are not supported: apply rotary embeddings before this layer.
    """

    def __init__(self, local_attention: Any, sequence_process_group: Any, scatter_idx: int = 2,
                 gather_idx: int = 0, sp_stream: Any = None) -> None:
        super().__init__()
        if sp_stream is not None:
            raise UsageError("DistributedAttention(sp_stream=...): overlapping the all-to-alls on a side stream is "
                             "not supported; leave sp_stream out")
        self.local_attn = local_attention
        self.spg = sequence_process_group
        self.scatter_idx, self.gather_idx = scatter_idx, gather_idx

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, batch_dim_idx: int | None = None,
                rotary_pos_emb: Any = None, *args: Any, **kwargs: Any) -> Any:
        import torch.distributed as dist

        if rotary_pos_emb is not None:
            raise UsageError("DistributedAttention(rotary_pos_emb=...) is not supported: apply the rotary "
                             "embedding to query and key before the layer (on each rank's positions)")
        heads = self.scatter_idx
        seq = self.gather_idx if batch_dim_idx is None else 1 - batch_dim_idx
        ranks = dist.get_world_size(self.spg)
        factor = kv_replication(query.shape[heads], key.shape[heads], ranks)
        q = seq_all_to_all(query, self.spg, heads, seq)
        k, v = (seq_all_to_all(replicate_kv_heads(t, factor, heads), self.spg, heads, seq) for t in (key, value))
        context = self.local_attn(q, k, v, *args, **kwargs)
        # back to the sequence layout: split the sequence, complete the heads (a merged [.., h*d]
        # last dimension concatenates head blocks in the same order)
        return seq_all_to_all(context, self.spg, seq, min(heads, context.dim() - 1))
