"""The sharded replacements AutoTP puts where a ``Linear`` (or GPT-2's ``Conv1D``) was.

- ``ColumnParallelLinear``: this rank's output features (rows of the weight, and of the bias);
  no forward communication: its output stays split until the row-parallel layer that consumes it
  (in training, ``enter`` sums its input gradient over the group in the backward pass).
- ``RowParallelLinear``: this rank's input features; the partial products are summed over the
  tensor-parallel group by one all-reduce, then the (whole, replicated) bias is added once.
- ``VocabParallelLinear``: a column-parallel output layer whose slices of the logits are gathered,
  so every rank returns the whole vocabulary (and samples the same token).
- ``VocabParallelEmbedding``: this rank's rows of an embedding table; ids it does not hold give
  zeros and one all-reduce sums the partial embeddings. A tied output layer (GPT-2's ``lm_head``)
  is a ``VocabParallelLinear`` holding the same ``Parameter``: the shard is stored once.
- Weights may be stored as int8 with one fp32 scale per output row (``quant``): dequantized to the
  compute dtype in each forward (weight-only quantization: 1/4 of fp32's memory, same FLOPs).

Layout-invariant training (``pieces``, ``invariant.py``): the column and row layers compute in
fixed pieces and sum them in a fixed tree, the same bits at every degree.

Each takes exactly the input the layer it replaces takes, so the model's own forward code calls them unchanged.
The collectives are passed in (``collectives.py``): in place for inference, autograd functions with
their backward collectives for training (``trainable``: the parameters then require gradients).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from dslaunch.runtime.tensor_parallel.invariant import Pieces, column_linear, row_linear

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "VocabParallelLinear", "VocabParallelEmbedding",
           "quantize_int8"]

AllReduce = Callable[[torch.Tensor], torch.Tensor]


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row int8: ``weight ~= q * scale`` (scale = max |row| / 127, never 0)."""
    scale = weight.abs().amax(dim=1, keepdim=True).float().clamp_min(1e-12) / 127.0
    q = torch.round(weight.float() / scale).clamp_(-127, 127).to(torch.int8)
    return q, scale


class _ShardedLinear(nn.Module):
    """A weight ``[out_local, in]`` (or ``[out, in_local]``), optionally int8 with row scales. A
    ``Parameter`` passed as ``weight`` is kept as it is (shared with a tied embedding)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, quantize: bool, dtype: torch.dtype,
                 trainable: bool = False):
        super().__init__()
        self.compute_dtype = dtype
        if isinstance(weight, nn.Parameter):
            self.weight, self.weight_scale = weight, None
        elif quantize:
            q, scale = quantize_int8(weight)
            self.weight = nn.Parameter(q, requires_grad=False)
            self.register_buffer("weight_scale", scale)
        else:
            self.weight = nn.Parameter(weight.to(dtype), requires_grad=trainable)
            self.weight_scale = None
        self.bias = None if bias is None else nn.Parameter(bias.to(dtype), requires_grad=trainable)
        self.out_features, self.in_features = weight.shape

    def _weight(self) -> torch.Tensor:
        if self.weight_scale is None:
            return self.weight
        return (self.weight.to(torch.float32) * self.weight_scale).to(self.compute_dtype)

    def extra_repr(self) -> str:
        kind = "int8" if self.weight_scale is not None else str(self.compute_dtype).removeprefix("torch.")
        return f"in_features={self.in_features}, out_features={self.out_features}, {kind}"


class ColumnParallelLinear(_ShardedLinear):
    """``y_local = x @ W_local^T + b_local``: this rank's slice of the output features.

    ``enter`` (training): the identity whose backward sums the input gradient over the group;
    ``pieces`` (layout-invariant training, of the output features) does that sum itself.
    """

    gather_output = False  # DeepSpeed's LinearLayer attribute: the output stays split

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, quantize: bool, dtype: torch.dtype,
                 trainable: bool = False, enter: AllReduce | None = None, pieces: Pieces | None = None):
        super().__init__(weight, bias, quantize, dtype, trainable)
        self._enter, self._pieces = enter, pieces

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._pieces is not None:
            return column_linear(x, self._weight(), self.bias, self._pieces)
        x = x if self._enter is None else self._enter(x)
        return F.linear(x, self._weight(), self.bias)


class RowParallelLinear(_ShardedLinear):
    """``y = allreduce(x_local @ W_local^T) + b``: x arrives already split (a column layer's output).

    ``pieces`` (layout-invariant training, of the input features): the sum in a fixed tree.

    collective: every rank of the tensor-parallel group runs it, with inputs of the same shape.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, quantize: bool, dtype: torch.dtype,
                 all_reduce: AllReduce, trainable: bool = False, pieces: Pieces | None = None):
        super().__init__(weight, bias, quantize, dtype, trainable)
        self._all_reduce, self._pieces = all_reduce, pieces

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._pieces is not None:
            y = row_linear(x, self._weight(), self._pieces)
        else:
            y = self._all_reduce(F.linear(x, self._weight()))
        return y if self.bias is None else y + self.bias


class VocabParallelLinear(ColumnParallelLinear):
    """``y = gather(x @ W_local^T + b_local)`` over the last dimension: whole logits on every rank.

    collective: every rank of the tensor-parallel group runs it, with inputs of the same shape.
    """

    gather_output = True

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, quantize: bool, dtype: torch.dtype,
                 gather: Callable[[torch.Tensor], torch.Tensor], trainable: bool = False,
                 enter: AllReduce | None = None, pieces: Pieces | None = None):
        super().__init__(weight, bias, quantize, dtype, trainable, enter, pieces)
        self._gather = gather

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._gather(super().forward(x))


class VocabParallelEmbedding(nn.Module):
    """Rows ``[vocab_start, vocab_start + rows)`` of an ``nn.Embedding``: ``y = allreduce(E_local[ids])``
    with zeros for the ids held by other ranks (each id is on exactly one rank: the sum is exact).

    collective: every rank of the tensor-parallel group runs it, with the same ids.
    """

    def __init__(self, weight: nn.Parameter, vocab_start: int, num_embeddings: int, padding_idx: int | None,
                 all_reduce: AllReduce):
        super().__init__()
        self.weight = weight
        self.vocab_start, self.num_embeddings, self.padding_idx = vocab_start, num_embeddings, padding_idx
        self.embedding_dim = weight.shape[1]
        self._all_reduce = all_reduce

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.vocab_start
        elsewhere = (local < 0) | (local >= self.weight.shape[0])
        out = F.embedding(local.masked_fill(elsewhere, 0), self.weight)
        return self._all_reduce(out.masked_fill_(elsewhere.unsqueeze(-1), 0.0))

    def extra_repr(self) -> str:
        rows = self.weight.shape[0]
        return f"rows {self.vocab_start}..{self.vocab_start + rows} of {self.num_embeddings}, dim={self.embedding_dim}"
