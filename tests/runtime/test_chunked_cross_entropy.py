"""``deepspeed.runtime.chunked_cross_entropy``: torch's fp32 cross-entropy, values and gradients,
without an fp32 ``[rows, vocab]`` tensor kept for backward (what Hugging Face's loss keeps)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dslaunch.runtime.chunked_cross_entropy import ChunkedCausalLMLoss, chunked_cross_entropy

ROWS, VOCAB, IGNORE = 13, 37, -100
pytestmark = pytest.mark.timeout(60)


def _data(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    logits = (torch.randn(ROWS, VOCAB, generator=g) * 4).to(dtype)
    target = torch.randint(0, VOCAB, (ROWS,), generator=g)
    target[[2, 7]] = IGNORE
    return logits, target


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("reduction", ["none", "sum", "mean"])
@pytest.mark.parametrize("block_rows", [None, 1, 4])
def test_values_and_gradients_are_torchs(dtype: torch.dtype, reduction: str, block_rows: int | None) -> None:
    logits, target = _data(dtype)
    ours = logits.clone().requires_grad_()
    ref = logits.clone().requires_grad_()
    got = chunked_cross_entropy(ours, target, IGNORE, reduction, block_rows, backend="torch")
    want = F.cross_entropy(ref.float(), target, ignore_index=IGNORE, reduction=reduction)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    weight = torch.randn(got.shape, generator=torch.Generator().manual_seed(4))
    (got * weight).sum().backward()
    (want * weight).sum().backward()
    assert ours.grad.dtype == dtype  # the eager path casts its fp32 gradient to the logits' dtype too
    torch.testing.assert_close(ours.grad, ref.grad, rtol=1e-6 if dtype == torch.float32 else 1e-2, atol=1e-6)
    assert not ours.grad[[2, 7]].any()  # ignored rows: no gradient
    assert torch.equal(ours.detach(), logits)  # the caller's logits untouched (fp32 ones too)


def _saved_fp32_full(fn, logits: torch.Tensor, target: torch.Tensor) -> list[torch.Size]:
    """Shapes of the fp32 [rows, vocab] tensors autograd keeps for backward of ``fn``."""
    kept: list[torch.Size] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.dtype == torch.float32 and t.shape == (ROWS, VOCAB):
            kept.append(t.shape)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(logits.clone().requires_grad_(), target)
    return kept


def test_no_fp32_copy_of_the_logits_is_kept() -> None:
    logits, target = _data(torch.bfloat16)
    eager = _saved_fp32_full(lambda x, t: F.cross_entropy(x.float(), t, ignore_index=IGNORE), logits, target)
    ours = _saved_fp32_full(lambda x, t: chunked_cross_entropy(x, t, IGNORE, backend="torch"), logits, target)
    assert eager and not ours  # the eager loss keeps one (its log-softmax); this one none


def test_the_causal_lm_loss_is_hugging_faces() -> None:
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(2, 6, VOCAB, generator=g)
    labels = torch.randint(0, VOCAB, (2, 6), generator=g)
    labels[0, 3] = IGNORE
    shifted = F.pad(labels, (0, 1), value=IGNORE)[..., 1:]
    want = F.cross_entropy(logits.reshape(-1, VOCAB), shifted.reshape(-1), ignore_index=IGNORE)
    loss = ChunkedCausalLMLoss(block_rows=3, backend="torch")
    torch.testing.assert_close(loss(logits, labels, VOCAB), want)
    summed = F.cross_entropy(logits.reshape(-1, VOCAB), shifted.reshape(-1), ignore_index=IGNORE, reduction="sum")
    torch.testing.assert_close(loss(logits, labels, VOCAB, num_items_in_batch=torch.tensor(4)), summed / 4)
    torch.testing.assert_close(loss(logits, None, VOCAB, shift_labels=shifted), want)


def test_bad_input() -> None:
    logits, target = _data(torch.float32)
    bad = target.clone()
    bad[0] = VOCAB
    with pytest.raises(RuntimeError, match="target out of range for a vocabulary of 37"):
        chunked_cross_entropy(logits, bad)
    with pytest.raises(RuntimeError, match="expected torch.long"):
        chunked_cross_entropy(logits, target.int())
    with pytest.raises(ValueError, match="reduction: expected"):
        chunked_cross_entropy(logits, target, reduction="avg")
    with pytest.raises(ValueError, match=r"expected \[rows, vocab\] logits"):
        chunked_cross_entropy(logits[None], target)
    with pytest.raises(ValueError, match="block_rows: expected a positive integer"):
        chunked_cross_entropy(logits, target, block_rows=0)
    with pytest.raises(RuntimeError, match="backend='triton': the Triton cross-entropy needs CUDA"):
        chunked_cross_entropy(logits, target, backend="triton")
    x = logits.clone().requires_grad_()
    loss = chunked_cross_entropy(x, target)
    with pytest.raises(RuntimeError, match="no second derivative"):
        torch.autograd.grad(loss, x, create_graph=True)


def test_peak_memory_is_the_gradient_and_one_block() -> None:
    from dslaunch.runtime.activation_checkpointing.memory import LiveBytes

    logits, target = _data(torch.bfloat16)
    x = logits.clone().requires_grad_()
    with LiveBytes() as live:
        chunked_cross_entropy(x, target, IGNORE, block_rows=2, backend="torch").backward()
    grad, block = ROWS * VOCAB * 2, 2 * VOCAB * 4
    assert grad <= live.peak <= grad + block + 2048, (live.peak, grad, block)  # 2 KiB: per-row vectors
