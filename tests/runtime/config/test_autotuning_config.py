"""The ds_config ``autotuning`` block: DeepSpeed's keys accepted, ours checked, mistakes named."""

from __future__ import annotations

import pytest

from dslaunch.errors import ConfigError
from dslaunch.runtime.config import load_config

pytestmark = pytest.mark.timeout(30)

DEEPSPEED_KEYS = {
    "enabled": True, "fast": False, "results_dir": "r", "exps_dir": "e", "overwrite": False,
    "start_profile_step": 2, "end_profile_step": 4, "metric": "FLOPS", "metric_path": "m.json",
    "tuner_type": "random", "tuner_early_stopping": 3, "tuner_num_trials": 9, "mp_size": 1,
    "arg_mappings": {"train_micro_batch_size_per_gpu": "--per_device_train_batch_size"},
    "model_info": {"num_params": 1000, "hidden_size": 8, "num_layers": 2, "profile": False},
    "model_info_path": "info.json", "max_train_batch_size": 64, "min_train_batch_size": 2,
    "max_train_micro_batch_size_per_gpu": 16, "min_train_micro_batch_size_per_gpu": 2,
    "num_tuning_micro_batch_sizes": 2,
}


def _load(block):
    return load_config({"train_batch_size": 8, "autotuning": block}, 2).autotuning


def test_deepspeeds_keys_are_accepted():
    at = _load(DEEPSPEED_KEYS)
    assert at.metric == "flops" and at.tuner_type == "random" and at.max_train_batch_size == 64
    assert at.arg_mappings == DEEPSPEED_KEYS["arg_mappings"] and at.model_info["num_params"] == 1000


def test_defaults_are_deepspeeds():
    at = _load({"enabled": True})
    assert (at.start_profile_step, at.end_profile_step, at.metric, at.tuner_type) == (3, 5, "throughput", "gridsearch")
    assert (at.tuner_early_stopping, at.tuner_num_trials, at.num_tuning_micro_batch_sizes) == (5, 50, 3)
    assert (at.results_dir, at.exps_dir, at.fast) == ("autotuning_results", "autotuning_exps", True)


@pytest.mark.parametrize("block, key, words", [
    ({"tuner_typ": "random"}, "autotuning.tuner_typ", "tuner_type"),
    ({"tuner_type": "bayes"}, "autotuning.tuner_type", "gridsearch, random, model_based"),
    ({"metric": "speed"}, "autotuning.metric", "throughput"),
    ({"start_profile_step": 5, "end_profile_step": 5}, "autotuning.end_profile_step", "above"),
    ({"max_train_micro_batch_size_per_gpu": 2, "min_train_micro_batch_size_per_gpu": 4},
     "autotuning.max_train_micro_batch_size_per_gpu", "below"),
    ({"memory_per_device": -1}, "autotuning.memory_per_device", "integer"),
    ({"hang_timeout": 1}, "autotuning.hang_timeout", "2"),
    ({"arg_mappings": {"train_micro_batch_size_per_gpu": "bs"}}, "autotuning.arg_mappings", "script flags"),
    ({"model_info": {"params": 3}}, "autotuning.model_info.params", "num_params"),
])
def test_mistakes_are_one_line_naming_the_key(block, key, words):
    with pytest.raises(ConfigError) as err:
        _load(block)
    message = str(err.value)
    assert f"'{key}'" in message and words in message and "\n" not in message
