"""``hybrid_engine.enabled``: ``initialize`` returns DeepSpeed's ``DeepSpeedHybridEngine``, whose
``generate`` is the model's own, at ZeRO-3 with every parameter gathered once for the call
(``pin_parameters``), and gives the unsharded model's tokens; the refused keys say so."""

from __future__ import annotations

import re

import pytest
import torch

from tests.distributed import one_rank, run_world

VOCAB, WIDTH, PROMPT, NEW = 17, 8, 3, 5


class _Greedy(torch.nn.Module):
    """A tiny language model with a ``generate`` that calls ``forward`` once per new token."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(VOCAB, WIDTH)
        self.mix = torch.nn.Linear(WIDTH, WIDTH)
        self.head = torch.nn.Linear(WIDTH, VOCAB)
        self.whole_at_forward: list[bool] = []

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        from dslaunch.runtime.zero import params as zp

        self.whole_at_forward.append(all(not zp.is_partitioned(p) or p.ds_status is zp.ZeroParamStatus.AVAILABLE
                                         for p in self.parameters()))
        return self.head(torch.tanh(self.mix(self.embed(ids).mean(1))))

    @torch.no_grad()
    def generate(self, ids: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
        for _ in range(max_new_tokens):
            ids = torch.cat([ids, self(ids).argmax(-1, keepdim=True)], dim=1)
        return ids


def _generate(rank: int, world: int, pin: bool) -> tuple[str, list[list[int]], list[bool]]:
    import dslaunch

    model = _Greedy()
    engine, *_ = dslaunch.initialize(model=model, config={
        "train_micro_batch_size_per_gpu": 1, "steps_per_print": 10_000,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "hybrid_engine": {"enabled": True, "pin_parameters": pin, "max_out_tokens": 64}})
    prompt = torch.arange(PROMPT * 2).view(2, PROMPT) % VOCAB
    model.whole_at_forward.clear()
    out = engine.generate(prompt, max_new_tokens=NEW)
    return type(engine).__name__, out.tolist(), model.whole_at_forward


@pytest.mark.timeout(90)
@pytest.mark.parametrize("pin", [True, False])
def test_generate_gives_the_unsharded_models_tokens(pin: bool) -> None:
    want = _Greedy().generate(torch.arange(PROMPT * 2).view(2, PROMPT) % VOCAB, NEW).tolist()
    for name, tokens, whole in run_world(_generate, 2, pin):
        assert name == "DeepSpeedHybridEngine" and tokens == want
        # pinned: whole at every token's forward; else gathered per module, so not at its start
        assert whole == [pin] * NEW, whole


@pytest.mark.timeout(60)
@one_rank
def test_refused_keys_say_what_instead() -> None:
    import dslaunch
    from dslaunch.errors import ConfigError

    base = {"train_micro_batch_size_per_gpu": 1}
    for key, value, words in [("inference_tp_size", 2, "tensor-parallel inference kernels"),
                              ("enable_cuda_graph", True, "without CUDA graphs"),
                              ("max_out_tokens", 0, "must be an integer in [1,")]:
        with pytest.raises(ConfigError, match=re.escape(words)) as err:
            dslaunch.DeepSpeedConfig({**base, "hybrid_engine": {"enabled": True, key: value}})
        assert str(err.value).startswith(f"'hybrid_engine.{key}'")
    assert dslaunch.DeepSpeedConfig(base).hybrid_engine.enabled is False
