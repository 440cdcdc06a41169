"""``Softmax``: DeepSpeed's softmax over the rows of a block-sparse matrix
(``deepspeed.ops.sparse_attention.softmax``).

Each row of the dense matrix the tiles stand for is normalised over its kept tiles only (a missing
tile counts as -inf). Before the softmax, as DeepSpeed's kernel in this order: ``x * scale``, plus
the relative position embedding ``rpe`` ``[Z, H, L, L]``, plus the key padding mask ``[Z, L]``,
plus the attention mask ``[L, L]``; a mask in mode ``"mul"`` is 0 where a key is masked (it adds
-inf there), in mode ``"add"`` it is added as given. Computed in fp32, written in the input's
dtype, in place (DeepSpeed's contract: the result is the input tensor). The gradient flows to
``x`` only: ``y * (dy - sum(y * dy)) * scale`` per row.

A row whose every kept entry is masked comes out NaN (as ``torch.softmax`` of an all -inf row,
and DeepSpeed's kernel).
"""

from __future__ import annotations

from typing import Any

import torch

from dslaunch.errors import SparsityConfigError
from dslaunch.kernels.block_sparse.format import BlockLayout

__all__ = ["Softmax"]

MASK_MODES = ("add", "mul")


def _segment(values: torch.Tensor, groups: torch.Tensor, count: int, reduce: str) -> torch.Tensor:
    """Per block row: ``values`` ``[Z, nnz, bs]`` reduced over the tiles of each row group, read back per tile."""
    fill = float("-inf") if reduce == "amax" else 0.0
    out = values.new_full((values.shape[0], count, values.shape[2]), fill)
    index = groups.view(1, -1, 1).expand_as(values)
    out.scatter_reduce_(1, index, values, reduce=reduce, include_self=True)
    return out.index_select(1, groups)


def _as_additive(mask: torch.Tensor, mode: str) -> torch.Tensor:
    if mode == "mul":
        return torch.where(mask == 0, float("-inf"), 0.0)
    return mask


def _tiles_of(square: torch.Tensor, lay: BlockLayout, heads: torch.Tensor | None) -> torch.Tensor:
    """The kept tiles of ``[..., L, L]`` (``[Z, H, L, L]`` when ``heads`` is given)."""
    bs = lay.block
    _, r, c = lay.tiles(square.device)
    blocks = square.unflatten(-1, (lay.cols, bs)).unflatten(-3, (lay.rows, bs)).transpose(-3, -2)
    return blocks[:, heads, r, c] if heads is not None else blocks[r, c]


def _normalise(x: torch.Tensor, scale: float, rpe: torch.Tensor | None, kp_mask: torch.Tensor | None,
               attn_mask: torch.Tensor | None, modes: tuple[str, str], lay: BlockLayout) -> torch.Tensor:
    """The softmax of the tiles ``x`` ``[Z, nnz, bs, bs]``, in fp32 (fp64 for fp64 input)."""
    h, _, c = lay.tiles(x.device)
    wide = torch.promote_types(x.dtype, torch.float32)
    logits = x.to(wide) * scale
    if rpe is not None:
        logits = logits + _tiles_of(rpe.to(wide), lay, h)
    if kp_mask is not None:
        keys = _as_additive(kp_mask.to(wide), modes[0]).unflatten(-1, (lay.cols, lay.block))
        logits = logits + keys.index_select(1, c).unsqueeze(2)
    if attn_mask is not None:
        logits = logits + _tiles_of(_as_additive(attn_mask.to(wide), modes[1]), lay, None)
    groups, count = lay.row_groups(x.device), lay.heads * lay.rows
    top = _segment(logits.amax(-1), groups, count, "amax")
    e = torch.exp(logits - top.unsqueeze(-1))
    return e / _segment(e.sum(-1), groups, count, "sum").unsqueeze(-1)


