"""Expert parallelism in the estimate, against a hand computation: each rank holds its
``1/ep`` of the experts whole and ZeRO partitions them over the expert-data group (``dp / ep``
ranks), dense parameters over data parallelism; a Mixtral-style config counts its experts; the
model as built counts every expert whatever ``ep_size`` it was built at."""

from __future__ import annotations

import json

import pytest

from dslaunch.errors import UsageError
from dslaunch.runtime.estimate import ModelShape, TrainingSetup, estimate_memory, from_hf_config, from_module

pytestmark = pytest.mark.timeout(60)

G = 10**9
# 10B parameters of which 8B in 8 experts a layer; 8 GPUs, experts spread over 4 of them
SHAPE = ModelShape.from_counts(10 * G, G // 10, expert_params=8 * G, num_experts=8)


@pytest.mark.parametrize("stage", [0, 1, 3])
def test_experts_are_spread_over_ep_and_partitioned_over_the_expert_data_group(stage: int) -> None:
    est = estimate_memory(SHAPE, TrainingSetup(stage=stage, precision="bf16", gpus_per_node=8, expert_parallel=4))
    held = 2 * G + 8 * G // 4  # dense whole + this rank's 2 of the 8 experts
    shard = 2 * G // 8 + 2 * G // (8 // 4)  # dense over dp 8; its experts over dp / ep = 2 ranks
    owned = shard if stage >= 1 else held
    d = est.device
    assert d.weights == (shard if stage == 3 else held) * 2
    assert d.master == owned * 4 and d.optimizer_state == owned * 8  # bf16: fp32 master, Adam's 8 bytes
    assert d.gradients == (0 if stage == 3 else held * 2 + owned * 4)  # whole bf16 + the fp32 copy of its range
    assert est.host_init == (G // 10 if stage == 3 else held) * 4 * 8  # each local rank builds its experts only
    # without expert parallelism every rank holds all 8B of experts
    assert estimate_memory(SHAPE, TrainingSetup(stage=stage, gpus_per_node=8)).device.weights == \
        (10 * G // 8 if stage == 3 else 10 * G) * 4


def test_the_ds_config_s_autoep_size_is_read_and_a_bad_degree_is_one_line() -> None:
    setup = TrainingSetup.from_ds_config({"expert_parallel": {"enabled": True, "autoep_size": 2}}, gpus_per_node=4)
    assert setup.expert_parallel == 2
    assert TrainingSetup.from_ds_config({"expert_parallel": {"autoep_size": 2}}).expert_parallel == 1  # not enabled
    with pytest.raises(UsageError, match="expert_parallel: got 3; valid: a divisor of the data-parallel size 4"):
        TrainingSetup(gpus_per_node=4, expert_parallel=3)
    with pytest.raises(UsageError, match="valid: a divisor of the model's 8 experts a layer"):
        estimate_memory(ModelShape.from_counts(10 * G, expert_params=8 * G, num_experts=8),
                        TrainingSetup(gpus_per_node=16, expert_parallel=16))


def test_a_mixtral_config_counts_its_experts_and_router(tmp_path) -> None:
    h, ffn, e, n, v, kv = 64, 112, 4, 2, 100, 32
    cfg = {"hidden_size": h, "num_hidden_layers": n, "num_attention_heads": 4, "num_key_value_heads": 2,
           "intermediate_size": ffn, "num_local_experts": e, "vocab_size": v, "hidden_act": "silu",
           "tie_word_embeddings": False}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    shape = from_hf_config(str(tmp_path / "config.json"))
    experts = n * e * 3 * h * ffn
    attention = 2 * h * h + 2 * h * kv
    assert shape.expert_params == experts and shape.num_experts == e
    assert shape.params == experts + n * (attention + h * e + 2 * h) + 2 * v * h + h


def test_a_model_built_at_ep_2_counts_all_its_experts() -> None:
    import torch

    from dslaunch.moe.layer import MoE

    def build(ep: int) -> torch.nn.Module:
        return torch.nn.Sequential(torch.nn.Linear(8, 8), MoE(8, torch.nn.Linear(8, 8), num_experts=4, ep_size=ep))

    whole, spread = from_module(build(1)), from_module(build(2))
    assert whole.expert_params == spread.expert_params == 4 * (8 * 8 + 8)
    assert whole.params == spread.params == 8 * 8 + 8 + 8 * 4 + 4 * (8 * 8 + 8)  # + the router
    assert whole.num_experts == spread.num_experts == 4
