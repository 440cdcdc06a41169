"""``TiledLinear``: one ``torch.nn.Linear`` as a grid of smaller ones (DeepSpeed's
``deepspeed.runtime.zero.tiling``).

Why: under ZeRO-3 a module's parameters are gathered whole for its forward; a huge linear layer
split into ``out_splits x in_splits`` tiles is gathered one tile at a time, so the peak memory is
one tile's, not the layer's. The output is the same: output rows ``out_parts[o]:out_parts[o+1]``
are the sum over ``i`` of tile ``[o][i]`` applied to input columns ``in_parts[i]:in_parts[i+1]``;
the bias lives in the last column of tiles. ``init_linear`` copies an existing layer's weights
into the tiles. Splits follow the pipeline's ``partition_uniform`` (the first parts one larger).

``TiledLinearReturnBias`` keeps the bias out of the tiles and returns ``(output, bias)`` for the
caller to add (Megatron's ``skip_bias_add`` style).
"""

from __future__ import annotations

from typing import Any

import torch

from dslaunch.runtime.pipe.module import partition_uniform

__all__ = ["TiledLinear", "TiledLinearReturnBias"]


class TiledLinear(torch.nn.Module):
    """Args:
        in_features, out_features, bias: as ``torch.nn.Linear``.
        in_splits, out_splits: tiles along the input and output features (1 to the feature count).
        input_is_already_split: ``forward`` takes a list of ``in_splits`` input chunks.
        combine_out_splits: concatenate the output chunks (False: return the list).
        linear_cls: the tile class (called as ``linear_cls(in, out, bias=..., **kwargs)``).
        init_linear: a ``torch.nn.Linear`` of the full size whose weights and bias the tiles copy.

    Raises:
        RuntimeError: a split count below 1 or above its feature count.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, in_splits: int = 1,
                 out_splits: int = 1, input_is_already_split: bool = False, combine_out_splits: bool = True,
                 linear_cls: Any = torch.nn.Linear, init_linear: torch.nn.Linear | None = None, **kwargs: Any):
        super().__init__()
        for name, splits, features in (("in_splits", in_splits, in_features), ("out_splits", out_splits,
                                                                                out_features)):
            if not 1 <= splits <= features:
                raise RuntimeError(f"TiledLinear: {name}={splits}, expected 1 to {features} (the feature count)")
        self.in_splits, self.out_splits = in_splits, out_splits
        self.input_is_already_split, self.combine_out_splits = input_is_already_split, combine_out_splits
        self.in_parts = partition_uniform(in_features, in_splits)
        self.out_parts = partition_uniform(out_features, out_splits)
        self.use_bias = bias
        self.linears = torch.nn.ModuleList(
            torch.nn.ModuleList(
                linear_cls(self.in_parts[i + 1] - self.in_parts[i], self.out_parts[o + 1] - self.out_parts[o],
                           bias=self._tile_bias(i), **kwargs)
                for i in range(in_splits))
            for o in range(out_splits))
        if init_linear is not None:
            self.copy_params_from(init_linear)

    def _tile_bias(self, in_id: int) -> bool:
        return self.use_bias and in_id == self.in_splits - 1

    @torch.no_grad()
    def copy_params_from(self, other: torch.nn.Linear) -> None:
        """Copy a full-size layer's weight (and bias) into the tiles."""
        for o, row in enumerate(self.linears):
            rows = slice(self.out_parts[o], self.out_parts[o + 1])
            for i, tile in enumerate(row):
                tile.weight.copy_(other.weight[rows, self.in_parts[i]:self.in_parts[i + 1]])
                if tile.bias is not None and other.bias is not None:
                    tile.bias.copy_(other.bias[rows])

    def _split_input(self, x: Any) -> list[torch.Tensor]:
        if self.input_is_already_split:
            if len(x) != self.in_splits:
                raise ValueError(f"TiledLinear: {len(x)} input chunks, expected in_splits={self.in_splits}")
            return list(x)
        return [x[..., self.in_parts[i]:self.in_parts[i + 1]] for i in range(self.in_splits)]

    def forward(self, x: Any) -> Any:
        chunks = self._split_input(x)
        outs = [sum(tile(chunk) for tile, chunk in zip(row, chunks, strict=True)) for row in self.linears]
        return torch.cat(outs, dim=-1) if self.combine_out_splits else outs


class TiledLinearReturnBias(TiledLinear):
    """``TiledLinear`` whose ``forward`` returns ``(output, bias)``: the tiles have no bias, the
    layer's bias (None without one) is returned for the caller to add."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, **kwargs: Any):
        super().__init__(in_features, out_features, bias=bias, **kwargs)
        self.bias = torch.nn.Parameter(torch.zeros(out_features)) if bias else None
        init_linear = kwargs.get("init_linear")
        if bias and init_linear is not None and init_linear.bias is not None:
            with torch.no_grad():
                self.bias.copy_(init_linear.bias)

    def _tile_bias(self, in_id: int) -> bool:
        return False

    def forward(self, x: Any) -> tuple[Any, torch.Tensor | None]:
        return super().forward(x), self.bias