class _SparseSoftmax(torch.autograd.Function):

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, scale: float, rpe: torch.Tensor | None, kp_mask: torch.Tensor | None,
                attn_mask: torch.Tensor | None, modes: tuple[str, str], lay: BlockLayout) -> torch.Tensor:
        x.copy_(_normalise(x, scale, rpe, kp_mask, attn_mask, modes, lay))
        ctx.mark_dirty(x)
        ctx.save_for_backward(x)
        ctx.scale, ctx.lay = scale, lay
        return x

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        (y,) = ctx.saved_tensors
        lay = ctx.lay
        wide = torch.promote_types(y.dtype, torch.float32)
        yf, gf = y.to(wide), dy.to(wide)
        dot = _segment((yf * gf).sum(-1), lay.row_groups(y.device), lay.heads * lay.rows, "sum")
        dx = yf * (gf - dot.unsqueeze(-1)) * ctx.scale
        return dx.to(y.dtype), None, None, None, None, None, None


class Softmax:
    """The block-sparse softmax for one layout (DeepSpeed's ``Softmax``).

    Args:
        layout: 0/1 tensor ``[H, R, C]`` (or ``[R, C]``).
        block: tile size.
        bench: accepted for DeepSpeed's signature; no timing is taken.
    """

    def __init__(self, layout: torch.Tensor, block: int, bench: bool = False):
        self.layout_index = BlockLayout(layout, block)
        self.layout = self.layout_index.layout
        self.num_blocks = self.layout_index.nnz
        self.spdims = self.layout.shape
        self.block, self.bench = block, bench
        self.time_y = None

    def __call__(self, x: torch.Tensor, scale: float = 1.0, rpe: torch.Tensor | None = None,
                 key_padding_mask: torch.Tensor | None = None, attn_mask: torch.Tensor | None = None,
                 key_padding_mask_mode: str = "add", attn_mask_mode: str = "add") -> torch.Tensor:
        """Softmax of each row of ``x`` over its kept tiles, in place.

        Args:
            x: ``[Z, nnz, block, block]``; overwritten with the result (not a leaf that requires grad).
            scale: multiplies ``x`` first.
            rpe: relative position embedding ``[Z, H, L, L]``, added; ``x``'s dtype.
            key_padding_mask: ``[Z, L]``, ``x``'s dtype.
            attn_mask: ``[L, L]``, ``x``'s dtype.
            key_padding_mask_mode: ``"add"`` or ``"mul"``.
            attn_mask_mode: ``"add"`` or ``"mul"``.

        Returns:
            ``x``, holding the probabilities.

        Raises:
            SparsityConfigError: a mask or embedding of another dtype or shape, or an unknown mode.
        """
        lay = self.layout_index
        if x.dim() != 4 or tuple(x.shape[1:]) != (lay.nnz, lay.block, lay.block):
            raise SparsityConfigError(f"x must be [batch, {lay.nnz}, {lay.block}, {lay.block}] for this layout, "
                                      f"got {tuple(x.shape)}")
        length = (lay.rows * lay.block, lay.cols * lay.block)
        for what, t, shape in (("relative position embedding", rpe, (x.shape[0], lay.heads, *length)),
                               ("key padding mask", key_padding_mask, (x.shape[0], length[1])),
                               ("attention mask", attn_mask, length)):
            if t is None:
                continue
            if t.dtype != x.dtype:
                raise SparsityConfigError(f"{what} must be {x.dtype} like x, got {t.dtype}")
            if tuple(t.shape) != shape:
                raise SparsityConfigError(f"{what} must be of shape {shape}, got {tuple(t.shape)}")
        for name, mode in (("key_padding_mask_mode", key_padding_mask_mode), ("attn_mask_mode", attn_mask_mode)):
            if mode not in MASK_MODES:
                raise SparsityConfigError(f"{name}={mode!r}: must be 'add' or 'mul'")
        return _SparseSoftmax.apply(x, float(scale), rpe, key_padding_mask, attn_mask,
                                    (key_padding_mask_mode, attn_mask_mode), lay)
