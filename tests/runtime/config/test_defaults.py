"""Every ds_config default side by side with DeepSpeed 0.19.8's, the version the ``deepspeed``
distribution claims to be: a script moved over unchanged must train the same.

DeepSpeed's column was read from ``deepspeed.runtime.config.DeepSpeedConfig({"train_micro_batch_size_per_gpu":
2})`` of the real DeepSpeed 0.19.8 (``DS_ACCELERATOR=cpu``, a separate venv), its ``zero_config``,
``float16_config``/``bfloat16_config``, ``aio_config``, ``checkpoint_config``, ``monitor_config``,
``pipeline``, ``flops_profiler_config`` and ``activation_checkpointing_config``, and the offload
configs' classes; ``overlap_comm`` at ``"stage": 3`` too (its default follows the stage).
"""

from __future__ import annotations

import pytest

from dslaunch.runtime.config import load_config
from dslaunch.runtime.config.deepspeed_defaults import DEEPSPEED_0_19_8
from dslaunch.runtime.config.ds_config import OWN_DEFAULTS

# dslaunch's own, on purpose (said at start-up when in effect: OWN_DEFAULTS, and in the README)
DSLAUNCH_DIFFERS = {"steps_per_print": 10}


def _value(cfg: object, path: str) -> object:
    for part in path.split("."):
        cfg = getattr(cfg, part)
    return cfg


@pytest.mark.parametrize("path", sorted(DEEPSPEED_0_19_8))
def test_default_matches_deepspeed_0_19_8(path: str) -> None:
    cfg = load_config({"train_micro_batch_size_per_gpu": 2}, 1)
    want = DSLAUNCH_DIFFERS.get(path, DEEPSPEED_0_19_8[path])
    assert _value(cfg, path) == want


def test_overlap_comm_defaults_on_at_stage_3_only() -> None:
    for stage in (0, 1, 2, 3):
        cfg = load_config({"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": stage}}, 1)
        assert cfg.zero_optimization.overlap_comm is (stage == 3)


def test_every_different_default_is_announced_when_in_effect() -> None:
    assert set(DSLAUNCH_DIFFERS) == set(OWN_DEFAULTS)
    for key in DSLAUNCH_DIFFERS:
        assert any(key in note for note in load_config({"train_micro_batch_size_per_gpu": 2}, 1).notes)
        given = load_config({"train_micro_batch_size_per_gpu": 2, key: DSLAUNCH_DIFFERS[key]}, 1)
        assert not any(key in note for note in given.notes)
