"""The rollout interface (DeepSpeed 0.19.8's ``deepspeed.runtime.rollout.base``): what an RL or
on-policy distillation loop hands its rollout engine (``RolloutRequest``, ``SamplingConfig``), what it
gets back (``RolloutBatch``), and the engine's abstract base (``RolloutEngine``).

Everything is a frozen dataclass: a loop that wants a changed copy uses ``dataclasses.replace``.
Shapes and knobs are checked at construction, so a wrong batch or setting fails in one line naming
the field, not deep inside generation.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

__all__ = ["RolloutBatch", "RolloutConfig", "RolloutEngine", "RolloutRequest", "SamplingConfig"]


@dataclass(frozen=True)
class RolloutConfig:
    """Which rollout engine ``build_rollout`` makes, and its options."""

    engine: str = "hybrid_engine"
    """The engine's name; ``"hybrid_engine"`` (``HybridEngineRollout``) is the one there is."""
    use_graph_capture: bool = False
    """CUDA-graph greedy decoding (refused by dslaunch at the greedy ``generate``)."""


def _at_least(name: str, value: object, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"SamplingConfig.{name} must be an integer >= {low}; got {value!r}")


@dataclass(frozen=True)
class SamplingConfig:
    """How ``RolloutEngine.generate`` samples, per call.

    ``temperature <= 0`` is greedy decoding (then ``top_p`` and ``top_k`` are unused); ``top_k <= 0``
    turns top-k filtering off and ``top_p == 1`` nucleus filtering. Every prompt is sampled
    ``n_samples_per_prompt`` times (its copies are adjacent rows of the batch).
    ``continuous_batch_size`` picks DeepSpeed's experimental continuous-batching path (refused by
    dslaunch).
    """

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    n_samples_per_prompt: int = 1
    continuous_batch_size: int | None = None

    def __post_init__(self) -> None:
        _at_least("max_new_tokens", self.max_new_tokens, 1)
        _at_least("n_samples_per_prompt", self.n_samples_per_prompt, 1)
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int):
            raise ValueError(f"SamplingConfig.top_k must be an integer (<= 0: no top-k); got {self.top_k!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"SamplingConfig.top_p must be in (0, 1]; got {self.top_p!r}")
        if self.continuous_batch_size is not None:
            _at_least("continuous_batch_size", self.continuous_batch_size, 1)


def _check_ids_and_mask(owner: object, ids_name: str, mask_name: str, dims: str) -> None:
    """A 2-D id tensor and a mask of its shape, or one line naming the field."""
    ids, mask, where = getattr(owner, ids_name), getattr(owner, mask_name), type(owner).__name__
    if ids.dim() != 2:
        raise ValueError(f"{where}.{ids_name} must be 2-D{dims}; got {tuple(ids.shape)}")
    if mask.shape != ids.shape:
        raise ValueError(f"{where}.{mask_name} shape {tuple(mask.shape)} does not match {ids_name} {tuple(ids.shape)}")


@dataclass(frozen=True)
class RolloutRequest:
    """The prompts of one ``generate`` call, left-padded: each row's real tokens end at its right
    edge, so generated tokens follow them directly."""

    prompt_ids: torch.Tensor
    """``[B, T_p]`` token ids, pad tokens on the left."""
    prompt_attention_mask: torch.Tensor
    """``[B, T_p]``, 1 on real prompt tokens and 0 on padding."""

    def __post_init__(self) -> None:
        _check_ids_and_mask(self, "prompt_ids", "prompt_attention_mask", " [B, T_p]")


@dataclass(frozen=True)
class RolloutBatch:
    """What ``generate`` returns: each row is its (left-padded) prompt followed by its response,
    right-padded to the batch's width; row ``i`` is sample ``i % n`` of prompt ``i // n``."""

    input_ids: torch.Tensor
    """``[B * n, T_p + T_r]`` prompt then response token ids."""
    attention_mask: torch.Tensor
    """``[B * n, T_p + T_r]``, 1 on real prompt and response tokens (an EOS included), 0 on padding."""
    response_start_idx: torch.Tensor
    """``[B * n]`` the column each row's response starts at (``T_p`` for left-padded prompts)."""

    def __post_init__(self) -> None:
        _check_ids_and_mask(self, "input_ids", "attention_mask", "")
        rows = self.input_ids.shape[0]
        if self.response_start_idx.shape != (rows,):
            raise ValueError(f"RolloutBatch.response_start_idx must be 1-D of length {rows}; got "
                             f"{tuple(self.response_start_idx.shape)}")

    @property
    def batch_size(self) -> int:
        """Rows: prompts times samples per prompt."""
        return int(self.input_ids.shape[0])

    @property
    def seq_len(self) -> int:
        """Columns: prompt width plus response width."""
        return int(self.input_ids.shape[1])


class RolloutEngine(ABC):
    """A rollout engine: ``generate`` prompts into a ``RolloutBatch``; ``sync_weights`` after the
    trainer's step, when the engine holds its own copy of the weights."""

    name: str = "base"

    @abstractmethod
    def generate(self, request: RolloutRequest, sampling: SamplingConfig) -> RolloutBatch:
        """The prompts of ``request`` followed by sampled responses, one tensor per field."""

    @abstractmethod
    def sync_weights(self, step: int) -> None:
        """Bring the engine's weights to the trainer's after optimizer step ``step`` (nothing to do
        for an engine that generates with the training weights themselves)."""

    def shutdown(self) -> None:
        """Release the engine's resources; none by default."""
        return None
