"""Flops of aten operators from their recorded arguments (a tensor's shape, a scalar's value).

What counts is matmul-like work, 2 flops per multiply-accumulate: matmuls (mm, addmm, bmm,
baddbmm, int8), convolutions of every dimension (groups, transposed; forward and both gradients),
RNN kernels (oneDNN's layer on CPU, cuDNN's; GRU and vanilla RNN on CPU run as matmuls), the SDPA
kernels' forward and backward (CPU flash, CUDA flash/efficient/cudnn), and what else torch's
registry (``torch.utils.flop_counter.flop_registry``) counts from shapes. Element-wise operators
(activations, norms, pooling, softmax, adds, embedding look-ups) are not flops here: the convention
MFU is defined on (PaLM, appendix B), and DeepSpeed's MACs. Attention is counted as full ``T x T``
even when causal (torch's and the 12·L·H·Q·T convention). A convolution's bias adds no flop here.

An operator that does such work but whose recorded shapes do not say how much (variable-length
attention, grouped matmuls with offsets) has a formula raising ``Uncountable``: the counter warns
once and counts 0.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from math import prod
from typing import Any

from torch.utils.flop_counter import flop_registry

__all__ = ["FORMULAS", "ATTENTION_KERNELS", "Uncountable"]

Shape = Sequence[int]


def _mm(a: Shape, b: Shape, *_: Any) -> int:
    return 2 * a[0] * a[1] * b[1]


def _addmm(bias: Any, a: Shape, b: Shape, *_: Any) -> int:
    return _mm(a, b)


def _mm_transposed(a: Shape, b: Shape, *_: Any) -> int:
    """``a @ b.T`` (int8 weight-only kernels keep the weight as out x in)."""
    return 2 * a[0] * a[1] * b[0]


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


def _conv_out_spatial(x: Shape, w: Shape, stride: Sequence[int], padding: Sequence[int],
                      dilation: Sequence[int]) -> list[int]:
    """A (non-transposed) convolution's output sizes: the profiler records inputs only."""
    spatial = []
    for i, (size, k) in enumerate(zip(x[2:], w[2:], strict=True)):
        s, p, d = (v[i] if len(v) > 1 else v[0] for v in (stride, padding, dilation))
        spatial.append((size + 2 * p - d * (k - 1) - 1) // s + 1)
    return spatial


def _conv_macs(batch: int, w: Shape, positions: Sequence[int]) -> int:
    """Every weight meets every input at each of ``positions``: the output's for a convolution,
    the input's for a transposed one (whose weight is in x out/groups x kernel); ``w``'s shape
    already holds the division by the groups. The bias adds no MAC."""
    return batch * prod(w) * prod(positions)


def _conv(x: Shape, w: Shape, bias: Any, stride: Sequence[int], padding: Sequence[int],
          dilation: Sequence[int], transposed: bool, *_: Any) -> int:
    positions = x[2:] if transposed else _conv_out_spatial(x, w, stride, padding, dilation)
    return 2 * _conv_macs(x[0], w, positions)


def _conv_backward(grad_out: Shape, x: Shape, w: Shape, bias_sizes: Any, stride: Any, padding: Any,
                   dilation: Any, transposed: bool, output_padding: Any, groups: int,
                   output_mask: Sequence[bool]) -> int:
    # The input's gradient is the transposed operation and the weight's gradient correlates the
    # input with the output's gradient: each as many MACs as the forward, when asked for.
    macs = _conv_macs(x[0], w, x[2:] if transposed else grad_out[2:])
    return 2 * macs * (bool(output_mask[0]) + bool(output_mask[1]))


_GATES = {0: 1, 1: 1, 2: 4, 3: 3}
"""Gates per RNN mode (torch's numbering: RNN_RELU, RNN_TANH, LSTM, GRU)."""


def _rnn_layer(x: Shape, w_ih: Shape, w_hh: Shape, *_: Any) -> int:
    """One layer, one direction (oneDNN's ``mkldnn_rnn_layer``, torch's CPU LSTM): every token's
    input and previous hidden state through the gates' weights. The gate arithmetic is
    element-wise (not counted)."""
    return 2 * (prod(x) // x[-1]) * (prod(w_ih) + prod(w_hh))


def _rnn_layer_backward(x: Shape, w_ih: Shape, w_hh: Shape, *_: Any) -> int:
    # the gradients of the input and the previous hidden state, and of both weights
    return 2 * _rnn_layer(x, w_ih, w_hh)


def _cudnn_rnn_forward_macs(x: Shape, mode: int, hidden: int, proj: int, layers: int, bidirectional: bool) -> int:
    """All layers and directions of cuDNN's RNN, from its scalar arguments (the weights come as a
    list, which the profiler does not record): per token and direction, the gates' weights
    (input and hidden, G x H x in + G x H x out) and an LSTM's projection (H x P)."""
    dirs = 2 if bidirectional else 1
    out = proj or hidden
    tokens = prod(x) // x[-1]
    per_token = 0
    for layer in range(layers):
        size_in = x[-1] if layer == 0 else out * dirs
        per_token += dirs * (_GATES[mode] * hidden * (size_in + out) + (hidden * proj if proj else 0))
    return tokens * per_token


def _cudnn_rnn(x: Shape, weight: Any, stride0: Any, weight_buf: Any, hx: Any, cx: Any, mode: int, hidden: int,
               proj: int, layers: int, batch_first: bool, dropout: Any, train: Any, bidirectional: bool,
               *_: Any) -> int:
    return 2 * _cudnn_rnn_forward_macs(x, mode, hidden, proj, layers, bidirectional)


def _cudnn_rnn_backward(x: Shape, weight: Any, stride0: Any, weight_buf: Any, hx: Any, cx: Any, output: Any,
                        grad_output: Any, grad_hy: Any, grad_cy: Any, mode: int, hidden: int, proj: int,
                        layers: int, batch_first: bool, dropout: Any, train: Any, bidirectional: bool,
                        batch_sizes: Any, dropout_state: Any, reserve: Any, output_mask: Sequence[bool]) -> int:
    # cuDNN's backward-data pass (input and hidden gradients together) and backward-weights pass
    passes = any(output_mask[:3]) + bool(output_mask[3])
    return 2 * passes * _cudnn_rnn_forward_macs(x, mode, hidden, proj, layers, bidirectional)


class Uncountable(Exception):
    """An operator whose flops its recorded shapes do not give (the counter warns once, counts 0)."""


def _uncountable(why: str) -> Callable[..., int]:
    def formula(*_: Any) -> int:
        raise Uncountable(why)

    return formula


_NEEDS_VALUES = "its flops depend on tensor values (sequence offsets), which the profiler does not record"
_UNCOUNTABLE = {"aten::_grouped_mm": _NEEDS_VALUES, "aten::_scaled_grouped_mm": _NEEDS_VALUES,
                "aten::_weight_int4pack_mm": "its packed weight's shape does not give the matrix sizes",
                "aten::miopen_rnn": "no formula for ROCm's RNN kernel yet",
                "aten::miopen_rnn_backward": "no formula for ROCm's RNN kernel yet"}
"""Matmul-like operators that do real work but cannot be counted from shapes."""


def _registry() -> dict[str, Callable[..., int]]:
    """torch's formulas that work from shapes (``shape_wrapper``'d), by the profiler's name; its
    others need tensor values (variable-length attention) and are uncountable here."""
    out: dict[str, Callable[..., int]] = {}
    for op, formula in flop_registry.items():
        name = getattr(op, "_qualified_op_name", None)
        if name is not None:
            out[name] = formula if hasattr(formula, "__wrapped__") else _uncountable(_NEEDS_VALUES)
    return out


ATTENTION_KERNELS = tuple(f"aten::_scaled_dot_product_{kernel}" for kernel in
                          ("flash_attention_for_cpu", "flash_attention", "efficient_attention", "cudnn_attention"))
"""The SDPA backends' forward operators (each has a ``_backward``): they save their outputs for
backward after they ran; the matmuls and convolutions save only their inputs, before."""


def _formulas() -> dict[str, Callable[..., int]]:
    ours: dict[str, Callable[..., int]] = {
        "aten::mm": _mm, "aten::addmm": _addmm, "aten::bmm": _bmm, "aten::baddbmm": _baddbmm,
        "aten::_int_mm": _mm, "aten::_weight_int8pack_mm": _mm_transposed,
        "aten::convolution": _conv, "aten::_convolution": _conv, "aten::convolution_backward": _conv_backward,
        "aten::mkldnn_rnn_layer": _rnn_layer, "aten::mkldnn_rnn_layer_backward": _rnn_layer_backward,
        "aten::_cudnn_rnn": _cudnn_rnn, "aten::_cudnn_rnn_backward": _cudnn_rnn_backward}
    for kernel in ATTENTION_KERNELS:
        ours[kernel] = _attention
        ours[f"{kernel}_backward"] = _attention_backward
    ours.update({name: _uncountable(why) for name, why in _UNCOUNTABLE.items()})
    # torch's convolution formulas need the output's shape, which the profiler does not record (its
    # backward's crashed a profiled step); the backends' kernels run inside aten::convolution.
    registry = {k: f for k, f in _registry().items() if "conv" not in k}
    return {**registry, **ours}


FORMULAS: dict[str, Callable[..., int]] = _formulas()
"""aten operator as the profiler names it -> flops, called with the arguments as recorded (a
tensor's shape, a scalar's value, None)."""
