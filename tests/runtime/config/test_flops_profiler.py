"""The ``flops_profiler`` block: DeepSpeed's keys and defaults, each checked, typos suggested."""

from __future__ import annotations

import pytest

from dslaunch.errors import ConfigError
from dslaunch.runtime.config import load_config


def _block(**keys: object):
    return load_config({"train_batch_size": 2, "flops_profiler": keys}, 1).flops_profiler


def test_defaults_are_deepspeeds() -> None:
    cfg = load_config({"train_batch_size": 2}, 1).flops_profiler
    assert (cfg.enabled, cfg.profile_step, cfg.module_depth, cfg.top_modules, cfg.detailed, cfg.output_file,
            cfg.recompute_fwd_factor) == (False, 1, -1, 1, True, None, 0.0)
    cfg = _block(enabled=True, profile_step=0, module_depth=2, top_modules=3, detailed=False,
                 output_file="p.txt", recompute_fwd_factor=1.0)
    assert (cfg.enabled, cfg.profile_step, cfg.module_depth, cfg.output_file) == (True, 0, 2, "p.txt")


@pytest.mark.parametrize("keys, message", [
    ({"profile_step": -1}, "'flops_profiler.profile_step': must be an integer in [0,"),
    ({"module_depth": -2}, "'flops_profiler.module_depth': must be an integer in [-1,"),
    ({"top_modules": 0}, "'flops_profiler.top_modules'"),
    ({"detailed": "yes"}, "'flops_profiler.detailed'"),
    ({"output_file": ""}, "'flops_profiler.output_file': must be a file path"),
    ({"recompute_fwd_factor": -0.5}, "'flops_profiler.recompute_fwd_factor'"),
    ({"profile_stepp": 2}, "profile_step"),
])
def test_bad_values_name_the_key(keys: dict, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        _block(**keys)
    assert message in str(err.value) and "\n" not in str(err.value)
