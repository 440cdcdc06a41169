"""``deepspeed.sequence.vocab_parallel_ops`` and ``deepspeed.sequence.linear_cross_entropy``: the
values and gradients of vocabulary-split logits (and of a split LM head) against torch on the whole
vocabulary in one process, on one rank and on two tensor ranks with uneven shards."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.distributed import run_world

VOCAB, HIDDEN, IGNORE = 11, 6, -100
SPLIT = 4  # rank 0 holds ids [0, 4), rank 1 [4, 11): uneven on purpose


def _logits() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    student = torch.randn(2, 5, VOCAB, generator=g, dtype=torch.float64)
    teacher = torch.randn(2, 5, VOCAB, generator=g, dtype=torch.float64)
    student[1, 2] = float("-inf")  # a row with no distribution (padding)
    teacher[0, 1, :3] = float("-inf")  # the teacher masks tokens the student gives probability
    ids = torch.randint(0, VOCAB, (2, 5), generator=g)
    ids[0, 4] = IGNORE
    topk = torch.randint(0, VOCAB, (2, 5, 3), generator=g)
    return student, teacher, ids, topk


def _whole() -> dict[str, torch.Tensor]:
    """Torch's answers on the whole vocabulary: values and the gradients of fixed weightings."""
    student, teacher, ids, topk = _logits()
    s, t = student.clone().requires_grad_(), teacher.clone().requires_grad_()
    log_s, log_t = torch.log_softmax(s, -1), torch.log_softmax(t, -1)
    out = {"logprobs": log_s.gather(-1, ids.clamp(min=0)[..., None]).squeeze(-1).masked_fill(ids == IGNORE, 0.0),
           "topk": log_s.gather(-1, topk),
           "entropy": -torch.where(log_s.exp() > 0, log_s.exp() * log_s, torch.zeros_like(log_s)).sum(-1)
           .masked_fill(torch.isnan(log_s).all(-1), float("nan")),
           # a teacher's masked token adds nothing; -1e4 instead of -inf keeps torch's gradient finite
           "kl": F.kl_div(log_s, torch.log_softmax(t.masked_fill(torch.isinf(t), -1e4), -1), log_target=True,
                          reduction="none").sum(-1),
           "reverse_kl": F.kl_div(log_t, log_s.exp(), reduction="none").sum(-1)}
    weights = torch.linspace(0.5, 1.5, 10, dtype=torch.float64).view(2, 5)
    defined = torch.ones(2, 5, dtype=torch.bool)
    defined[1, 2] = False
    for name in ("logprobs", "entropy", "kl", "reverse_kl"):
        value = out[name]
        grads = torch.autograd.grad((value * weights)[defined & torch.isfinite(value)].sum(), (s, t), allow_unused=True,
                                    retain_graph=True)
        out[f"{name}_grad"] = torch.zeros_like(s) if grads[0] is None else grads[0].nan_to_num(0.0)
        if name.endswith("kl"):
            out[f"{name}_teacher_grad"] = grads[1].nan_to_num(0.0)
    return out


def _ops(student: torch.Tensor, teacher: torch.Tensor, ids: torch.Tensor, topk: torch.Tensor, group: object,
         bounds: dict[str, int]) -> dict[str, torch.Tensor]:
    from dslaunch.sequence import vocab_parallel_ops as ops

    weights = torch.linspace(0.5, 1.5, 10, dtype=torch.float64).view(2, 5)
    out: dict[str, torch.Tensor] = {}
    for name in ("logprobs", "entropy", "kl", "reverse_kl"):
        s, t = student.clone().requires_grad_(), teacher.clone().requires_grad_()
        if name == "logprobs":
            value = ops.vocab_parallel_logprobs(s, ids, tp_group=group, **bounds)
            out["topk"] = ops.vocab_parallel_logprobs(s.detach(), topk, tp_group=group, **bounds)
        elif name == "entropy":
            value = ops.vocab_parallel_entropy(s, tp_group=group)
        else:
            value = ops.vocab_parallel_kl_div(s, t, reverse=name == "reverse_kl", tp_group=group)
        out[name] = value.detach()
        (value * weights).nan_to_num(0.0, posinf=0.0).sum().backward()
        out[f"{name}_grad"] = s.grad
        if name.endswith("kl"):
            out[f"{name}_teacher_grad"] = t.grad
    return out


def _check(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], cols: slice) -> None:
    for name, value in got.items():
        expected = want[name][..., cols] if name.endswith("grad") else want[name]
        torch.testing.assert_close(value.double(), expected, rtol=1e-5, atol=1e-6, equal_nan=True, msg=name)


@pytest.mark.timeout(30)
def test_on_one_rank_they_are_torchs_on_the_whole_vocabulary(monkeypatch) -> None:
    import dslaunch.runtime.sequence_parallel.vocab_parallel_ops as impl

    monkeypatch.setattr(impl, "_CHUNK", 7 * VOCAB)  # several row chunks
    student, teacher, ids, topk = _logits()
    got = _ops(student, teacher, ids, topk, None, {})
    assert got["logprobs"].dtype == torch.float32 and torch.isnan(got["entropy"][1, 2])
    # the teacher masks tokens the student gives probability: only KL(student || teacher) is infinite
    assert got["reverse_kl"][0, 1] == float("inf") and torch.isfinite(got["kl"][0, 1])
    assert not got["entropy_grad"][1, 2].any()  # the undefined row: zero gradient, maskable
    _check(got, _whole(), slice(None))


