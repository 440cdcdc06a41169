"""``MatMul``: DeepSpeed's block-sparse matrix product (``deepspeed.ops.sparse_attention.matmul``).

Three modes, named by which of output, first and second operand are (s)parse or (d)ense:
``sdd`` (the kept tiles of a dense product: attention scores), ``dsd`` (sparse times dense: the
probabilities times the values) and ``dds`` (dense times sparse). ``trans_a``/``trans_b``
transpose an operand first; a sparse operand's layout describes it as stored (before the
transpose), as in DeepSpeed. Differentiable in both operands: each gradient is one of the three
products again (``format.py``, or the Triton kernels of ``kernels/triton/block_sparse.py`` on CUDA,
through the dispatch point), so the backward keeps only the two inputs, never gathered tiles.

Dense operands are ``[Z, H, rows, cols]`` (fewer leading dimensions are taken as 1), sparse ones
``[Z, nnz, block, block]``; the result has as many dimensions as the larger input, as in DeepSpeed.
Runs on any device torch runs on, in fp32, fp16 or bf16 (DeepSpeed's Triton kernels: CUDA only).
"""

from __future__ import annotations

from typing import Any

import torch

from dslaunch.errors import SparsityConfigError
from dslaunch.kernels.block_sparse.format import BlockLayout
from dslaunch.kernels.dispatch import get

__all__ = ["MatMul"]

MODES = ("sdd", "dsd", "dds")


def sdd(a: torch.Tensor, b: torch.Tensor, lay: BlockLayout) -> torch.Tensor:
    """``format.sdd`` through the dispatch point (the Triton kernel on CUDA)."""
    return get("block_sparse_sdd", a.device)(a, b, lay)


def spmm(s: torch.Tensor, transposed: bool, d: torch.Tensor, lay: BlockLayout) -> torch.Tensor:
    """``format.spmm`` through the dispatch point (the Triton kernel on CUDA)."""
    return get("block_sparse_spmm", s.device)(s, transposed, d, lay)


def mmsp(d: torch.Tensor, s: torch.Tensor, transposed: bool, lay: BlockLayout) -> torch.Tensor:
    """Dense ``d`` times block-sparse ``s`` (its transpose if ``transposed``): ``(s^T d^T)^T``."""
    return spmm(s, not transposed, d.transpose(-1, -2), lay).transpose(-1, -2)


def _t(x: torch.Tensor, flag: bool) -> torch.Tensor:
    return x.transpose(-1, -2) if flag else x


def _product(a: torch.Tensor, b: torch.Tensor, mode: str, ta: bool, tb: bool, lay: BlockLayout) -> torch.Tensor:
    if mode == "sdd":
        return sdd(_t(a, ta), _t(b, tb), lay)
    if mode == "dsd":
        return spmm(a, ta, _t(b, tb), lay)
    return mmsp(_t(a, ta), b, tb, lay)


class _SparseProduct(torch.autograd.Function):
    """The product and its gradients (C = op(A) @ op(B): dA_eff = dC @ B_eff^T, dB_eff = A_eff^T @ dC)."""

    @staticmethod
    def forward(ctx: Any, a: torch.Tensor, b: torch.Tensor, mode: str, ta: bool, tb: bool,
                lay: BlockLayout) -> torch.Tensor:
        ctx.save_for_backward(a, b)
        ctx.spec = (mode, ta, tb, lay)
        return _product(a, b, mode, ta, tb, lay)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        a, b = ctx.saved_tensors
        mode, ta, tb, lay = ctx.spec
        need_a, need_b = ctx.needs_input_grad[:2]
        da = db = None
        if mode == "sdd":  # g sparse; A, B dense
            if need_a:
                da = _t(spmm(g, False, _t(b, tb).transpose(-1, -2), lay), ta)
            if need_b:
                db = _t(mmsp(_t(a, ta).transpose(-1, -2), g, False, lay), tb)
        elif mode == "dsd":  # A sparse, B dense, g dense
            if need_a:  # the kept tiles of g @ B_eff^T, as A is stored
                b_eff = _t(b, tb)
                da = sdd(b_eff, g.transpose(-1, -2), lay) if ta else sdd(g, b_eff.transpose(-1, -2), lay)
            if need_b:
                db = _t(spmm(a, not ta, g, lay), tb)
        else:  # dds: A dense, B sparse, g dense
            if need_a:
                da = _t(mmsp(g, b, not tb, lay), ta)
            if need_b:  # the kept tiles of A_eff^T @ g, as B is stored
                a_eff = _t(a, ta)
                db = sdd(g.transpose(-1, -2), a_eff, lay) if tb else sdd(a_eff.transpose(-1, -2), g, lay)
        return da, db, None, None, None, None


