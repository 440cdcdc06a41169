"""One test per operator family, forward and backward, against counts derived here by hand:
convolutions (1-3d, groups, dilation, stride, transposed, with and without bias), embeddings,
pooling, RNNs (RNN/LSTM/GRU and their cells, oneDNN's kernel and the matmul path), SDPA and
normalizations; and an operator whose formula fails: one warning naming it, the step goes on.

The convention (``formulas.py``): matmul-like work only, 2 flops per MAC. DeepSpeed's MACs are
the same numbers where it counts MACs (linear, matmul, convolution, attention); its flops add
element-wise estimates (pooling, norms, activations, a convolution's bias), which are 0 here.
"""

from __future__ import annotations

import logging
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dslaunch.profiling.flops_profiler import FlopsProfiler
from dslaunch.runtime.profiling import formulas as formulas_module
from dslaunch.runtime.profiling.formulas import FORMULAS
from tests.profiling.flops_profiler.cifar import cifar_flops, cifar_net

pytestmark = pytest.mark.timeout(120)


def _count(model: nn.Module, *inputs: torch.Tensor) -> tuple[int, int, FlopsProfiler]:
    """Forward and backward flops of ``model(*inputs)`` and the sum of its first output."""
    prof = FlopsProfiler(model)
    prof.start_profile()
    out = model(*inputs)
    (out[0] if isinstance(out, tuple) else out).float().sum().backward()
    prof.stop_profile()
    p = prof.profile()
    assert prof.counter is not None and not prof.counter.uncounted  # every family here is countable
    return p.fwd_flops, p.bwd_flops, prof


