"""``SparseSelfAttention`` and ``BertSparseSelfAttention`` against dense masked attention in
torch (fp32: rtol 1e-4, atol 1e-5), forward and the gradients of queries, keys and values, for
each layout class and block sizes 16 and 32; DeepSpeed's masks (additive key padding mask of
BERT's shape, multiplicative attention mask); and one module's ops never serving another's layout."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from dslaunch.errors import SparsityConfigError
from dslaunch.ops.sparse_attention import (
    BertSparseSelfAttention,
    BigBirdSparsityConfig,
    BSLongformerSparsityConfig,
    DenseSparsityConfig,
    FixedSparsityConfig,
    LocalSlidingWindowSparsityConfig,
    SparseSelfAttention,
    SparsityConfig,
    VariableSparsityConfig,
)

TOL = {"rtol": 1e-4, "atol": 1e-5}
HEADS = 2


def dense_attention(q, k, v, layout, block, kp=None, attn=None):  # noqa: ANN001, ANN201
    """Attention over the layout's kept tiles, in dense torch: the reference."""
    scores = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
    if kp is not None:
        scores = scores + kp.reshape(kp.shape[0], 1, 1, -1)
    if attn is not None:
        scores = scores + torch.where(attn == 0, float("-inf"), 0.0)
    keep = layout.repeat_interleave(block, 1).repeat_interleave(block, 2).bool()
    return torch.softmax(scores.masked_fill(~keep, float("-inf")), -1) @ v


CONFIGS = {
    "dense": lambda b: DenseSparsityConfig(HEADS, block=b),
    "fixed": lambda b: FixedSparsityConfig(HEADS, block=b, num_local_blocks=2, attention="unidirectional"),
    "variable": lambda b: VariableSparsityConfig(HEADS, block=b, num_random_blocks=1, local_window_blocks=[2, 3]),
    "bigbird": lambda b: BigBirdSparsityConfig(HEADS, block=b, different_layout_per_head=True),
    "bslongformer": lambda b: BSLongformerSparsityConfig(HEADS, block=b, global_block_indices=[1]),
    "local": lambda b: LocalSlidingWindowSparsityConfig(HEADS, block=b),
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("block", [16, 32])
def test_sparse_self_attention_equals_dense_masked_attention(name: str, block: int) -> None:
    random.seed(0)
    torch.manual_seed(0)
    cfg = CONFIGS[name](block)
    module = SparseSelfAttention(cfg, max_seq_length=12 * block)
    seq = 8 * block
    q, k, v = (torch.randn(2, HEADS, seq, 16, requires_grad=True) for _ in range(3))
    kp = torch.zeros(2, 1, 1, seq)  # BERT's extended mask shape, squeezed to [batch, seq] inside
    kp[1, ..., -5:] = -10000.0
    out = module(q, k, v, key_padding_mask=kp)
    grads = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    layout = cfg.make_layout(12 * block)[:, :8, :8] if name not in ("variable", "bigbird") else module.get_layout(seq)
    ref = dense_attention(q, k, v, layout, block, kp)
    torch.testing.assert_close(out, ref, **TOL)
    for got, want in zip(grads, torch.autograd.grad(ref, (q, k, v), torch.ones_like(ref)), strict=True):
        torch.testing.assert_close(got, want, **TOL)


@pytest.mark.timeout(30)
def test_attention_mask_multiplies_and_keys_may_come_transposed() -> None:
    torch.manual_seed(1)
    cfg = FixedSparsityConfig(HEADS, block=16, num_local_blocks=2)
    module = SparseSelfAttention(cfg, max_seq_length=64)
    q, k, v = (torch.randn(1, HEADS, 64, 8) for _ in range(3))
    attn = (torch.rand(64, 64) < 0.7).float()
    attn.fill_diagonal_(1.0)
    out = module(q, k.transpose(-1, -2), v, attn_mask=attn)  # [b, h, d, s] keys as DeepSpeed accepts
    torch.testing.assert_close(out, dense_attention(q, k, v, cfg.make_layout(64), 16, attn=attn), **TOL)


@pytest.mark.timeout(30)
def test_each_module_keeps_its_own_ops_per_length() -> None:
    # DeepSpeed's class-wide cache would hand the second module the first one's layout
    first = SparseSelfAttention(LocalSlidingWindowSparsityConfig(HEADS, block=16), max_seq_length=64)
    second = SparseSelfAttention(DenseSparsityConfig(HEADS, block=16), max_seq_length=64)
    q, k, v = (torch.randn(1, HEADS, 64, 8) for _ in range(3))
    first(q, k, v)
    torch.testing.assert_close(second(q, k, v), dense_attention(q, k, v, torch.ones(HEADS, 4, 4), 16), **TOL)


@pytest.mark.timeout(30)
def test_half_precision_runs_where_deepspeed_asserted_fp16_only() -> None:
    cfg = FixedSparsityConfig(HEADS, block=16, num_local_blocks=2)
    module = SparseSelfAttention(cfg, max_seq_length=64)
    q, k, v = (torch.randn(1, HEADS, 64, 8) for _ in range(3))
    ref = dense_attention(q, k, v, cfg.make_layout(64), 16)
    out = module(q.bfloat16(), k.bfloat16(), v.bfloat16())
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref, rtol=3e-2, atol=3e-2)


@pytest.mark.timeout(30)
def test_bert_sparse_self_attention_uses_its_projections() -> None:
    torch.manual_seed(2)
    config = SimpleNamespace(hidden_size=32, num_attention_heads=HEADS)
    cfg = BSLongformerSparsityConfig(HEADS, block=16)
    layer = BertSparseSelfAttention(config, cfg)
    x = torch.randn(2, 64, 32)
    mask = torch.zeros(2, 1, 1, 64)
    mask[0, ..., -7:] = -10000.0
    split = [p(x).view(2, 64, HEADS, 16).transpose(1, 2) for p in (layer.query, layer.key, layer.value)]
    ref = dense_attention(*split, cfg.make_layout(64), 16, kp=mask).transpose(1, 2).reshape(2, 64, 32)
    torch.testing.assert_close(layer(x, mask), ref, **TOL)
    assert isinstance(BertSparseSelfAttention(config).sparse_self_attention.sparsity_config, FixedSparsityConfig)


@pytest.mark.timeout(30)
def test_bad_uses_fail_in_one_line() -> None:
    with pytest.raises(SparsityConfigError, match="SparsityConfig has no layout of its own"):
        SparseSelfAttention()  # DeepSpeed's default: the base class, which has no layout
    module = SparseSelfAttention(DenseSparsityConfig(HEADS, block=16), max_seq_length=64)
    x = torch.randn(1, HEADS, 40, 8)
    with pytest.raises(SparsityConfigError, match="40 is not a multiple of the block size 16"):
        module(x, x, x)
    x = torch.randn(1, HEADS, 80, 8)
    with pytest.raises(SparsityConfigError, match="over max_seq_length 64"):
        module(x, x, x)
    x = torch.randn(1, 3, 64, 8)
    with pytest.raises(SparsityConfigError, match="3 heads but the sparsity config has num_heads=2"):
        module(x, x, x)
    with pytest.raises(SparsityConfigError, match="self-attention only"):
        module(torch.randn(1, HEADS, 64, 8), torch.randn(1, HEADS, 64, 8), torch.randn(1, HEADS, 64, 4))
    with pytest.raises(SparsityConfigError, match="not a multiple of num_attention_heads"):
        BertSparseSelfAttention(SimpleNamespace(hidden_size=30, num_attention_heads=4))
    assert issubclass(SparsityConfigError, ValueError) and SparsityConfig(4).num_layout_heads == 1
