"""The ``tensor_parallel`` ds_config block: parsed, the world divided, refusals in one line."""

from __future__ import annotations

import pytest

from dslaunch.errors import ConfigError
from dslaunch.runtime.config import load_config

BASE = {"train_batch_size": 16, "train_micro_batch_size_per_gpu": 2}


def test_the_batch_counts_every_rank_as_deepspeed_does_without_an_mpu() -> None:
    """DeepSpeed (no mpu) resolves train_batch_size against the whole world, tensor slices included
    (what accelerate writes: micro * gas * processes); data_parallel_size is the true one."""
    cfg = load_config({**BASE, "train_batch_size": 16, "data_parallel_size": 4,
                       "tensor_parallel": {"autotp_size": 2, "tp": {"tp_size": 2}, "dtype": "bf16",
                                           "tp_overlap_comm": False}}, 8, global_world=True)
    assert (cfg.tensor_parallel.size, cfg.world_size, cfg.gradient_accumulation_steps) == (2, 8, 1)
    # with an mpu the world given is already the data-parallel one
    assert load_config({**BASE, "tensor_parallel": {"autotp_size": 2}}, 4).gradient_accumulation_steps == 2
    assert load_config(BASE, 4, global_world=True).tensor_parallel.size == 1  # off: 0 (the default) or 1


@pytest.mark.parametrize("extra, message", [
    ({"tensor_parallel": {"autotp_size": 3}}, "tensor_parallel.autotp_size=3 must divide the world size 8"),
    ({"tensor_parallel": {"autotp_size": 2}, "zero_optimization": {"stage": 3}},
     "'tensor_parallel.autotp_size': AutoTP training composes with ZeRO stages 0-2 only"),
    ({"tensor_parallel": {"autotp_size": 2, "tp": {"tp_size": 4}}},
     "'tensor_parallel.tp.tp_size': 4 does not match tensor_parallel.autotp_size (2)"),
    ({"tensor_parallel": {"autotp_size": 2, "partition_config": {"layer_specs": []}}},
     "'tensor_parallel.partition_config': is not implemented by dslaunch (custom layer specs"),
    ({"tensor_parallel": {"autotp_sise": 2}}, "'tensor_parallel.autotp_sise': unknown parameter"),
    ({"tensor_parallel": {"autotp_size": 2}, "data_parallel_size": 8},
     "'data_parallel_size': 8 but the job has 4 data-parallel ranks"),
])
def test_refusals_are_one_line(extra: dict, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config({**BASE, **extra}, 8, global_world=True)
    assert str(err.value).startswith(message) and "\n" not in str(err.value), str(err.value)
