"""Flops of aten operators from their recorded arguments (a tensor's shape, a scalar's value).

The formulas: matmuls (mm, addmm, bmm, baddbmm) and the SDPA kernels' forward and backward (CPU
flash, CUDA flash/efficient/cudnn) computed here from the shapes; convolutions and the others
from torch's registry (``torch.utils.flop_counter.flop_registry``, given the shapes). Only these
count: element-wise operators (activations, norms, softmax, adds) are not flops here, which is
the convention MFU is defined on (PaLM, appendix B). Attention is counted as full ``T x T`` even
when causal (torch's and the 12·L·H·Q·T convention). One MAC is two flops.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils.flop_counter import flop_registry

__all__ = ["FORMULAS", "ATTENTION_KERNELS"]

Shape = Sequence[int]


def _mm(a: Shape, b: Shape, *_: Any) -> int:
    return 2 * a[0] * a[1] * b[1]


def _addmm(bias: Any, a: Shape, b: Shape, *_: Any) -> int:
    return _mm(a, b)


def _bmm(a: Shape, b: Shape, *_: Any) -> int:
    return 2 * a[0] * a[1] * a[2] * b[2]


def _baddbmm(bias: Any, a: Shape, b: Shape, *_: Any) -> int:
    return _bmm(a, b)


def _attention_sizes(q: Shape, k: Shape, v: Shape) -> tuple[int, int, int]:
    """(batch x query heads x query length x key length, q/k head dim, v head dim); grouped
    key/value heads are broadcast to the query's, as the kernels do."""
    b, h, sq, dq = q
    return b * h * sq * k[-2], dq, v[-1]


def _attention(q: Shape, k: Shape, v: Shape, *_: Any) -> int:
    n, dq, dv = _attention_sizes(q, k, v)
    return 2 * n * (dq + dv)  # Q·K^T, then P·V


def _attention_backward(grad_out: Shape, q: Shape, k: Shape, v: Shape, *_: Any) -> int:
    n, dq, dv = _attention_sizes(q, k, v)
    # the kernel recomputes Q·K^T; dP = dO·V^T, dV = P^T·dO, dQ = dS·K, dK = dS^T·Q
    return 2 * n * (3 * dq + 2 * dv)


def _conv_out_shape(x: Shape, w: Shape, stride: Sequence[int], padding: Sequence[int],
                    dilation: Sequence[int]) -> list[int]:
    """A (non-transposed) convolution's output shape: the profiler records inputs only."""
    spatial = []
    for i, (size, k) in enumerate(zip(x[2:], w[2:], strict=True)):
        s, p, d = (v[i] if len(v) > 1 else v[0] for v in (stride, padding, dilation))
        spatial.append((size + 2 * p - d * (k - 1) - 1) // s + 1)
    return [x[0], w[0], *spatial]


def _conv(x: Shape, w: Shape, bias: Any, stride: Sequence[int], padding: Sequence[int],
          dilation: Sequence[int], transposed: bool, *rest: Any) -> int:
    out = _conv_out_shape(x, w, stride, padding, dilation)
    return flop_registry[torch.ops.aten.convolution](x, w, bias, stride, padding, dilation, transposed, *rest,
                                                     out_val=out)


def _registry() -> dict[str, Callable[..., int]]:
    """torch's formulas that work from shapes (``shape_wrapper``'d), by the profiler's name."""
    out: dict[str, Callable[..., int]] = {}
    for op, formula in flop_registry.items():
        name = getattr(op, "_qualified_op_name", None)
        if name is not None and hasattr(formula, "__wrapped__"):
            out[name] = formula
    return out


ATTENTION_KERNELS = tuple(f"aten::_scaled_dot_product_{kernel}" for kernel in
                          ("flash_attention_for_cpu", "flash_attention", "efficient_attention", "cudnn_attention"))
"""The SDPA backends' forward operators (each has a ``_backward``): they save their outputs for
backward after they ran; the matmuls and convolutions save only their inputs, before."""


def _formulas() -> dict[str, Callable[..., int]]:
    fast: dict[str, Callable[..., int]] = {"aten::mm": _mm, "aten::addmm": _addmm, "aten::bmm": _bmm,
                                           "aten::baddbmm": _baddbmm, "aten::convolution": _conv,
                                           "aten::_convolution": _conv}
    for kernel in ATTENTION_KERNELS:
        fast[kernel] = _attention
        fast[f"{kernel}_backward"] = _attention_backward
    # The backends' own convolution kernels run inside aten::convolution (counted there) and take
    # other arguments than the registry's formula assumes.
    registry = {k: f for k, f in _registry().items() if "convolution" not in k or k == "aten::convolution_backward"}
    return {**registry, **fast}


FORMULAS: dict[str, Callable[..., int]] = _formulas()
"""aten operator as the profiler names it -> flops, called with the arguments as recorded (a
tensor's shape, a scalar's value, None)."""
