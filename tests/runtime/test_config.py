"""ds_config validation: every mistake is a ConfigError that names the key and the fix."""

from __future__ import annotations

import json

import pytest

from dslaunch.errors import ConfigError
from dslaunch.runtime.config import load_config


def _error(raw: dict, world: int = 2) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(raw, world)
    return str(info.value)


def test_typo_suggests_the_key() -> None:
    msg = _error({"train_batch_size": 8, "gradient_clipings": 1.0})
    assert "'gradient_clipings'" in msg and "did you mean 'gradient_clipping'" in msg


def test_nested_typo_names_the_path() -> None:
    msg = _error({"train_batch_size": 8, "zero_optimization": {"stage": 2, "overlap_com": True}})
    assert "'zero_optimization.overlap_com'" in msg and "did you mean 'overlap_comm'" in msg


def test_wrong_type_names_the_path() -> None:
    msg = _error({"train_batch_size": 8, "zero_optimization": {"stage": "2"}})
    assert "'zero_optimization.stage'" in msg and "integer" in msg
    assert "'fp16.enabled'" in _error({"train_batch_size": 8, "fp16": {"enabled": "yes"}})


def test_out_of_range_names_the_path() -> None:
    assert "'gradient_clipping'" in _error({"train_batch_size": 8, "gradient_clipping": -1})
    assert "'fp16.loss_scale_window'" in _error({"train_batch_size": 8, "fp16": {"loss_scale_window": 0}})


@pytest.mark.parametrize("raw, world, want", [
    ({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2}, 4,
     (32, 4, 2)),
    ({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4}, 4, (32, 4, 2)),
    ({"train_batch_size": 32, "gradient_accumulation_steps": 2}, 4, (32, 4, 2)),
    ({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2}, 4, (32, 4, 2)),
    ({"train_batch_size": 32}, 4, (32, 8, 1)),
    ({"train_micro_batch_size_per_gpu": 3}, 2, (6, 3, 1)),
])
def test_batch_triad_derives_the_missing_value(raw: dict, world: int, want: tuple) -> None:
    cfg = load_config(raw, world)
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu,
            cfg.gradient_accumulation_steps) == want


def test_batch_triad_inconsistency_shows_the_arithmetic() -> None:
    msg = _error({"train_batch_size": 16, "train_micro_batch_size_per_gpu": 3,
                  "gradient_accumulation_steps": 2}, world=2)
    assert "16 != " in msg and "3 * 2 * 2 = 12" in msg
    msg = _error({"train_batch_size": 10, "train_micro_batch_size_per_gpu": 4}, world=2)
    assert "4 * 2 = 8" in msg and "not divisible" in msg
    assert "train_micro_batch_size_per_gpu" in _error({"gradient_accumulation_steps": 2})


def test_auto_says_what_to_put_there() -> None:
    msg = _error({"train_batch_size": "auto"})
    assert "Hugging Face" in msg and "an integer" in msg and "'train_batch_size'" in msg
    msg = _error({"train_batch_size": 8, "zero_optimization": {"reduce_bucket_size": "auto"}})
    assert "'zero_optimization.reduce_bucket_size'" in msg and "elements" in msg and "500000000" in msg


def test_unimplemented_keys_are_reported_not_ignored() -> None:
    msg = _error({"train_batch_size": 8, "zero_optimization": {"offload_optimizer": {"device": "cpu"}}})
    assert "'zero_optimization.offload_optimizer'" in msg and "not implemented" in msg
    assert "not implemented" in _error({"train_batch_size": 8, "tensorboard": {"enabled": True}})
    assert "not implemented" in _error({"train_batch_size": 8, "zero_optimization": {"stage": 3}})
    # switched off, they are honoured as such
    cfg = load_config({"train_batch_size": 8, "tensorboard": {"enabled": False},
                       "zero_optimization": {"offload_optimizer": {"device": "none"}}}, 2)
    assert cfg.zero_optimization.stage == 0


def test_fp16_and_bf16_together_is_an_error() -> None:
    assert "both" in _error({"train_batch_size": 8, "fp16": {"enabled": True}, "bf16": {"enabled": True}})


def test_optimizer_params_are_validated_at_parse_time() -> None:
    msg = _error({"train_batch_size": 8, "optimizer": {"type": "AdamW", "params": {"lrr": 1e-3}}})
    assert "'optimizer.params.lrr'" in msg and "did you mean 'lr'" in msg


def test_files_json_and_yaml_and_source_named(tmp_path) -> None:
    good = {"train_batch_size": 8, "zero_optimization": {"stage": 2}, "bfloat16": {"enabled": True},
            "checkpoint": {"tag_validation": "fail", "keep_last": 2}}
    (tmp_path / "c.json").write_text(json.dumps(good))
    (tmp_path / "c.yaml").write_text("train_batch_size: 8\nzero_optimization:\n  stage: 2\n")
    cfg = load_config(str(tmp_path / "c.json"), 2)
    assert cfg.bf16.enabled and cfg.checkpoint.tag_validation == "Fail" and cfg.checkpoint.keep_last == 2
    assert load_config(tmp_path / "c.yaml", 2).zero_optimization.stage == 2
    (tmp_path / "bad.json").write_text('{"train_batch_size": 8,\n "stage": 1}')
    msg = _error(str(tmp_path / "bad.json"))
    assert str(tmp_path / "bad.json") in msg and "'stage'" in msg
    (tmp_path / "broken.json").write_text('{"train_batch_size": 8,,}')
    assert "line 1" in _error(str(tmp_path / "broken.json"))
    assert "cannot read" in _error(str(tmp_path / "missing.json"))


@pytest.mark.timeout(30)
def test_initialize_rejects_a_bad_config_before_waiting_for_peers(monkeypatch) -> None:
    import torch

    import dslaunch

    # Rank 0 of a 2-rank job whose peer never comes: the config error must come first, not a hang.
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(ConfigError, match="did you mean 'train_batch_size'"):
        dslaunch.initialize(model=torch.nn.Linear(2, 2), config={"train_batch_sze": 4})
