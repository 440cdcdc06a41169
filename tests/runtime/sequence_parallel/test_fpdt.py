"""FPDT (``deepspeed.sequence.fpdt_layer``): the load-balanced layout is DeepSpeed 0.19.8's index for
index, and ``FPDT_FFN`` and ``update_out_and_lse`` give its numbers (real DeepSpeed on CPU, once per
module; skipped without it, see ``DSLAUNCH_DEEPSPEED_PYTHON``); the chunked attention (kept and
offloaded) on 2 gloo ranks gives each rank its positions of whole-sequence causal attention and,
summed over the ranks, the projection gradients of one process computing the whole sequence (fp32,
within 1e-5 of the largest value); the chunked MLP and LM-head loss equal unchunked torch (the loss
averaged over the ranks: its backward sums the gathered losses' gradient over them)."""

from __future__ import annotations

import datetime
import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from dslaunch.errors import UsageError
from dslaunch.runtime.sequence_parallel.fpdt_blocks import rotary
from dslaunch.runtime.sequence_parallel.fpdt_input import fpdt_token_order
from dslaunch.sequence.fpdt_layer import (
    FPDT_FFN,
    FPDT_Attention,
    FPDT_InputConstruct,
    FPDT_LogitsLoss,
    _FPDTGPUAttentionImpl_,
    _FPDTGPUOffloadingAttentionImpl_,
    update_out_and_lse,
)
from tests.deepspeed_reference import run_python
from tests.distributed import run_world

LAYOUTS = [(32, 8, 2), (32, 16, 2), (32, 32, 2), (48, 12, 4), (24, 24, 1), (64, 8, 4)]  # (S, C, P)

_DEEPSPEED_LAYOUT = """
import json, sys, torch
from deepspeed.sequence.fpdt_layer import FPDT_InputConstruct
layouts = []
for seq, chunk, sp in json.loads(sys.argv[3]):
    t = torch.arange(seq).view(1, -1).repeat(2, 1)
    args = type("A", (), {"ds_sequence_parallel_fpdt_chunk_size": chunk})()
    got = [FPDT_InputConstruct(t, t + 1000, t + 2000, None, t + 3000, args, sp, r).generate() for r in range(sp)]
    layouts.append([[g[0].tolist(), g[1].tolist(), g[2].tolist(), g[4].tolist()] for g in got])
"""


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max().clamp(min=1.0))


_DEEPSPEED_BLOCKS = """
from deepspeed.sequence.fpdt_layer import FPDT_FFN, update_out_and_lse
given = torch.load(sys.argv[1])
x, w1, b1, w2, b2, grad = (t.clone().requires_grad_(i < 5) for i, t in enumerate(given["ffn"]))
x_in = x.detach().clone()
out, _ = FPDT_FFN.apply(x, w1, b1, w2, b2, True, 4)
out.backward(grad)
# DeepSpeed's backward writes the input gradient into x itself: read it there
ffn = [out.detach(), x.detach(), w1.grad, b1.grad, w2.grad, b2.grad, x_in]
merged = update_out_and_lse(None, None, *given["blocks"][0])
for block in given["blocks"][1:]:
    merged = update_out_and_lse(*merged, *block)
torch.save({"ds_ffn": ffn, "ds_merged": list(merged), "ds_layouts": layouts}, sys.argv[2])
"""


