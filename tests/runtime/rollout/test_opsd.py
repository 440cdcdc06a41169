"""``generalized_jsd_loss`` against the divergences written out from probabilities (forward KL at
beta 0, reverse KL at 1, the mixture JSD between), its gradients against autograd of that direct
form, and ``ResponseTokenBatch``'s shifted response-only targets."""

from __future__ import annotations

import pytest
import torch

from dslaunch.runtime.rollout import (
    JSDLossOutput,
    ResponseTokenBatch,
    RolloutBatch,
    generalized_jsd_loss,
)

B, T, V = 3, 5, 11


def _logits(seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(B, T, V, generator=gen, dtype=torch.float64) * 2).requires_grad_()


def _mask() -> torch.Tensor:
    mask = torch.zeros(B, T, dtype=torch.bool)
    mask[0, 1:4] = mask[1, 2:] = True  # row 2 counts nothing
    return mask


def _direct(student: torch.Tensor, teacher: torch.Tensor, mask: torch.Tensor, beta: float,
            temperature: float = 1.0) -> torch.Tensor:
    """The masked token mean of the divergence, from probabilities and plain logarithms."""
    p_s, p_t = (student / temperature).softmax(-1), (teacher / temperature).softmax(-1)
    if beta == 0.0:
        per_token = (p_t * (p_t.log() - p_s.log())).sum(-1)
    elif beta == 1.0:
        per_token = (p_s * (p_s.log() - p_t.log())).sum(-1)
    else:
        mix = beta * p_t + (1 - beta) * p_s
        per_token = beta * (p_t * (p_t / mix).log()).sum(-1) + (1 - beta) * (p_s * (p_s / mix).log()).sum(-1)
    return (per_token * mask).sum() / mask.sum()


@pytest.mark.timeout(30)
@pytest.mark.parametrize("beta", [0.0, 0.1, 0.5, 0.9, 1.0])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_the_loss_and_its_gradients_equal_the_direct_divergence(beta: float, temperature: float) -> None:
    student, teacher, mask = _logits(0), _logits(1), _mask()
    out = generalized_jsd_loss(student, teacher, mask, beta=beta, temperature=temperature)
    assert isinstance(out, JSDLossOutput)
    assert out.valid_token_count.dtype == torch.long and out.valid_token_count.item() == 6
    assert torch.allclose(out.loss, out.loss_sum / 6)
    want = _direct(student, teacher, mask, beta, temperature)
    assert out.loss.item() > 1e-3 and torch.allclose(out.loss, want, rtol=1e-10, atol=1e-12)
    got = torch.autograd.grad(out.loss, (student, teacher))
    ref = torch.autograd.grad(want, (student, teacher))
    for mine, theirs in zip(got, ref, strict=True):
        assert torch.allclose(mine, theirs, rtol=1e-8, atol=1e-12)
        assert mine[2].abs().max() == 0 and mine[0, 0].abs().max() == 0  # unmasked tokens get no gradient
        assert mine[0, 1].abs().max() > 0


@pytest.mark.timeout(30)
def test_the_ends_are_torchs_kl_divergences() -> None:
    student, teacher, mask = _logits(2), _logits(3), torch.ones(B, T, dtype=torch.bool)
    s_log, t_log = student.log_softmax(-1), teacher.log_softmax(-1)
    forward = torch.nn.functional.kl_div(s_log, t_log, log_target=True, reduction="sum") / (B * T)
    reverse = torch.nn.functional.kl_div(t_log, s_log, log_target=True, reduction="sum") / (B * T)
    assert torch.allclose(generalized_jsd_loss(student, teacher, mask, beta=0.0).loss, forward)
    assert torch.allclose(generalized_jsd_loss(student, teacher, mask, beta=1.0).loss, reverse)
    # in between, a true divergence: symmetric at 0.5, zero between equal distributions
    half = generalized_jsd_loss(student, teacher, mask).loss
    assert torch.allclose(half, generalized_jsd_loss(teacher, student, mask).loss)
    assert generalized_jsd_loss(student, student.detach() + 3.0, mask).loss.abs().item() < 1e-12