class MatMul:
    """A block-sparse product for one layout (DeepSpeed's ``MatMul``).

    Args:
        layout: 0/1 tensor ``[H, R, C]`` (or ``[R, C]``) of the sparse operand or result.
        block: tile size.
        mode: ``"sdd"``, ``"dsd"`` or ``"dds"``.
        trans_a: transpose the first operand.
        trans_b: transpose the second operand.
        bench: accepted for DeepSpeed's signature; no timing is taken.

    Raises:
        SparsityConfigError: an unknown mode or a bad layout.
    """

    def __init__(self, layout: torch.Tensor, block: int, mode: str, trans_a: bool = False, trans_b: bool = False,
                 bench: bool = False):
        if mode not in MODES:
            raise SparsityConfigError(f"mode={mode!r}: must be one of {', '.join(MODES)}")
        self.layout_index = BlockLayout(layout, block)
        self.block, self.mode, self.trans_a, self.trans_b = block, mode, trans_a, trans_b
        self.spdims = self.layout_index.layout.shape
        self.bench = bench
        self.time_c = self.time_da = self.time_db = None

    def __call__(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """``op(a) @ op(b)`` in this mode.

        Args:
            a: first operand (block-sparse in ``dsd``).
            b: second operand (block-sparse in ``dds``).

        Returns:
            The product: ``[Z, nnz, block, block]`` in ``sdd``, else ``[Z, H, M, N]`` (leading
            dimensions the inputs lacked dropped again).

        Raises:
            SparsityConfigError: inputs on different devices, of different dtypes, or of shapes
                that do not fit the layout.
        """
        if a.device != b.device:
            raise SparsityConfigError(f"inputs on different devices: A on {a.device}, B on {b.device}")
        if torch.is_autocast_enabled():  # what torch.matmul would compute in, as DeepSpeed does
            a, b = a.half(), b.half()
        elif a.dtype != b.dtype:
            raise SparsityConfigError(f"inputs of different dtypes: A {a.dtype}, B {b.dtype}")
        ndim = max(a.dim(), b.dim())
        if ndim > 4:
            raise SparsityConfigError(f"inputs of at most 4 dimensions, got {a.dim()} and {b.dim()}")
        a, b = self._fit(self._pad(a), self._pad(b))
        out = _SparseProduct.apply(a, b, self.mode, self.trans_a, self.trans_b, self.layout_index)
        out = out.contiguous()
        for _ in range(4 - ndim):  # drop the leading singleton dimensions added (DeepSpeed's squeeze)
            out = out.squeeze(0)
        return out

    @staticmethod
    def _pad(x: torch.Tensor) -> torch.Tensor:
        return x.reshape((1,) * (4 - x.dim()) + tuple(x.shape))

    def _fit(self, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Check the shapes against the layout and expand batch and heads to a common size."""
        lay, bs = self.layout_index, self.block
        sparse_shape = (lay.nnz, bs, bs)
        rows, cols = lay.rows * bs, lay.cols * bs
        stored = {"sdd": None, "dsd": "A", "dds": "B"}[self.mode]
        for name, x in (("A", a), ("B", b)):
            if name == stored and tuple(x.shape[1:]) != sparse_shape:
                raise SparsityConfigError(f"{self.mode}: block-sparse {name} must be [batch, {lay.nnz}, {bs}, {bs}] "
                                          f"for this layout, got {tuple(x.shape)}")
        a_eff = (a.shape[-1], a.shape[-2]) if self.trans_a else (a.shape[-2], a.shape[-1])
        b_eff = (b.shape[-1], b.shape[-2]) if self.trans_b else (b.shape[-2], b.shape[-1])
        if self.mode == "sdd":
            want = {"A rows": (a_eff[0], rows), "B columns": (b_eff[1], cols), "inner": (a_eff[1], b_eff[0])}
        elif self.mode == "dsd":
            inner = rows if self.trans_a else cols
            want = {"B inner": (b_eff[0], inner)}
        else:
            inner = cols if self.trans_b else rows
            want = {"A inner": (a_eff[1], inner)}
        for what, (got, need) in want.items():
            if got != need:
                raise SparsityConfigError(f"{self.mode}: {what} size {got} does not fit the layout "
                                          f"(expected {need}; block {bs}, layout {tuple(self.spdims)})")
        z = max(a.shape[0], b.shape[0])
        heads = lay.heads
        for name, x, is_sparse in (("A", a, stored == "A"), ("B", b, stored == "B")):
            if x.shape[0] not in (1, z) or (not is_sparse and x.shape[1] not in (1, heads)):
                raise SparsityConfigError(f"{self.mode}: {name} of shape {tuple(x.shape)} does not match batch {z} "
                                          f"and the layout's {heads} heads")
        return self._expand(a, z, stored == "A"), self._expand(b, z, stored == "B")

    def _expand(self, x: torch.Tensor, z: int, is_sparse: bool) -> torch.Tensor:
        return x.expand(z, -1, -1, -1) if is_sparse else x.expand(z, self.layout_index.heads, -1, -1)