@pytest.fixture(scope="module")
def deepspeed_blocks(deepspeed_python: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Inputs, and real DeepSpeed's FPDT_FFN (forward and gradients) and update_out_and_lse on them,
    and its FPDT_InputConstruct on ``LAYOUTS`` (one DeepSpeed process: importing it takes seconds)."""
    folder = tmp_path_factory.mktemp("fpdt")
    torch.manual_seed(3)
    ffn = [torch.randn(*s, dtype=torch.float64) for s in ((12, 2, 6), (10, 6), (10,), (6, 10), (6,), (12, 2, 6))]
    blocks = [(torch.randn(2, 5, 3, 4), torch.randn(2, 3, 5)) for _ in range(3)]
    torch.save({"ffn": ffn, "blocks": blocks}, folder / "in.pt")
    run = run_python(deepspeed_python, ["-c", _DEEPSPEED_LAYOUT + _DEEPSPEED_BLOCKS, str(folder / "in.pt"),
                                        str(folder / "out.pt"), json.dumps(LAYOUTS)],
                     {**os.environ, "DS_ACCELERATOR": "cpu"}, timeout=170)
    assert run.returncode == 0, run.stderr[-3000:]
    return {"ffn": ffn, "blocks": blocks, **torch.load(folder / "out.pt")}


@pytest.mark.timeout(180)
def test_input_construct_matches_deepspeed(deepspeed_blocks: dict) -> None:
    want = deepspeed_blocks["ds_layouts"]
    for (seq, chunk, sp), ranks in zip(LAYOUTS, want, strict=True):
        t = torch.arange(seq).view(1, -1).repeat(2, 1)
        args = SimpleNamespace(ds_sequence_parallel_fpdt_chunk_size=chunk)
        for r, expected in enumerate(ranks):
            got = FPDT_InputConstruct(t, t + 1000, t + 2000, None, t + 3000, args, sp, r).generate()
            assert [got[0].tolist(), got[1].tolist(), got[2].tolist(), got[4].tolist()] == expected, (seq, chunk, sp, r)


@pytest.mark.timeout(180)
def test_ffn_and_merge_match_deepspeed(deepspeed_blocks: dict) -> None:
    """FPDT_FFN's output and gradients (add_bias=True) and the online-softmax merge equal DeepSpeed's;
    DeepSpeed accumulates the weight gradients in float32 (on fp64 inputs too), hence 1e-6."""
    x, w1, b1, w2, b2, grad = (t.clone().requires_grad_(i < 5) for i, t in enumerate(deepspeed_blocks["ffn"]))
    out, none = FPDT_FFN.apply(x, w1, b1, w2, b2, True, 4)
    out.backward(grad)
    assert none is None
    want = deepspeed_blocks["ds_ffn"]
    for got, expected in zip([out, x.grad, w1.grad, b1.grad, w2.grad, b2.grad], want, strict=False):
        assert _relative(got.detach(), expected) < 1e-6
    assert torch.equal(x.detach(), want[6])  # dslaunch leaves the input alone (DeepSpeed overwrote its copy)
    blocks = deepspeed_blocks["blocks"]
    merged = update_out_and_lse(None, None, *blocks[0])
    for block in blocks[1:]:
        merged = update_out_and_lse(*merged, *block)
    for got, expected in zip(merged, deepspeed_blocks["ds_merged"], strict=True):
        assert got.shape == expected.shape and _relative(got, expected) < 1e-6


def test_input_construct_refuses_a_chunk_that_does_not_split() -> None:
    t = torch.zeros(1, 30, dtype=torch.long)
    with pytest.raises(UsageError, match="not a multiple of ds_sequence_parallel_fpdt_chunk_size=8"):
        FPDT_InputConstruct(t, None, None, None, None, SimpleNamespace(ds_sequence_parallel_fpdt_chunk_size=8), 2, 0)
    with pytest.raises(UsageError, match="does not split over 4 sequence-parallel ranks"):
        fpdt_token_order(36, 6, 4)


def _whole_attention(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, heads: int, kv_heads: int, hd: int,
                     tables: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
    """Plain causal attention over the whole ``[S, batch, hidden]`` sequence: ``[batch, S, heads, hd]``."""
    q, k, v = (t.unflatten(-1, (-1, hd)).transpose(0, 1) for t in F.linear(x, w, b).split(
        [heads * hd, kv_heads * hd, kv_heads * hd], dim=-1))
    if tables is not None:
        q, k = (rotary(t, *(c.permute(1, 0, 2, 3) for c in tables)) for t in (q, k))
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
                                         enable_gqa=True)
    return out.transpose(1, 2)


def _attention_world(rank: int, world: int, cases: list[tuple]) -> list[float]:
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    group, errors = dist.group.WORLD, []
    for seq, chunk, heads, kv_heads, offload, rope, module in cases:
        torch.manual_seed(0)  # the same whole problem on every rank
        batch, hd, hidden = 2, 4, 12
        features = (heads + 2 * kv_heads) * hd
        x = torch.randn(seq, batch, hidden)
        w, b = torch.randn(features, hidden) / hidden ** 0.5, torch.randn(features)
        dense_w, dense_b = torch.randn(hidden, heads * hd), torch.randn(hidden)
        angles = torch.randn(seq, 1, 1, hd)  # any rotation per position
        tables = (angles.cos(), angles.sin()) if rope else None
        grad_out = torch.randn(seq, batch, hidden) if module else torch.randn(batch, seq, heads, hd)
        refs = [t.clone().requires_grad_() for t in (x, w, b, dense_w, dense_b)]
        ref = _whole_attention(*refs[:3], heads, kv_heads, hd, tables)
        if module:
            ref = ref.flatten(2).transpose(0, 1) @ refs[3].t() + refs[4]
        ref.backward(grad_out)

        mine = fpdt_token_order(seq, chunk, world).view(world, -1)[rank]
        local = x[mine].clone().requires_grad_()
        params = [t.clone().requires_grad_() for t in (w, b, dense_w, dense_b)]
        if module:
            config = SimpleNamespace(kv_channels=hd, num_attention_heads=heads, num_key_value_heads=kv_heads,
                                     hidden_size=hidden, attention_dropout=0.0)
            layer = FPDT_Attention(config, params[0], params[1], params[2], params[3], group, return_bias=False,
                                   chunk_size=chunk)
            out, none = layer(local, None, None, tables, cpu_offloading=offload)
            assert none is None
            want, grad = ref[mine], grad_out[mine]
        else:
            impl = _FPDTGPUOffloadingAttentionImpl_ if offload else _FPDTGPUAttentionImpl_
            out = impl.apply(local, None, None, tables, group, 2, 0, hidden, heads * hd, hd, kv_heads * hd,
                             params[0], params[1], 0.0, seq // chunk, offload)
            want, grad = ref[:, mine], grad_out[:, mine]
        out.backward(grad)
        param_grads = [p.grad for p in params if p.grad is not None]
        for g in param_grads:
            dist.all_reduce(g)  # each rank's share of the whole sequence's gradient
        errors.append(max(_relative(out, want), _relative(local.grad, refs[0].grad[mine]),
                          *(_relative(g, r.grad) for g, r in zip(param_grads, refs[1:], strict=False))))
    dist.destroy_process_group()
    return errors


# (S, C, heads, kv_heads, offload, rotary, through FPDT_Attention)
ATTENTION_CASES = [
    (32, 32, 4, 4, False, False, False),  # one chunk: plain Ulysses
    (32, 16, 4, 4, False, False, False),  # 2 chunks
    (32, 8, 4, 4, False, True, False),    # 4 chunks, rotary
    (32, 8, 4, 4, True, False, False),    # offloaded, 4 chunks
    (48, 8, 4, 2, True, True, False),     # offloaded, 6 chunks, grouped heads, rotary
    (32, 8, 4, 1, False, False, False),   # one key/value head over 2 ranks: replicated
    (32, 8, 4, 2, True, True, True),      # FPDT_Attention with the output projection and bias
    (32, 16, 2, 2, False, False, True),   # FPDT_Attention, 2 chunks, not offloaded
]


@pytest.mark.timeout(150)
def test_fpdt_attention_equals_whole_causal_attention() -> None:
    errors = run_world(_attention_world, 2, ATTENTION_CASES, timeout=120)
    for case, rank0, rank1 in zip(ATTENTION_CASES, *errors, strict=True):
        assert max(rank0, rank1) < 1e-5, (case, rank0, rank1)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("add_bias", [True, False])
def test_ffn_equals_unchunked_mlp(add_bias: bool) -> None:
    torch.manual_seed(1)
    x, w1, b1, w2, b2 = (torch.randn(*s, dtype=torch.float64) for s in ((12, 2, 6), (10, 6), (10,), (6, 10), (6,)))
    grad = torch.randn(12, 2, 6, dtype=torch.float64)
    ref = [t.clone().requires_grad_() for t in (x, w1, b1, w2, b2)]
    want = F.linear(F.gelu(F.linear(ref[0], ref[1], ref[2]), approximate="tanh"), ref[3], ref[4])
    want.backward(grad)
    mine = [t.clone().requires_grad_() for t in (x, w1, b1, w2, b2)]
    out, bias = FPDT_FFN.apply(*mine, add_bias, 4)
    total = out if add_bias else out + bias
    assert (bias is None) == add_bias
    total.backward(grad)
    assert torch.allclose(total, want, atol=1e-12)
    for got, expected in zip(mine, ref, strict=True):
        assert torch.allclose(got.grad, expected.grad, atol=1e-12)
    with pytest.raises(UsageError, match="not a multiple of chunk_size=5"):
        FPDT_FFN.apply(*mine, add_bias, 5)


def _loss_world(rank: int, world: int, num_chunk: int) -> float:
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    torch.manual_seed(2)
    seq, batch, hidden, vocab = 16, 2, 6, 11
    h, head = torch.randn(seq, batch, hidden), torch.randn(vocab, hidden)
    labels, mask = torch.randint(vocab, (batch, seq)), (torch.rand(batch, seq) > 0.3).float()
    ref_h, ref_head = h.clone().requires_grad_(), head.clone().requires_grad_()
    whole = F.cross_entropy(F.linear(ref_h, ref_head).flatten(0, 1), labels.t().reshape(-1),
                            reduction="none").view(seq, batch)
    (whole * mask.t()).sum().backward()

    args = SimpleNamespace(ds_sequence_parallel_fpdt_chunk_size=8)
    mine = fpdt_token_order(seq, 8, world).view(world, -1)[rank]
    local_labels, local_mask = FPDT_InputConstruct(labels, labels, mask, None, None, args, world, rank).generate()[1:3]
    local_h = h[mine].clone().requires_grad_()
    local_head = head.clone().requires_grad_()
    losses = FPDT_LogitsLoss.apply(local_h, local_labels, local_head, rank, world, dist.group.WORLD, num_chunk)
    (losses * local_mask.t()).sum().backward()  # the gathered loss mask is in the gathered losses' order
    # every rank's loss reads every rank's tokens: each holds `world` times its share, and the
    # average over the ranks (the engine's) is the whole sequence's gradient
    dist.all_reduce(local_head.grad)
    order = fpdt_token_order(seq, 8, world)
    error = max(_relative(losses, whole.detach()[order]), _relative(local_h.grad / world, ref_h.grad[mine]),
                _relative(local_head.grad / world, ref_head.grad))
    dist.destroy_process_group()
    return error


@pytest.mark.timeout(90)
@pytest.mark.parametrize("num_chunk", [1, 4])
def test_logits_loss_equals_whole_cross_entropy(num_chunk: int) -> None:
    errors = run_world(_loss_world, 2, num_chunk, timeout=60)
    assert max(errors) < 1e-5, errors


def _deepspeed_test_world(rank: int, world: int) -> float:
    """DeepSpeed's own ``TestFPDTAttention`` body (fp16, its calls and layouts), smaller, on gloo."""
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    torch.manual_seed(42)
    batch, seq, chunk, heads, head_dim = 2, 64, 16, 4, 8
    dim = heads * head_dim
    x = torch.randn(seq, batch, dim, dtype=torch.half)
    w = (torch.randn(3 * dim, dim) * 0.02).half()
    b = (torch.randn(3 * dim) * 0.02).half()
    args = SimpleNamespace(ds_sequence_parallel_fpdt_chunk_size=chunk)
    local = FPDT_InputConstruct(x.permute(1, 0, 2), None, None, None, None, args, world, rank).generate()[0]
    local = local.permute(1, 0, 2)
    chunks = local.shape[0] * world // chunk
    out = _FPDTGPUOffloadingAttentionImpl_.apply(local, None, None, None, dist.group.WORLD, 2, 0, dim, dim, head_dim,
                                                 dim, w, b, 0, chunks, True)
    whole = _whole_attention(x.float(), w.float(), b.float(), heads, heads, head_dim, None)
    want = FPDT_InputConstruct(whole, None, None, None, None, args, world, rank).generate()[0]
    dist.destroy_process_group()
    assert out.dtype == torch.half and out.shape == want.shape
    return float((out.float() - want).abs().max())


@pytest.mark.timeout(90)
def test_deepspeeds_fpdt_test_body_runs_on_cpu() -> None:
    errors = run_world(_deepspeed_test_world, 2, timeout=60)
    assert max(errors) < 1e-3, errors  # fp16 activations (outputs ~0.1), float32 math: measured 2e-4