@pytest.mark.timeout(30)
def test_bad_inputs_are_refused_in_one_line() -> None:
    from dslaunch.sequence import vocab_parallel_ops as ops

    student, teacher, ids, _ = _logits()
    with pytest.raises(ValueError, match=r"ids outside the vocabulary \[0, 11\)"):
        ops.vocab_parallel_logprobs(student, ids.clamp(min=0) + VOCAB)
    with pytest.raises(ValueError, match="optionally followed by a top-k dimension"):
        ops.vocab_parallel_logprobs(student, ids[:, :3])
    with pytest.raises(ValueError, match="needs explicit vocab_start_index"):
        ops.vocab_parallel_logprobs(student, ids, global_vocab_size=VOCAB)
    with pytest.raises(ValueError, match="same shape and split"):
        ops.vocab_parallel_kl_div(student, teacher[..., :5])


def _split(rank: int, world: int) -> dict[str, torch.Tensor]:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    student, teacher, ids, topk = _logits()
    cols = slice(0, SPLIT) if rank == 0 else slice(SPLIT, VOCAB)
    bounds = {"vocab_start_index": cols.start, "vocab_end_index": cols.stop}
    return _ops(student[..., cols], teacher[..., cols], ids, topk, dist.group.WORLD, bounds)


@pytest.mark.timeout(90)
def test_on_two_tensor_ranks_with_uneven_shards_each_holds_its_columns_of_torchs_answer() -> None:
    want = _whole()
    for rank, got in enumerate(run_world(_split, 2)):
        _check(got, want, slice(0, SPLIT) if rank == 0 else slice(SPLIT, VOCAB))


def _head() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(4)
    hidden = torch.randn(2, 7, HIDDEN, generator=g, dtype=torch.float64)
    weight = torch.randn(VOCAB, HIDDEN, generator=g, dtype=torch.float64)
    bias = torch.randn(VOCAB, generator=g, dtype=torch.float64)
    target = torch.randint(0, VOCAB, (2, 7), generator=g)
    target[0, 3] = target[1, 0] = IGNORE
    return hidden, weight, bias, target


def _torch_head(reduction: str) -> tuple[torch.Tensor, ...]:
    hidden, weight, bias, target = (t.requires_grad_() if t.is_floating_point() else t for t in _head())
    loss = F.cross_entropy((hidden @ weight.t() + bias).flatten(0, 1), target.flatten(), ignore_index=IGNORE,
                           reduction=reduction)
    loss.sum().backward()
    return loss.detach().view(-1), hidden.grad, weight.grad, bias.grad


def _fused(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, target: torch.Tensor, group: object,
           bounds: dict[str, int], chunk: int | None) -> dict[str, tuple[torch.Tensor, ...]]:
    from dslaunch.sequence.linear_cross_entropy import vocab_parallel_linear_cross_entropy as fused

    out = {}
    for reduction in ("none", "sum", "mean"):
        h, w, b = (t.clone().requires_grad_() for t in (hidden, weight, bias))
        loss = fused(h, w, target, bias=b, tp_group=group, reduction=reduction, chunk_size=chunk, **bounds)
        loss.sum().backward()
        out[reduction] = (loss.detach().view(-1), h.grad, w.grad, b.grad)
    return out


def _check_head(got: dict[str, tuple[torch.Tensor, ...]], rows: slice) -> None:
    for reduction, (loss, g_hidden, g_weight, g_bias) in got.items():
        want = _torch_head(reduction)
        torch.testing.assert_close(loss.double(), want[0], rtol=1e-5, atol=1e-6, msg=reduction)
        torch.testing.assert_close(g_hidden, want[1], rtol=1e-5, atol=1e-6, msg=reduction)
        torch.testing.assert_close(g_weight, want[2][rows], rtol=1e-5, atol=1e-6, msg=reduction)
        torch.testing.assert_close(g_bias, want[3][rows], rtol=1e-5, atol=1e-6, msg=reduction)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("chunk", [None, 1, 3])
def test_the_fused_head_loss_is_torchs_on_the_projected_logits(chunk: int | None) -> None:
    from dslaunch.sequence.linear_cross_entropy import vocab_parallel_linear_cross_entropy as fused

    hidden, weight, bias, target = _head()
    _check_head(_fused(hidden, weight, bias, target, None, {}, chunk), slice(None))
    with pytest.raises(ValueError, match="chunk_size must be positive"):
        fused(hidden, weight, target, chunk_size=0)
    with pytest.raises(ValueError, match=r"weight must be \[local vocabulary, 6\]"):
        fused(hidden, weight.t(), target)
    with pytest.raises(ValueError, match="reduction: expected one of"):
        fused(hidden, weight, target, reduction="avg")


def _split_head(rank: int, world: int, chunk: int | None) -> dict[str, tuple[torch.Tensor, ...]]:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    hidden, weight, bias, target = _head()
    rows = slice(0, SPLIT) if rank == 0 else slice(SPLIT, VOCAB)
    return _fused(hidden, weight[rows], bias[rows], target, dist.group.WORLD,
                  {"vocab_start_index": rows.start, "vocab_end_index": rows.stop}, chunk)


@pytest.mark.timeout(90)
def test_a_head_split_unevenly_over_two_ranks_gives_torchs_loss_and_each_its_rows_gradient() -> None:
    for rank, got in enumerate(run_world(_split_head, 2, 2)):
        _check_head(got, slice(0, SPLIT) if rank == 0 else slice(SPLIT, VOCAB))
