"""``HybridEngineRollout`` on a ``DeepSpeedHybridEngine`` at ZeRO-3 (2 gloo ranks), no Hugging Face
package needed: generation goes through the hybrid engine's ``generate`` (every partitioned
parameter whole at every token's forward, gathered once for the call) and gives the unsharded
model's greedy tokens; without ``pin_parameters`` the module's generate runs, gathering per module."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tests.distributed import run_world
from tests.runtime.test_hybrid_engine import _Greedy

NEW = 4


class _LM(_Greedy):
    """``test_hybrid_engine``'s tiny LM (it records whether its parameters were whole at each
    forward) with Hugging Face's keyword arguments to ``generate``."""

    def generate(self, ids: torch.Tensor, attention_mask: torch.Tensor, max_new_tokens: int, do_sample: bool,
                 **_: object) -> torch.Tensor:
        assert not do_sample and attention_mask.shape == ids.shape
        return super().generate(ids, max_new_tokens)


def _prompts() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.tensor([[0, 3, 4, 5], [6, 7, 8, 9]])
    return ids, torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]])


def _rollout(rank: int, world: int, pin: bool) -> tuple[list[list[int]], list[bool]]:
    import dslaunch
    from dslaunch.runtime.rollout import RolloutConfig, RolloutRequest, SamplingConfig, build_rollout

    model = _LM()
    engine, *_ = dslaunch.initialize(model=model, config={
        "train_micro_batch_size_per_gpu": 1, "steps_per_print": 10_000,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "hybrid_engine": {"enabled": True, "pin_parameters": pin}})
    rollout = build_rollout(RolloutConfig(), engine, SimpleNamespace(pad_token_id=0, eos_token_id=None))
    model.whole_at_forward.clear()
    batch = rollout.generate(RolloutRequest(*_prompts()), SamplingConfig(max_new_tokens=NEW, temperature=0.0))
    return batch.input_ids.tolist(), model.whole_at_forward


@pytest.mark.timeout(90)
@pytest.mark.parametrize("pin", [True, False])
def test_the_rollout_generates_through_the_hybrid_engine(pin: bool) -> None:
    ids, mask = _prompts()
    want = _Greedy().generate(ids, NEW).tolist()
    for tokens, whole in run_world(_rollout, 2, pin):
        assert tokens == want
        # pinned: gathered once for the call, whole at every forward; else per module, not at its start
        assert whole == [pin] * NEW, whole