@pytest.mark.timeout(30)
def test_teacher_top_k_and_pointwise_clip() -> None:
    student, teacher, mask = _logits(4), _logits(5), _mask()
    k = 4
    keep = teacher.topk(k, dim=-1).indices
    want = _direct(student.gather(-1, keep), teacher.gather(-1, keep), mask, 0.3)
    assert torch.allclose(generalized_jsd_loss(student, teacher, mask, beta=0.3, teacher_top_k=k).loss, want)
    # top-k over the whole vocabulary changes nothing
    full = generalized_jsd_loss(student, teacher, mask, beta=0.3).loss
    assert torch.allclose(generalized_jsd_loss(student, teacher, mask, beta=0.3, teacher_top_k=V).loss, full)
    # each vocabulary entry's term is capped before the sum over the vocabulary
    p_s, p_t = student.softmax(-1), teacher.softmax(-1)
    terms = (p_t * (p_t.log() - p_s.log())).clamp(max=0.01)
    clipped = (terms.sum(-1) * mask).sum() / mask.sum()
    got = generalized_jsd_loss(student, teacher, mask, beta=0.0, pointwise_clip=0.01).loss
    assert torch.allclose(got, clipped) and got < generalized_jsd_loss(student, teacher, mask, beta=0.0).loss


@pytest.mark.timeout(30)
def test_no_counted_token_gives_a_zero_loss_not_nan() -> None:
    out = generalized_jsd_loss(_logits(6), _logits(7), torch.zeros(B, T))
    assert out.loss.item() == 0.0 and out.valid_token_count.item() == 0


@pytest.mark.timeout(30)
@pytest.mark.parametrize(("kwargs", "words"), [
    ({"beta": 1.5}, "beta must be in [0, 1]; got 1.5"),
    ({"temperature": 0.0}, "temperature must be positive"),
    ({"teacher_top_k": 0}, "teacher_top_k must be positive"),
    ({"teacher_top_k": V + 1}, f"must not exceed the vocabulary size {V}"),
    ({"pointwise_clip": -1.0}, "pointwise_clip must be non-negative"),
    ({"response_mask": torch.ones(B, T + 1)}, "response_mask shape (3, 6) must match"),
    ({"teacher_logits": torch.zeros(B, T, V + 1)}, "must have matching 3-D shapes"),
])
def test_bad_arguments_are_one_line(kwargs: dict, words: str) -> None:
    args = {"student_logits": _logits(0), "teacher_logits": _logits(1), "response_mask": _mask(), **kwargs}
    with pytest.raises(ValueError, match=r"^[^\n]*$") as err:
        generalized_jsd_loss(**args)
    assert words in str(err.value)


def _rollout() -> RolloutBatch:
    # row 0: prompt of 3 (1 pad), response of 2 then padding; row 1: full prompt, full response
    ids = torch.tensor([[0, 5, 6, 7, 8, 0], [4, 5, 6, 9, 9, 9]])
    mask = torch.tensor([[0, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1]])
    return RolloutBatch(input_ids=ids, attention_mask=mask, response_start_idx=torch.tensor([3, 3]))


@pytest.mark.timeout(30)
def test_response_targets_are_the_response_tokens_shifted_by_one() -> None:
    targets = ResponseTokenBatch.from_rollout(_rollout())
    assert targets.target_ids.tolist() == [[5, 6, 7, 8, 0], [5, 6, 9, 9, 9]]
    assert targets.response_mask.tolist() == [[False, False, True, True, False], [False, False, True, True, True]]
    logits = torch.randn(2, 6, 10)
    assert torch.equal(targets.select_causal_logits(logits), logits[:, :5])
    # the logits at a counted column predict the response token after it
    picked = targets.select_causal_logits(logits).gather(-1, targets.target_ids.unsqueeze(-1))[..., 0][targets.response_mask]
    assert torch.equal(picked, torch.stack([logits[0, 2, 7], logits[0, 3, 8], logits[1, 2, 9], logits[1, 3, 9],
                                            logits[1, 4, 9]]))
    with pytest.raises(AttributeError):
        targets.target_ids = targets.input_ids  # frozen


@pytest.mark.timeout(30)
def test_bad_rollouts_and_logits_are_one_line() -> None:
    good = _rollout()
    for start, words in [(torch.tensor([0, 3]), "must be in [1, sequence_length] = [1, 6]"),
                         (torch.tensor([3, 7]), "must be in [1, sequence_length]"),
                         (torch.tensor([3.0, 3.0]), "must use an integer dtype")]:
        with pytest.raises(ValueError, match="response_start_idx") as err:
            ResponseTokenBatch.from_rollout(RolloutBatch(good.input_ids, good.attention_mask, start))
        assert words in str(err.value)
    targets = ResponseTokenBatch.from_rollout(good)
    with pytest.raises(ValueError, match="logits must be 3-D"):
        targets.select_causal_logits(torch.zeros(2, 6))
    with pytest.raises(ValueError, match="must match input_ids"):
        targets.select_causal_logits(torch.zeros(2, 5, 10))
