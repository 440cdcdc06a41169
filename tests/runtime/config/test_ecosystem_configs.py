"""Configs from DeepSpeed's docs, DeepSpeedExamples and Hugging Face's docs are accepted as they are
written; typos still fail with a suggestion."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dslaunch.errors import ConfigError
from dslaunch.runtime.config import load_config

CIFAR = Path(__file__).resolve().parents[2] / "compat" / "scripts" / "cifar_ds_config.json"


def test_getting_started_config_with_boolean_zero_is_stage_1() -> None:
    # DeepSpeed's getting-started page: "zero_optimization": true (its deprecated form of stage 1)
    cfg = load_config({"train_batch_size": 8, "gradient_accumulation_steps": 1,
                       "optimizer": {"type": "Adam", "params": {"lr": 0.00015}},
                       "fp16": {"enabled": True}, "zero_optimization": True, "allgather_size": 1000}, 2)
    assert cfg.zero_optimization.stage == 1 and cfg.zero_optimization.allgather_bucket_size == 1000
    assert load_config({"train_batch_size": 2, "zero_optimization": False}, 1).zero_optimization.stage == 0


def test_cifar_example_config_with_loss_scaling_keys_in_bf16() -> None:
    cfg = load_config(CIFAR, 2)
    assert cfg.bf16.enabled and not cfg.fp16.enabled and cfg.train_micro_batch_size_per_gpu == 8
    raw = json.loads(CIFAR.read_text())
    raw["bf16"]["loss_scale_windw"] = 500
    with pytest.raises(ConfigError, match=r"'bf16.loss_scale_windw'.*did you mean 'loss_scale_window'"):
        load_config(raw, 2)
    raw["bf16"] = {"enabled": True, "hysteresis": 0}  # still checked as fp16 checks it
    with pytest.raises(ConfigError, match=r"'bf16.hysteresis': must be an integer in \[1,"):
        load_config(raw, 2)


def test_hugging_face_zero2_config_as_the_trainer_fills_it() -> None:
    # Hugging Face's documented ZeRO-2 config, its "auto" values filled in as the Trainer does
    cfg = load_config({
        "fp16": {"enabled": False, "loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 16,
                 "hysteresis": 2, "min_loss_scale": 1},
        "bf16": {"enabled": False},
        "optimizer": {"type": "AdamW", "params": {"lr": 5e-5, "betas": [0.9, 0.999], "eps": 1e-8,
                                                  "weight_decay": 0.0}},
        "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 5e-5,
                                                          "warmup_num_steps": 10, "total_num_steps": 100}},
        "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "none", "pin_memory": True},
                              "allgather_partitions": True, "allgather_bucket_size": 2e8,
                              "overlap_comm": True, "reduce_scatter": True, "reduce_bucket_size": 2e8,
                              "contiguous_gradients": True, "round_robin_gradients": True,
                              "stage3_gather_16bit_weights_on_model_save": True},
        "gradient_accumulation_steps": 2, "gradient_clipping": 1.0, "steps_per_print": 2000,
        "train_batch_size": 16, "train_micro_batch_size_per_gpu": 4, "wall_clock_breakdown": False,
        "zero_allow_untested_optimizer": True, "disable_python_gc": False,
    }, 2)
    assert cfg.zero_optimization.stage == 2 and cfg.train_batch_size == 16


def test_accelerates_infinite_steps_per_print_means_never() -> None:
    assert load_config({"train_batch_size": 2, "steps_per_print": float("inf")}, 1).steps_per_print is None


def test_unknown_keys_stay_errors_with_a_suggestion() -> None:
    with pytest.raises(ConfigError, match=r"'wall_clock_breakdwn': unknown key \(did you mean 'wall_clock_breakdown'"):
        load_config({"train_batch_size": 2, "wall_clock_breakdwn": True}, 1)
