"""The ds_config ``elasticity`` block: DeepSpeed's batch for each world size, and its errors.

Expected values come from DeepSpeed's own algorithm (``deepspeed.elasticity.compute_elastic_config``,
versions 0.1 and 0.2; 0.19.8 no longer ships the module, so they were computed from its source,
with its fix #8237 that keeps the batch within ``max_train_batch_size``).
"""

from __future__ import annotations

import pytest

from dslaunch.errors import ConfigError
from dslaunch.runtime.config import load_config
from dslaunch.runtime.config.elasticity import ElasticityConfig, elastic_batch

pytestmark = pytest.mark.timeout(10)

# (version, max batch, micro batches, min_gpus, max_gpus, prefer larger, gpus per node, world)
#   -> (global batch, micro batch, valid world sizes, or their count when long)
TABLE = [
    ((0.1, 2000, (2, 4, 6), 1, 10000, True, 1, 1), (1680, 6, 32)),   # DeepSpeed's documented example
    ((0.1, 2000, (2, 4, 6), 1, 10000, True, 1, 3), (1680, 4, 32)),
    ((0.1, 512, (3,), 1, 4, True, 1, 2), (360, 3, (1, 2, 3, 4))),
    ((0.1, 100, (3, 6), 2, 10000, True, 1, 4), (72, 6, (2, 3, 4, 6, 8, 12, 24))),
    ((0.1, 2000, (1, 2, 12), 1, 64, True, 1, 12), (1680, 2, 24)),
    ((0.1, 2000, (32,), 1, 16, True, 1, 2), (1920, 32, (1, 2, 3, 4, 5, 6, 10, 12, 15))),
    ((0.1, 48, (2, 16, 32), 2, 64, True, 1, 6), (48, 2, (2, 3, 4, 6, 8, 12, 24))),
    ((0.1, 16, (4,), 2, 64, False, 1, 4), (16, 4, (2, 4))),
    ((0.1, 512, (12, 16), 1, 10000, False, 1, 6), (288, 16, (1, 2, 3, 4, 6, 8, 9, 12, 18, 24))),
    ((0.1, 1000, (1, 2), 4, 10000, True, 1, 6), (840, 2, 29)),
    ((0.2, 512, (3, 5), 2, 8, False, 4, 16), (480, 5, (16,))),
    ((0.2, 1000, (1, 2, 4), 1, 10000, True, 2, 6), (960, 4, 24)),
    ((0.2, 512, (2,), 1, 64, True, 2, 1), (512, 2, (1,))),
    ((0.2, 2000, (4, 8), 4, 8, False, 1, 16), (1920, 8, (16,))),
    ((0.2, 4096, (3, 8, 16), 1, 10000, True, 1, 12), (3780, 3, 36)),
    # DeepSpeed's fix #8237: the micro batches' lcm (120, 42) over the maximum is no candidate
    ((0.1, 100, (8, 10, 12), 1, 1500, True, 1, 8), (96, 12, (1, 2, 3, 4, 6, 8, 12))),
    ((0.1, 32, (1, 2, 3, 7), 1, 10000, True, 1, 4), (24, 3, (1, 2, 3, 4, 6, 8, 12, 24))),
]


def _cfg(version, most, micros, low, high, prefer, per_node) -> ElasticityConfig:
    return ElasticityConfig(enabled=True, max_train_batch_size=most, micro_batch_sizes=micros, min_gpus=low,
                            max_gpus=high, prefer_larger_batch=prefer, version=version,
                            num_gpus_per_node=per_node)


@pytest.mark.parametrize("case, expected", TABLE)
def test_batch_matches_deepspeeds_algorithm(case, expected):
    *params, world = case
    batch, micro, valid = expected
    b = elastic_batch(_cfg(*params), world)
    assert (b.train_batch_size, b.micro_batch) == (batch, micro)
    assert (len(b.valid_world_sizes) if isinstance(valid, int) else b.valid_world_sizes) == valid
    assert b.train_batch_size == b.micro_batch * b.gradient_accumulation_steps * world


@pytest.mark.parametrize("case, words", [
    ((0.1, 2000, (2, 4, 6), 1, 10000, True, 1, 16), "world size 16 cannot split the elastic global batch 1680"),
    ((0.1, 16, (4, 8, 16), 4, 8, False, 1, 6), "world size 6 cannot split the elastic global batch 16"),
    ((0.2, 8, (1, 16), 4, 8, False, 4, 8), "every micro batch size must be <= max_train_batch_size"),
    ((0.2, 16, (2, 6, 32), 1, 16, False, 1, 1), "every micro batch size must be <= max_train_batch_size (16)"),
    ((0.1, 16, (2,), 9, 10, True, 1, 9), "no world size in [min_gpus, max_gpus] = [9, 10]"),
    ((0.2, 16, (4, 8, 12), 4, 64, False, 1, 8), "max_train_batch_size 16 is below min(micro_batch_sizes)"),
])
def test_no_fitting_batch_is_an_error_naming_the_constraint(case, words):
    *params, world = case
    with pytest.raises(ConfigError) as err:
        elastic_batch(_cfg(*params), world)
    assert words in str(err.value) and "elasticity" in str(err.value)


def test_load_config_takes_the_batch_from_the_elasticity_block():
    block = {"enabled": True, "max_train_batch_size": 2000, "micro_batch_sizes": [2, 4, 6]}
    for world, micro in ((1, 6), (3, 4), (5, 6)):
        cfg = load_config({"elasticity": block}, world)
        assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu) == (1680, micro)
        assert cfg.gradient_accumulation_steps == 1680 // (micro * world)


