"""On-policy self-distillation (DeepSpeed 0.19.8's ``deepspeed.runtime.rollout.opsd``): response-only
causal targets of a rollout (``ResponseTokenBatch``) and the generalized Jensen-Shannon divergence
between a student's and a teacher's next-token distributions on them (``generalized_jsd_loss``).

With mixture ``M = beta * P_teacher + (1 - beta) * P_student`` the per-token divergence is
``beta * KL(P_teacher || M) + (1 - beta) * KL(P_student || M)``, which at ``beta = 0`` is taken as
the forward ``KL(P_teacher || P_student)`` and at ``beta = 1`` as the reverse
``KL(P_student || P_teacher)`` (the limits of the generalized JSD divided by ``beta (1 - beta)``,
the convention of GKD/OPSD trainers).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from dslaunch.runtime.rollout.base import RolloutBatch

__all__ = ["JSDLossOutput", "ResponseTokenBatch", "generalized_jsd_loss"]


@dataclass(frozen=True)
class ResponseTokenBatch:
    """A rollout as causal-LM training data whose targets are its response tokens only.

    ``target_ids`` and ``response_mask`` are one column shorter than ``input_ids``: the logits at
    column ``i`` predict ``target_ids[:, i]`` (token ``i + 1``), which counts where
    ``response_mask[:, i]`` is true (a real token at or after the row's response start).
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    target_ids: torch.Tensor
    response_mask: torch.Tensor

    @classmethod
    def from_rollout(cls, rollout: RolloutBatch) -> ResponseTokenBatch:
        """The response-only causal targets of ``rollout``.

        Raises:
            ValueError: the rollout's tensors are on different devices, ``response_start_idx`` is
                not an integer tensor, or a start is outside ``[1, seq_len]`` (the first token has
                no logits predicting it).
        """
        ids, mask, start = rollout.input_ids, rollout.attention_mask, rollout.response_start_idx
        if mask.device != ids.device:
            raise ValueError("rollout input_ids and attention_mask must be on the same device; got "
                             f"{ids.device} and {mask.device}")
        if start.device != ids.device:
            raise ValueError("rollout input_ids and response_start_idx must be on the same device; got "
                             f"{ids.device} and {start.device}")
        if start.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"rollout response_start_idx must use an integer dtype (int32 or int64); got {start.dtype}")
        width = ids.shape[1]
        if bool(((start < 1) | (start > width)).any()):
            raise ValueError(f"rollout response_start_idx must be in [1, sequence_length] = [1, {width}]; "
                             f"got {start.tolist()}")
        predicted = torch.arange(1, width, device=ids.device)  # the column each target sits at
        in_response = predicted.unsqueeze(0) >= start.unsqueeze(1)
        return cls(input_ids=ids, attention_mask=mask, target_ids=ids[:, 1:],
                   response_mask=mask[:, 1:].bool() & in_response)

    def select_causal_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits [B, T, V]`` of ``input_ids`` cut to the ``T - 1`` columns that have a target."""
        if logits.dim() != 3:
            raise ValueError(f"logits must be 3-D [batch, sequence_length, vocabulary_size]; got {tuple(logits.shape)}")
        if logits.shape[:2] != self.input_ids.shape:
            raise ValueError(f"logits batch and sequence dimensions {tuple(logits.shape[:2])} must match "
                             f"input_ids {tuple(self.input_ids.shape)}")
        return logits[:, :-1, :]


@dataclass(frozen=True)
class JSDLossOutput:
    """``loss = loss_sum / max(valid_token_count, 1)``; the sum and count are kept so data-parallel
    ranks can all-reduce both and divide once (a token-weighted mean over the whole batch)."""

    loss: torch.Tensor
    loss_sum: torch.Tensor
    valid_token_count: torch.Tensor


def _check_jsd_args(student: torch.Tensor, teacher: torch.Tensor, mask: torch.Tensor, beta: float,
                    temperature: float, teacher_top_k: int | None, pointwise_clip: float | None) -> None:
    if student.shape != teacher.shape or student.dim() != 3:
        raise ValueError("student_logits and teacher_logits must have matching 3-D shapes; got "
                         f"{tuple(student.shape)} and {tuple(teacher.shape)}")
    if mask.shape != student.shape[:2]:
        raise ValueError(f"response_mask shape {tuple(mask.shape)} must match logits batch and sequence "
                         f"dimensions {tuple(student.shape[:2])}")
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"beta must be in [0, 1]; got {beta!r}")
    if temperature <= 0.0:
        raise ValueError(f"temperature must be positive; got {temperature!r}")
    if teacher_top_k is not None and not 0 < teacher_top_k <= student.shape[-1]:
        raise ValueError(f"teacher_top_k must be positive and must not exceed the vocabulary size "
                         f"{student.shape[-1]}; got {teacher_top_k!r}")
    if pointwise_clip is not None and pointwise_clip < 0.0:
        raise ValueError(f"pointwise_clip must be non-negative when specified; got {pointwise_clip!r}")


def _kl_terms(p_log: torch.Tensor, q_log: torch.Tensor) -> torch.Tensor:
    """``P * (log P - log Q)`` per vocabulary entry (summing over the last axis gives KL(P || Q))."""
    return p_log.exp() * (p_log - q_log)


def generalized_jsd_loss(student_logits: torch.Tensor,
                         teacher_logits: torch.Tensor,
                         response_mask: torch.Tensor,
                         beta: float = 0.5,
                         temperature: float = 1.0,
                         teacher_top_k: int | None = None,
                         pointwise_clip: float | None = None) -> JSDLossOutput:
    """The generalized JSD between student and teacher, averaged over the tokens of ``response_mask``.

    Args:
        student_logits, teacher_logits: ``[B, T, V]`` logits (gradients flow through both).
        response_mask: ``[B, T]``, true (or 1) where a token counts.
        beta: the teacher's weight in the mixture; 0 is forward KL(teacher || student), 1 reverse
            KL(student || teacher).
        temperature: both logits are divided by it before the softmax.
        teacher_top_k: if set, both distributions are renormalised over the teacher's ``k`` most
            likely entries of each token.
        pointwise_clip: if set, each vocabulary entry's contribution is capped at it before the
            per-token sum.

    Returns:
        ``JSDLossOutput``: the mean over counted tokens, their sum, and their count.

    Raises:
        ValueError: shapes disagree, or an argument is outside its range (one line naming it).
    """
    _check_jsd_args(student_logits, teacher_logits, response_mask, beta, temperature, teacher_top_k,
                    pointwise_clip)
    student, teacher = student_logits / temperature, teacher_logits / temperature
    if teacher_top_k is not None:
        keep = teacher.topk(teacher_top_k, dim=-1).indices
        student, teacher = student.gather(-1, keep), teacher.gather(-1, keep)
    s_log, t_log = F.log_softmax(student, dim=-1), F.log_softmax(teacher, dim=-1)
    if beta == 0.0:
        terms = _kl_terms(t_log, s_log)
    elif beta == 1.0:
        terms = _kl_terms(s_log, t_log)
    else:
        # log M computed in log space: exp of log-probabilities can underflow to 0 for rare tokens
        mix_log = torch.logaddexp(s_log + math.log1p(-beta), t_log + math.log(beta))
        terms = beta * _kl_terms(t_log, mix_log) + (1.0 - beta) * _kl_terms(s_log, mix_log)
    if pointwise_clip is not None:
        terms = terms.clamp(max=pointwise_clip)
    weight = response_mask.to(dtype=terms.dtype)
    loss_sum = (terms.sum(dim=-1) * weight).sum()
    count = weight.sum().to(dtype=torch.long)
    return JSDLossOutput(loss=loss_sum / count.clamp_min(1), loss_sum=loss_sum, valid_token_count=count)