# ----- convolutions ---------------------------------------------------------------------------
def _deepspeed_conv_macs(x: torch.Tensor, conv: nn.Module, y: torch.Tensor) -> int:
    """DeepSpeed's convention (its ``_conv_flops_compute`` / ``_conv_trans_flops_compute``): kernel x
    in channels x out channels / groups MACs per position, the output's positions for a
    convolution, the input's for a transposed one (where its out channels are the weight's dim 1,
    already divided by the groups, and divided once more)."""
    kernel = math.prod(conv.kernel_size)
    if conv.transposed:
        return kernel * conv.in_channels * (conv.weight.shape[1] // conv.groups) * x.shape[0] * math.prod(x.shape[2:])
    return kernel * conv.in_channels * (conv.out_channels // conv.groups) * y.shape[0] * math.prod(y.shape[2:])


CONVS = {
    "conv1d stride 2 padding 1": (lambda: nn.Conv1d(4, 6, 3, stride=2, padding=1), (2, 4, 9)),
    "conv2d groups 2 dilation 2 no bias": (lambda: nn.Conv2d(4, 6, 3, groups=2, dilation=2, bias=False), (2, 4, 9, 9)),
    "conv2d padding same": (lambda: nn.Conv2d(3, 5, (3, 2), padding="same"), (2, 3, 6, 7)),
    "conv2d depthwise": (lambda: nn.Conv2d(4, 8, 3, groups=4), (1, 4, 6, 6)),
    "conv3d": (lambda: nn.Conv3d(2, 4, 3, stride=(1, 2, 1)), (1, 2, 5, 6, 5)),
    "conv_transpose1d": (lambda: nn.ConvTranspose1d(4, 6, 3), (2, 4, 5)),
    "conv_transpose2d groups 2 stride 2": (lambda: nn.ConvTranspose2d(4, 6, 3, stride=2, groups=2, output_padding=1),
                                           (2, 4, 5, 5)),
    "conv_transpose3d no bias": (lambda: nn.ConvTranspose3d(2, 3, 2, bias=False), (1, 2, 3, 4, 3)),
}


@pytest.mark.parametrize("case", list(CONVS))
@pytest.mark.parametrize("input_grad", [True, False])
def test_convolutions(case: str, input_grad: bool) -> None:
    make, shape = CONVS[case]
    torch.manual_seed(0)
    conv = make()
    x = torch.randn(*shape, requires_grad=input_grad)
    y = conv(x)
    w = conv.weight.shape  # out x in/groups x kernel (transposed: in x out/groups x kernel)
    positions = x.shape[2:] if conv.transposed else y.shape[2:]
    macs = x.shape[0] * math.prod(w) * math.prod(positions)
    fwd, bwd, _ = _count(conv, x)
    assert fwd == 2 * macs
    # the weight's gradient always, the input's when it needs one: each a whole forward's work
    assert bwd == 2 * macs * (1 + input_grad)
    ds = _deepspeed_conv_macs(x, conv, y)
    if conv.transposed and conv.groups > 1:
        # DeepSpeed divides a grouped transposed convolution's out channels by the groups twice
        per_group = conv.weight.shape[1]
        assert macs * (per_group // conv.groups) == ds * per_group
    else:
        assert macs == ds


def test_deepspeeds_cifar_model_counts_exactly() -> None:
    # The example's Net crashed the profiled step (torch's convolution-backward formula).
    torch.manual_seed(0)
    fwd, bwd, _ = _count(cifar_net(), torch.randn(4, 3, 32, 32))
    assert (fwd, bwd) == cifar_flops(4)[:2]


# ----- embeddings, pooling, normalizations: no MAC (DeepSpeed's MACs: 0 too) -----------------------
def _head(body: nn.Module, features: int) -> tuple[nn.Module, int]:
    """``body`` then a Linear(features, 3) that is counted, so a wrong count shows."""
    return nn.Sequential(body, nn.Flatten(), nn.Linear(features, 3)), features * 3


@pytest.mark.parametrize("body, x, features", [
    (nn.Embedding(10, 4), torch.tensor([[1, 2, 3], [4, 5, 9]]), 12),
    (nn.Embedding(10, 4, padding_idx=0, max_norm=1.0), torch.tensor([[0, 2, 3], [4, 5, 9]]), 12),
    (nn.EmbeddingBag(10, 4, mode="sum"), torch.tensor([[1, 2, 3], [4, 5, 9]]), 4),
    (nn.EmbeddingBag(10, 4, mode="mean"), torch.tensor([[1, 2, 3], [4, 5, 9]]), 4),
    (nn.EmbeddingBag(10, 4, mode="max"), torch.tensor([[1, 2, 3], [4, 5, 9]]), 4),
], ids=["embedding", "embedding padding max_norm", "bag sum", "bag mean", "bag max"])
def test_embeddings(body: nn.Module, x: torch.Tensor, features: int) -> None:
    model, macs = _head(body, features)
    fwd, bwd, _ = _count(model, x)
    # the look-up and its scatter-add backward are not MACs; the Linear's forward, then its weight's
    # and its input's gradients (the embedding's weight needs the latter)
    assert (fwd, bwd) == (2 * 2 * macs, 4 * 2 * macs)


POOLS = {
    "max_pool1d": (nn.MaxPool1d(2), (2, 3, 8), 12),
    "max_pool2d": (nn.MaxPool2d(2, stride=1, padding=1), (2, 3, 4, 4), 75),
    "max_pool3d": (nn.MaxPool3d(2), (1, 2, 4, 4, 4), 16),
    "avg_pool2d": (nn.AvgPool2d(3, stride=2, ceil_mode=True), (2, 3, 6, 6), 27),
    "avg_pool3d": (nn.AvgPool3d(2), (1, 2, 4, 4, 4), 16),
    "adaptive_avg_pool2d": (nn.AdaptiveAvgPool2d((2, 3)), (2, 3, 7, 7), 18),
    "adaptive_max_pool1d": (nn.AdaptiveMaxPool1d(3), (2, 3, 8), 9),
    "lp_pool2d": (nn.LPPool2d(2, 2), (2, 3, 4, 4), 12),
}


@pytest.mark.parametrize("case", list(POOLS))
def test_pooling(case: str) -> None:
    pool, shape, features = POOLS[case]
    model, macs = _head(pool, features)
    fwd, bwd, _ = _count(model, torch.randn(*shape, requires_grad=True))
    assert (fwd, bwd) == (2 * shape[0] * macs, 4 * shape[0] * macs)  # the Linear only


NORMS = {
    "batch_norm1d": (lambda: nn.BatchNorm1d(6), (4, 6)),
    "batch_norm2d": (lambda: nn.BatchNorm2d(3), (2, 3, 2, 1)),
    "layer_norm": (lambda: nn.LayerNorm(6), (4, 6)),
    "layer_norm no affine": (lambda: nn.LayerNorm(6, elementwise_affine=False), (4, 6)),
    "group_norm": (lambda: nn.GroupNorm(2, 6), (4, 6)),
    "instance_norm1d": (lambda: nn.InstanceNorm1d(3, affine=True), (2, 3, 2)),
    "rms_norm": (lambda: nn.RMSNorm(6), (4, 6)),
    "local_response_norm": (lambda: nn.LocalResponseNorm(2), (2, 3, 2)),
}


@pytest.mark.parametrize("case", list(NORMS))
@pytest.mark.parametrize("train", [True, False])
def test_normalizations(case: str, train: bool) -> None:
    make, shape = NORMS[case]
    model, macs = _head(make(), 6)
    model.train(train)
    fwd, bwd, _ = _count(model, torch.randn(*shape, requires_grad=True))
    assert (fwd, bwd) == (2 * shape[0] * macs, 4 * shape[0] * macs)  # the Linear only


# ----- RNNs -----------------------------------------------------------------------------------
GATES = {nn.RNN: 1, nn.GRU: 3, nn.LSTM: 4, nn.RNNCell: 1, nn.GRUCell: 3, nn.LSTMCell: 4}
T, B, IN, H = 3, 2, 4, 5


def _rnn_macs_per_token(rnn: nn.Module, input_grad: bool = True) -> tuple[int, int, int]:
    """Per token, through every layer and direction: (the forward's MACs, the hidden-to-hidden
    ones, the backward's input-side ones). The forward: the gates' input and hidden weights, and
    an LSTM's projection. The backward's input side: each layer's input gradient (the first
    layer's only when the input needs one) and the projection's input gradient."""
    dirs = 2 if getattr(rnn, "bidirectional", False) else 1
    proj = getattr(rnn, "proj_size", 0)
    out = proj or rnn.hidden_size
    g = GATES[type(rnn)] * rnn.hidden_size
    total = hidden = inputs = 0
    for layer in range(getattr(rnn, "num_layers", 1)):
        size_in = rnn.input_size if layer == 0 else out * dirs
        total += dirs * (g * (size_in + out) + rnn.hidden_size * proj)
        hidden += dirs * g * out
        inputs += dirs * (g * size_in * (layer > 0 or input_grad) + rnn.hidden_size * proj)
    return total, hidden, inputs


@pytest.mark.parametrize("make", [
    lambda: nn.RNN(IN, H), lambda: nn.RNN(IN, H, nonlinearity="relu", num_layers=2),
    lambda: nn.GRU(IN, H, bidirectional=True), lambda: nn.LSTM(IN, H, num_layers=2, bidirectional=True, proj_size=3),
], ids=["rnn", "rnn relu 2 layers", "gru bidirectional", "lstm projected"])
@pytest.mark.parametrize("input_grad", [True, False])
def test_rnns_on_the_matmul_path(make, input_grad: bool) -> None:
    # torch runs these as matmuls on CPU: the backward computes the weights' gradients (as many
    # MACs as the forward), the hidden state's from the second time step on (h0 needs none) and
    # the input side's
    torch.manual_seed(0)
    rnn = make()
    per_token, hidden, inputs = _rnn_macs_per_token(rnn, input_grad)
    fwd, bwd, _ = _count(rnn, torch.randn(T, B, IN, requires_grad=input_grad))
    assert fwd == 2 * T * B * per_token
    assert bwd == fwd + 2 * (T - 1) * B * hidden + 2 * T * B * inputs


@pytest.mark.parametrize("layers, bidirectional, batch_first", [(1, False, False), (2, True, True)])
def test_the_lstm_kernel_counts_as_the_matmul_path(layers: int, bidirectional: bool, batch_first: bool) -> None:
    # torch's CPU LSTM runs oneDNN's layer kernel (one operator per layer and direction), which
    # computes every gradient: its backward is twice its forward
    torch.manual_seed(0)
    lstm = nn.LSTM(IN, H, num_layers=layers, bidirectional=bidirectional, batch_first=batch_first)
    x = torch.randn(B, T, IN) if batch_first else torch.randn(T, B, IN)
    fwd, bwd, prof = _count(lstm, x)
    assert fwd == 2 * T * B * _rnn_macs_per_token(lstm)[0] and bwd == 2 * fwd
    assert "aten.mkldnn_rnn_layer" in dict(prof.profile().ops)
    with torch.backends.mkldnn.flags(enabled=False):
        assert _count(lstm, x)[0] == fwd  # the same forward through matmuls


@pytest.mark.parametrize("cell", [nn.RNNCell(IN, H), nn.GRUCell(IN, H), nn.LSTMCell(IN, H)], ids=["rnn", "gru", "lstm"])
def test_rnn_cells(cell: nn.Module) -> None:
    macs = B * GATES[type(cell)] * H * (IN + H)
    h = torch.randn(B, H, requires_grad=True)
    state = (h, torch.randn(B, H)) if isinstance(cell, nn.LSTMCell) else h
    fwd, bwd, _ = _count(cell, torch.randn(B, IN, requires_grad=True), state)
    assert (fwd, bwd) == (2 * macs, 4 * macs)  # the weights', the input's and the hidden state's gradients


def test_the_cudnn_rnn_formula_matches_the_cpu_count() -> None:
    # cuDNN's operator gets its weights as a list, which the profiler records without shapes: the
    # formula works from its scalars. Given arguments as the profiler records them (no GPU here), it
    # agrees with the CPU count of the same projected, bidirectional 2-layer LSTM.
    lstm = nn.LSTM(IN, H, num_layers=2, bidirectional=True, proj_size=3)
    cpu_fwd = _count(lstm, torch.randn(T, B, IN))[0]
    args = [[T, B, IN], [], 4, None, [4, B, 3], [4, B, H], 2, H, 3, 2, False, 0.0, True, True, [], None]
    assert FORMULAS["aten::_cudnn_rnn"](*args) == cpu_fwd
    backward = [[T, B, IN], [], 4, [100], [4, B, 3], [4, B, H], [T, B, 6], [T, B, 6], None, None, 2, H, 3, 2, False,
                0.0, True, True, [], None, [10], [True, False, False, True]]
    assert FORMULAS["aten::_cudnn_rnn_backward"](*backward) == 2 * cpu_fwd
    backward[-1] = [False, False, False, True]  # weights only
    assert FORMULAS["aten::_cudnn_rnn_backward"](*backward) == cpu_fwd


# ----- attention ------------------------------------------------------------------------------
class _Attention(nn.Module):
    def __init__(self, causal: bool, gqa: bool):
        super().__init__()
        self.causal, self.gqa = causal, gqa

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, is_causal=self.causal, enable_gqa=self.gqa)


@pytest.mark.parametrize("causal, gqa", [(False, False), (True, False), (False, True)])
@pytest.mark.parametrize("ev, kernel", [(8, "flash"), (4, "math")])
def test_scaled_dot_product_attention(causal: bool, gqa: bool, ev: int, kernel: str) -> None:
    b, h, lq, s, e = 2, 4, 6, 6, 8
    kv_heads = 2 if gqa else h
    q = torch.randn(b, h, lq, e, requires_grad=True)
    k, v = torch.randn(b, kv_heads, s, e, requires_grad=True), torch.randn(b, kv_heads, s, ev, requires_grad=True)
    fwd, bwd, prof = _count(_Attention(causal, gqa), q, k, v)
    ops = dict(prof.profile().ops)
    # DeepSpeed's _attn_flops_compute: Q·K^T and P·V, whole T x T (causal too)
    ds_macs = b * h * lq * e * s + b * h * lq * s * ev
    assert fwd == 2 * ds_macs
    if kernel == "flash":  # torch's CPU flash kernel (equal head dims)
        assert "aten._scaled_dot_product_flash_attention_for_cpu" in ops
        # its backward recomputes Q·K^T, then dP = dO·V^T, dV = P^T·dO, dQ = dS·K, dK = dS^T·Q
        assert bwd == 2 * b * h * lq * s * (3 * e + 2 * ev)
    else:  # the math path, as matmuls (bmm): no recomputation
        assert "aten.bmm" in ops
        assert bwd == 2 * fwd


def test_multihead_attention_module() -> None:
    b, t, d, heads = 2, 5, 8, 2
    mha = nn.MultiheadAttention(d, heads, batch_first=True)
    x = torch.randn(b, t, d, requires_grad=True)
    fwd, bwd, _ = _count(mha, x, x, x)
    projections = b * t * (3 * d * d + d * d)
    attention = 2 * b * heads * t * t * (d // heads)  # Q·K^T and P·V
    assert fwd == 2 * (projections + attention)
    assert bwd == 2 * fwd  # every matmul's two operands need gradients


# ----- an operator that cannot be counted ---------------------------------------------------------
def test_an_operator_whose_formula_fails_is_skipped_with_one_warning(monkeypatch, caplog) -> None:
    def broken(*_: object) -> int:
        raise IndexError("made to fail")

    monkeypatch.setitem(FORMULAS, "aten::addmm", broken)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    x = torch.randn(3, 4, requires_grad=True)
    with caplog.at_level(logging.WARNING, logger="dslaunch.profiling"):
        prof = FlopsProfiler(model)
        prof.start_profile()
        for _ in range(2):
            model(x).sum().backward()
        prof.stop_profile()
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 1 and "aten::addmm not counted (IndexError: made to fail)" in warned[0]
    assert prof.counter is not None and list(prof.counter.uncounted) == ["aten::addmm"]
    # the forward's addmm counts 0; the backward's matmuls (mm) still count
    assert prof.profile().fwd_flops == 0
    assert prof.profile().bwd_flops == 2 * 2 * 3 * (2 * 4 * 8 + 2 * 8 * 2)


def test_operators_known_to_be_uncountable_are_named() -> None:
    with pytest.raises(formulas_module.Uncountable, match="tensor values"):
        FORMULAS["aten::_flash_attention_forward"]([1, 4, 2, 8], [1, 4, 2, 8], [1, 4, 2, 8], [3], [3], 4, 4)
    with pytest.raises(formulas_module.Uncountable):
        FORMULAS["aten::_grouped_mm"]([4, 8], [2, 8, 3], [2])