def test_batch_keys_beside_elasticity_need_ignore_non_elastic_batch_info():
    block = {"enabled": True, "max_train_batch_size": 2000, "micro_batch_sizes": [2, 4, 6]}
    with pytest.raises(ConfigError, match="train_batch_size.*ignore_non_elastic_batch_info"):
        load_config({"train_batch_size": 8, "elasticity": block}, 2)
    cfg = load_config({"train_batch_size": 8, "elasticity": {**block, "ignore_non_elastic_batch_info": True}}, 2)
    assert cfg.train_batch_size == 1680
    assert load_config({"train_batch_size": 8, "elasticity": {**block, "enabled": False}}, 2).train_batch_size == 8


@pytest.mark.parametrize("block, words", [
    ({"enabled": True, "micro_batch_sizes": []}, "elasticity.micro_batch_sizes': must be a non-empty list"),
    ({"enabled": True, "micro_batch_sizes": [2, 0]}, "elasticity.micro_batch_sizes[1]"),
    ({"enabled": True, "version": 0.3}, "0.3 is not a known elasticity version; valid: 0.1, 0.2"),
    ({"enabled": True, "model_parallel_size": 2}, "elasticity.model_parallel_size"),
    ({"enabled": True, "max_gpu": 4}, "did you mean 'max_gpus'"),
])
def test_bad_elasticity_keys_are_one_line(block, words):
    with pytest.raises(ConfigError) as err:
        load_config({"elasticity": block}, 1)
    assert words in str(err.value)


# ----- deepspeed.elasticity: DeepSpeed's entry points over the same search ---------------------------
def _block(version, most, micros, low, high, prefer, per_node) -> dict:
    return {"elasticity": {"enabled": True, "max_train_batch_size": most, "micro_batch_sizes": list(micros),
                           "min_gpus": low, "max_gpus": high, "prefer_larger_batch": prefer, "version": version,
                           "num_gpus_per_node": per_node}}


@pytest.mark.parametrize("case, expected", TABLE)
def test_compute_elastic_config_answers_as_deepspeeds(case, expected, monkeypatch):
    """``compute_elastic_config(ds_config, version, world_size)``: ``(batch, valid, micro)`` with a
    world size (what ms-swift's elastic callback reads), ``(batch, valid)`` without (version 0.1),
    version 0.2 reading ``$WORLD_SIZE`` then, as DeepSpeed's."""
    from dslaunch.elasticity import compute_elastic_config

    *params, world = case
    batch, micro, valid = expected
    got_batch, got_valid, got_micro = compute_elastic_config(_block(*params), "0.19.8", world_size=world)
    assert (got_batch, got_micro) == (batch, micro)
    assert (len(got_valid) if isinstance(valid, int) else tuple(got_valid)) == valid
    monkeypatch.setenv("WORLD_SIZE", str(world))
    assert compute_elastic_config(_block(*params), "0.19.8")[:2] == (got_batch, got_valid)
    assert compute_elastic_config(_block(*params), "0.19.8", return_microbatch=params[0] == 0.2)[-1] == (
        micro if params[0] == 0.2 else got_valid)


def test_compute_elastic_config_errors_are_deepspeeds_classes(monkeypatch):
    """DeepSpeed's error classes (each also a ``ConfigError``/``ValueError``), one line each."""
    from dslaunch.elasticity import (
        ElasticityConfigError,
        ElasticityError,
        ElasticityIncompatibleWorldSize,
        compute_elastic_config,
        elasticity_enabled,
        ensure_immutable_elastic_config,
    )

    good = _block(0.1, 2000, (2, 4, 6), 1, 10000, True, 1)
    with pytest.raises(ElasticityIncompatibleWorldSize, match="world size 16 cannot split"):
        compute_elastic_config(good, "0.19.8", world_size=16)
    with pytest.raises(ElasticityConfigError, match="missing from the config or not enabled"):
        compute_elastic_config({"train_batch_size": 8}, "0.19.8")
    with pytest.raises(ElasticityConfigError, match="'elasticity.micro_batch_size'.*did you mean"):
        compute_elastic_config({"elasticity": {"enabled": True, "micro_batch_size": [2]}}, "0.19.8")
    for missing in ("max_train_batch_size", "micro_batch_sizes"):  # defaults only for a disabled block
        block = {k: v for k, v in good["elasticity"].items() if k != missing}
        with pytest.raises(ElasticityConfigError, match=f"'elasticity.{missing}': is required when "):
            compute_elastic_config({"elasticity": block}, "0.19.8")
    with pytest.raises(ElasticityError, match="needs DeepSpeed 0.3.8 or later"):
        compute_elastic_config(good, "0.3.7")
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(ElasticityConfigError, match="version 0.2 needs the world size"):
        compute_elastic_config(_block(0.2, 512, (2,), 1, 64, True, 2), "0.19.8")
    with pytest.raises(ElasticityConfigError, match="return_microbatch needs world_size"):
        compute_elastic_config(good, "0.19.8", return_microbatch=True)  # DeepSpeed divides by zero
    assert issubclass(ElasticityIncompatibleWorldSize, ElasticityError) and issubclass(ElasticityError, ValueError)
    assert elasticity_enabled(good) and not elasticity_enabled({"elasticity": {"max_gpus": 4}})
    ensure_immutable_elastic_config(good["elasticity"])  # no scheduler's copy: nothing to compare
    monkeypatch.setenv("DEEPSPEED_ELASTICITY_CONFIG",
                       '{"enabled": true, "max_train_batch_size": 1000, "micro_batch_sizes": [2, 4, 6]}')
    with pytest.raises(ElasticityConfigError, match="'max_train_batch_size=1000' seen by the resource scheduler"):
        ensure_immutable_elastic_config(good["elasticity"])
