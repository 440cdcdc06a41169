"""``deepspeed.runtime.rollout`` (DeepSpeed 0.19.8): on-policy generation for RL and distillation
loops, with the training engine's weights.

- ``base.py``: ``RolloutRequest`` in, ``SamplingConfig`` per call, ``RolloutBatch`` out, the
  ``RolloutEngine`` base and ``RolloutConfig``;
- ``hybrid_engine_rollout.py``: ``HybridEngineRollout``, generation through the hybrid engine;
- ``opsd.py``: ``ResponseTokenBatch`` (response-only causal targets) and ``generalized_jsd_loss``;
- ``profile.py``: the rollout's timings (``enable_profiling``);
- ``continuous_batching.py``: DeepSpeed's request scheduler for continuous decode batches;
- ``build_rollout`` (here): the engine a ``RolloutConfig`` names.
"""

from __future__ import annotations

from typing import Any

from dslaunch.runtime.rollout.base import (
    RolloutBatch,
    RolloutConfig,
    RolloutEngine,
    RolloutRequest,
    SamplingConfig,
)
from dslaunch.runtime.rollout.hybrid_engine_rollout import HybridEngineRollout
from dslaunch.runtime.rollout.opsd import JSDLossOutput, ResponseTokenBatch, generalized_jsd_loss

__all__ = [
    "HybridEngineRollout",
    "JSDLossOutput",
    "ResponseTokenBatch",
    "RolloutBatch",
    "RolloutConfig",
    "RolloutEngine",
    "RolloutRequest",
    "SamplingConfig",
    "build_rollout",
    "generalized_jsd_loss",
]

_ENGINES = ("hybrid_engine",)


def build_rollout(rollout_cfg: Any, student_engine: Any = None, tokenizer: Any = None,
                  **kwargs: Any) -> RolloutEngine:  # noqa: ARG001 (DeepSpeed's signature; no engine takes more)
    """The rollout engine ``rollout_cfg.engine`` names, built on ``student_engine``.

    Args:
        rollout_cfg: a ``RolloutConfig`` (any object with an ``engine`` attribute).
        student_engine: the ``DeepSpeedEngine`` whose weights generate.
        tokenizer: the model's tokenizer (its ``pad_token_id`` / ``eos_token_id``).

    Raises:
        ValueError: an unknown engine name, or ``student_engine`` / ``tokenizer`` missing.
    """
    name = getattr(rollout_cfg, "engine", None)
    if name not in _ENGINES:
        raise ValueError(f"Unknown rollout engine {name!r} (RolloutConfig.engine); choose from "
                         + ", ".join(map(repr, _ENGINES)))
    missing = [arg for arg, value in (("student_engine", student_engine), ("tokenizer", tokenizer)) if value is None]
    if missing:
        raise ValueError(f"the {name!r} rollout needs both student_engine and tokenizer; "
                         f"{' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} None")
    return HybridEngineRollout(engine=student_engine, tokenizer=tokenizer, cfg=rollout_cfg)
