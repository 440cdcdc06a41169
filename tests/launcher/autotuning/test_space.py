"""The search space and the ds_config of each candidate."""

from __future__ import annotations

import pytest

from dslaunch.launcher.autotuning.space import Candidate, apply, build_space, dominates, micro_batches
from dslaunch.runtime.config import load_config
from dslaunch.runtime.config.autotuning import AutotuningConfig

pytestmark = pytest.mark.timeout(30)

BASE = {"train_batch_size": 64, "gradient_accumulation_steps": 2, "optimizer": {"type": "AdamW", "params": {}},
        "zero_optimization": {"stage": 1, "reduce_bucket_size": 1000, "offload_optimizer": {"device": "cpu"}},
        "autotuning": {"enabled": True}}


def test_micro_batches_are_powers_of_two_within_the_limits():
    at = AutotuningConfig(max_train_micro_batch_size_per_gpu=100, num_tuning_micro_batch_sizes=3)
    assert micro_batches(at, dp_world=2, gas=1) == [16, 32, 64]
    capped = AutotuningConfig(max_train_batch_size=64, min_train_micro_batch_size_per_gpu=4)
    assert micro_batches(capped, dp_world=2, gas=2) == [4, 8, 16]  # 16 * 2 ranks * 2 steps = 64
    assert micro_batches(AutotuningConfig(max_train_batch_size=2), dp_world=4, gas=1) == []


def test_fast_space_tunes_stage_offload_checkpointing_and_micro_batch():
    space = build_space(AutotuningConfig(max_train_micro_batch_size_per_gpu=8, num_tuning_micro_batch_sizes=2),
                        dp_world=2, base_gas=1)
    assert {c.stage for c in space} == {0, 1, 2, 3}
    assert {c.offload for c in space if c.stage == 0} == {"none"}  # stage 0 cannot offload
    assert {c.offload for c in space if c.stage == 1} == {"none", "optimizer"}
    assert {c.offload for c in space if c.stage == 3} == {"none", "optimizer", "all"}
    assert {c.checkpointing for c in space} == {False, True} and {c.micro_batch for c in space} == {4, 8}
    assert {(c.gas, c.reduce_bucket_size, c.overlap_comm) for c in space} == {(1, None, None)}
    assert len(space) == len(set(space)) == (1 + 2 + 2 + 3) * 2 * 2


def test_full_space_adds_accumulation_buckets_and_overlap():
    at = AutotuningConfig(fast=False, offload=False, activation_checkpointing=False,
                          max_train_micro_batch_size_per_gpu=4, num_tuning_micro_batch_sizes=1)
    space = build_space(at, dp_world=2, base_gas=1, stages=(0, 2))
    assert {c.gas for c in space} == {1, 2, 4} and {c.offload for c in space} == {None}
    assert {(c.reduce_bucket_size, c.overlap_comm) for c in space if c.stage == 0} == {(None, None)}
    assert len([c for c in space if c.stage == 2]) == 3 * 2 * 2


def test_apply_sets_the_candidates_keys_and_keeps_the_rest():
    cfg = apply(BASE, Candidate(3, "all", True, 8, 1, 50_000_000, True), world=2)
    assert (cfg["train_batch_size"], cfg["train_micro_batch_size_per_gpu"], cfg["gradient_accumulation_steps"]) == (16, 8, 1)
    zero = cfg["zero_optimization"]
    assert zero == {"stage": 3, "reduce_bucket_size": 50_000_000, "overlap_comm": True,
                    "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}}
    assert cfg["activation_checkpointing"] == {} and cfg["optimizer"] == BASE["optimizer"]
    assert BASE["zero_optimization"]["stage"] == 1  # the base is not changed
    plain = apply(BASE, Candidate(1, "none", False, 4, 2), world=2)
    assert "offload_optimizer" not in plain["zero_optimization"] and "activation_checkpointing" not in plain
    assert plain["zero_optimization"]["reduce_bucket_size"] == 1000  # not tuned: the user's
    untuned = apply(BASE, Candidate(2, None, None, 4, 2), world=2)
    assert untuned["zero_optimization"]["offload_optimizer"] == {"device": "cpu"}  # offload not tuned
    for c in build_space(AutotuningConfig(max_train_micro_batch_size_per_gpu=4), 2, 2):
        load_config(apply(BASE, c, 2), 2)  # every candidate is a valid config


def test_dominates_is_more_memory_on_every_axis():
    small = Candidate(2, "optimizer", True, 8, 1)
    assert dominates(small, Candidate(1, "optimizer", True, 8, 1))
    assert dominates(small, Candidate(2, "none", True, 16, 4))
    assert not dominates(small, Candidate(2, "optimizer", False, 8, 1))  # checkpointing may cost memory
    assert not dominates(small, Candidate(3, "none", False, 16, 1))  # a higher stage may fit
    assert not dominates(small, Candidate(2, "optimizer", True, 4, 1))
    assert not dominates(small, Candidate(0, "all", False, 16, 1))


def test_names_are_short_and_distinct():
    space = build_space(AutotuningConfig(fast=False, max_train_micro_batch_size_per_gpu=4), 2, 1)
    assert len({c.name for c in space}) == len(space)
    assert Candidate(3, "all", True, 8, 2, 50_000_000, False).name == "z3_off-all_ckpt_mb8_gas2_rb5e07_no-overlap"
