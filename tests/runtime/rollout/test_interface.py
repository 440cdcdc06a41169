"""The rollout dataclasses check their shapes and knobs in one line and are frozen; ``build_rollout``
names a bad engine or a missing argument; ``HybridEngineRollout`` pads after the first EOS as
DeepSpeed does and refuses what dslaunch does not have in one line."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

import dslaunch.runtime.rollout as rollout_pkg
from dslaunch.errors import NotInDslaunchError
from dslaunch.runtime.rollout import (
    HybridEngineRollout,
    RolloutBatch,
    RolloutConfig,
    RolloutEngine,
    RolloutRequest,
    SamplingConfig,
    build_rollout,
)
from dslaunch.runtime.rollout.hybrid_engine_rollout import HybridEngineRolloutConfig

TOKENIZER = SimpleNamespace(pad_token_id=0, eos_token_id=2)


@pytest.mark.timeout(30)
def test_the_public_names_are_deepspeeds() -> None:
    assert sorted(rollout_pkg.__all__) == sorted([
        "HybridEngineRollout", "JSDLossOutput", "RolloutBatch", "RolloutConfig", "RolloutEngine",
        "RolloutRequest", "ResponseTokenBatch", "SamplingConfig", "build_rollout", "generalized_jsd_loss"])
    assert issubclass(HybridEngineRollout, RolloutEngine)
    assert (SamplingConfig(max_new_tokens=4).top_k, SamplingConfig(max_new_tokens=4).continuous_batch_size) == (-1, None)
    assert RolloutConfig() == RolloutConfig(engine="hybrid_engine", use_graph_capture=False)
    assert not any(dataclasses.asdict(HybridEngineRolloutConfig()).values())


@pytest.mark.timeout(30)
def test_configs_and_batches_are_frozen() -> None:
    batch = RolloutBatch(torch.zeros(2, 4, dtype=torch.long), torch.ones(2, 4), torch.tensor([2, 2]))
    for obj, field in [(SamplingConfig(max_new_tokens=2), "temperature"), (RolloutConfig(), "engine"),
                       (HybridEngineRolloutConfig(), "use_graph_capture"), (batch, "input_ids")]:
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(obj, field, None)
    assert dataclasses.replace(SamplingConfig(max_new_tokens=2), temperature=0.0).temperature == 0.0


@pytest.mark.timeout(30)
@pytest.mark.parametrize(("kwargs", "words"), [
    ({"max_new_tokens": 0}, "SamplingConfig.max_new_tokens must be an integer >= 1; got 0"),
    ({"max_new_tokens": 2, "n_samples_per_prompt": 0}, "SamplingConfig.n_samples_per_prompt must be an integer >= 1"),
    ({"max_new_tokens": 2, "top_p": 0.0}, "SamplingConfig.top_p must be in (0, 1]; got 0.0"),
    ({"max_new_tokens": 2, "top_p": 1.5}, "SamplingConfig.top_p must be in (0, 1]"),
    ({"max_new_tokens": 2, "top_k": 2.5}, "SamplingConfig.top_k must be an integer"),
    ({"max_new_tokens": 2, "continuous_batch_size": 0}, "SamplingConfig.continuous_batch_size must be an integer"),
])
def test_bad_sampling_is_one_line(kwargs: dict, words: str) -> None:
    with pytest.raises(ValueError, match=r"^[^\n]*$") as err:
        SamplingConfig(**kwargs)
    assert words in str(err.value)


@pytest.mark.timeout(30)
def test_bad_shapes_name_the_field() -> None:
    with pytest.raises(ValueError, match=r"RolloutRequest.prompt_ids must be 2-D \[B, T_p\]; got \(8,\)"):
        RolloutRequest(torch.zeros(8), torch.ones(8))
    with pytest.raises(ValueError, match=r"prompt_attention_mask shape \(2, 5\) does not match prompt_ids \(2, 4\)"):
        RolloutRequest(torch.zeros(2, 4), torch.ones(2, 5))
    with pytest.raises(ValueError, match=r"response_start_idx must be 1-D of length 2; got \(1,\)"):
        RolloutBatch(torch.zeros(2, 4), torch.ones(2, 4), torch.tensor([4]))
    batch = RolloutBatch(torch.zeros(3, 7), torch.ones(3, 7), torch.tensor([2, 2, 2]))
    assert (batch.batch_size, batch.seq_len) == (3, 7)


@pytest.mark.timeout(30)
def test_build_rollout_names_what_is_wrong() -> None:
    with pytest.raises(ValueError, match=r"^Unknown rollout engine 'vllm' \(RolloutConfig.engine\); choose from "
                                         r"'hybrid_engine'$"):
        build_rollout(RolloutConfig(engine="vllm"), object(), TOKENIZER)
    with pytest.raises(ValueError, match=r"^Unknown rollout engine None \(RolloutConfig.engine\)"):
        build_rollout({"engine": "hybrid_engine"}, object(), TOKENIZER)  # not a config object
    with pytest.raises(ValueError, match=r"needs both student_engine and tokenizer; tokenizer is None$"):
        build_rollout(RolloutConfig(), student_engine=object())
    with pytest.raises(ValueError, match=r"student_engine and tokenizer are None$"):
        build_rollout(RolloutConfig())
    engine = object()
    built = build_rollout(RolloutConfig(use_graph_capture=True), engine, TOKENIZER)
    assert isinstance(built, HybridEngineRollout) and built.engine is engine and built.tokenizer is TOKENIZER
    assert built.use_graph_capture is True and built.sync_weights(3) is None and built.get_last_profile() is None


class _Echo(torch.nn.Module):
    """A 'model' whose generate appends token 2 then 5s: what generate is asked is recorded."""

    def __init__(self) -> None:
        super().__init__()
        self.asked: list[dict] = []

    def generate(self, ids: torch.Tensor, **kwargs) -> torch.Tensor:
        self.asked.append(kwargs)
        new = torch.full((ids.shape[0], kwargs["max_new_tokens"]), 5)
        new[0, 1:2] = 2  # row 0 ends at its second token (if it has one)
        return torch.cat([ids, new], dim=1)


@pytest.mark.timeout(30)
def test_generate_asks_for_every_token_and_pads_after_eos() -> None:
    model = _Echo()
    rollout = HybridEngineRollout(SimpleNamespace(module=model), TOKENIZER)
    request = RolloutRequest(torch.tensor([[0, 7, 8], [9, 7, 8]]), torch.tensor([[0, 1, 1], [1, 1, 1]]))
    batch = rollout.generate(request, SamplingConfig(max_new_tokens=4, temperature=0.0, n_samples_per_prompt=2))
    assert batch.input_ids.tolist() == [[0, 7, 8, 5, 2, 0, 0], [0, 7, 8, 5, 5, 5, 5],
                                        [9, 7, 8, 5, 5, 5, 5], [9, 7, 8, 5, 5, 5, 5]]
    assert batch.attention_mask.tolist() == [[0, 1, 1, 1, 1, 0, 0], [0, 1, 1, 1, 1, 1, 1],
                                             [1, 1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1]]
    assert batch.attention_mask.dtype == torch.long and batch.response_start_idx.tolist() == [3] * 4
    greedy, = model.asked
    assert greedy["eos_token_id"] is None and greedy["do_sample"] is False and greedy["pad_token_id"] == 0
    assert greedy["attention_mask"].tolist() == [[0, 1, 1], [0, 1, 1], [1, 1, 1], [1, 1, 1]]
    rollout.generate(request, SamplingConfig(max_new_tokens=1, temperature=0.5, top_p=0.8, top_k=-1))
    sampled = model.asked[-1]
    assert (sampled["do_sample"], sampled["temperature"], sampled["top_p"], sampled["top_k"]) == (True, 0.5, 0.8, 0)


@pytest.mark.timeout(30)
def test_pad_falls_back_to_eos_and_an_eos_that_is_the_pad_still_counts() -> None:
    ids = torch.tensor([[4, 6, 2, 6, 2], [4, 6, 6, 6, 6]])
    out, mask = HybridEngineRollout._pad_after_eos(ids, 1, 2, 2)
    assert out.tolist() == [[4, 6, 2, 2, 2], [4, 6, 6, 6, 6]] and mask.tolist() == [[1, 1, 0, 0], [1, 1, 1, 1]]
    out, mask = HybridEngineRollout._pad_after_eos(ids, 1, [6, 9], 0)  # several EOS ids
    assert out.tolist() == [[4, 6, 0, 0, 0], [4, 6, 0, 0, 0]] and mask.tolist() == [[1, 0, 0, 0]] * 2
    model = _Echo()
    HybridEngineRollout(SimpleNamespace(module=model), SimpleNamespace(pad_token_id=None, eos_token_id=2)).generate(
        RolloutRequest(torch.ones(1, 2, dtype=torch.long), torch.ones(1, 2)), SamplingConfig(max_new_tokens=1))
    assert model.asked[0]["pad_token_id"] == 2
    with pytest.raises(ValueError, match="^The tokenizer must define pad_token_id or eos_token_id"):
        HybridEngineRollout(SimpleNamespace(module=model), SimpleNamespace(pad_token_id=None, eos_token_id=None)
                            ).generate(RolloutRequest(torch.ones(1, 2), torch.ones(1, 2)), SamplingConfig(max_new_tokens=1))


@pytest.mark.timeout(30)
def test_what_dslaunch_lacks_is_refused_in_one_line() -> None:
    model = _Echo()
    engine = SimpleNamespace(module=model)
    request = RolloutRequest(torch.ones(1, 2, dtype=torch.long), torch.ones(1, 2))
    graphs = HybridEngineRollout(engine, TOKENIZER, HybridEngineRolloutConfig(use_graph_capture=True))
    with pytest.raises(NotInDslaunchError, match=r"^use_graph_capture=True \(CUDA-graph greedy decoding\) is not "):
        graphs.generate(request, SamplingConfig(max_new_tokens=2, temperature=0.0))
    assert graphs.generate(request, SamplingConfig(max_new_tokens=2)).seq_len == 4  # sampling never captured
    with pytest.raises(NotInDslaunchError, match=r"^SamplingConfig.continuous_batch_size is not implemented"):
        graphs.generate(request, SamplingConfig(max_new_tokens=2, continuous_batch_size=4))
    with pytest.raises(NotInDslaunchError, match=r"^HybridEngineRolloutConfig.use_shared_prefill=True is not "):
        HybridEngineRollout(engine, TOKENIZER, HybridEngineRolloutConfig(use_shared_prefill=True))
    assert len(model.asked) == 1


class _Counting(torch.nn.Module):
    """A greedy 'model' whose generate calls forward once per new token, as a causal LM does."""

    def __init__(self) -> None:
        super().__init__()
        self.head = torch.nn.Embedding(9, 9)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(ids[:, -1])

    def generate(self, ids: torch.Tensor, max_new_tokens: int, **_: object) -> torch.Tensor:
        for _ in range(max_new_tokens):
            ids = torch.cat([ids, self(ids).argmax(-1, keepdim=True)], dim=1)
        return ids


@pytest.mark.timeout(30)
def test_profiling_times_the_prefill_and_every_decode_forward() -> None:
    model = _Counting()
    request = RolloutRequest(torch.tensor([[3, 4], [5, 6]]), torch.ones(2, 2, dtype=torch.long))
    plain = HybridEngineRollout(SimpleNamespace(module=model), TOKENIZER)
    plain.generate(request, SamplingConfig(max_new_tokens=3))
    assert plain.get_last_profile() is None
    rollout = HybridEngineRollout(SimpleNamespace(module=model), TOKENIZER, HybridEngineRolloutConfig(enable_profiling=True))
    rollout.generate(request, SamplingConfig(max_new_tokens=5, n_samples_per_prompt=3))
    profile = rollout.get_last_profile()
    assert {k: profile[k] for k in ("num_decode_forwards", "num_generated_tokens", "batch_size", "num_samples_per_prompt",
                                    "prompt_length", "response_length")} == {
        "num_decode_forwards": 4, "num_generated_tokens": 30, "batch_size": 2, "num_samples_per_prompt": 3,
        "prompt_length": 2, "response_length": 5}
    parts = ("prompt_expansion_ms", "generation_ms", "post_processing_ms")
    assert all(profile[k] >= 0.0 for k in (*parts, "prefill_forward_ms", "decode_forward_ms", "generation_overhead_ms"))
    assert abs(sum(profile[k] for k in parts) - profile["total_ms"]) < 1e-6
    assert profile["prefill_forward_ms"] + profile["decode_forward_ms"] <= profile["generation_ms"]
    assert profile["tokens_per_second"] == pytest.approx(30 / (profile["total_ms"] / 1000.0))
    assert not model._forward_hooks and not model._forward_pre_hooks  # the timer's hooks are gone
