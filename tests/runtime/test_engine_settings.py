"""DeepSpeed's engine getters of its config (``engine.gradient_clipping()``, ``engine.zero_*()``...):
the values DeepSpeed 0.19.8's getters return for the same config, read from its sources."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import dslaunch
from tests.distributed import one_rank

BASE = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 7, "gradient_clipping": 0.5,
        "prescale_gradients": True, "dataloader_drop_last": True}


def _engine(config: dict, optimizer: object = None) -> dslaunch.DeepSpeedEngine:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = optimizer(model.parameters()) if callable(optimizer) else None
    return dslaunch.initialize(model=model, optimizer=opt, config={**BASE, **config})[0]


@pytest.mark.timeout(60)
@one_rank
def test_top_level_and_zero_getters_answer_the_config() -> None:
    engine = _engine({"zero_optimization": {"stage": 2, "reduce_bucket_size": 1234, "overlap_comm": False,
                                            "offload_optimizer": {"device": "cpu"}},
                      "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "betas": [0.8, 0.9]}},
                      "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 3}}})
    assert (engine.gradient_clipping(), engine.steps_per_print(), engine.dataloader_drop_last()) == (0.5, 7, True)
    assert engine.postscale_gradients() is False and engine.gradient_predivide_factor() == 1.0
    assert (engine.zero_optimization(), engine.zero_optimization_partition_gradients(),
            engine.zero_optimization_partition_weights()) == (True, True, False)
    assert engine.zero_reduce_bucket_size() == 1234 and engine.zero_overlap_comm() is False
    assert engine.zero_cpu_offload() and engine.zero_use_cpu_optimizer() and not engine.zero_nvme_offload_optimizer()
    assert engine.zero_offload_optimizer().device == "cpu" and engine.zero_partial_offload() == 1.0
    assert engine.zero_offload_param() is None  # DeepSpeed's None for an absent section
    # the config's optimizer type lower-cased where DeepSpeed knows it; params as written
    assert engine.optimizer_name() == "adamw" and engine.optimizer_params() == {"lr": 0.01, "betas": [0.8, 0.9]}
    assert engine.scheduler_name() == "WarmupLR" and engine.scheduler_params() == {"warmup_num_steps": 3}
    assert engine.get_mom() == [(0.8, 0.9)] and engine.get_type() == [0.0]
    assert engine.communication_data_type == torch.float32
    assert engine.get_data_parallel_rank() == 0 and engine.get_tensor_parallel_rank() == 0
    assert engine.get_sequence_parallel_group() is None


@pytest.mark.timeout(60)
@one_rank
def test_a_client_optimizer_is_named_by_its_class_and_sgd_reports_momentum() -> None:
    engine = _engine({"zero_allow_untested_optimizer": True},
                     optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.7))
    assert engine.optimizer_name() == "SGD" and engine.optimizer_params() is None
    assert engine.get_mom() == [0.7] and engine.scheduler_name() is None
    assert engine.zero_optimization() is False and engine.zero_allow_untested_optimizer() is True


@pytest.mark.timeout(60)
@one_rank
def test_precision_getters() -> None:
    engine = _engine({"fp16": {"enabled": True, "initial_scale_power": 10, "loss_scale_window": 50,
                               "hysteresis": 3, "min_loss_scale": 0.25}})
    assert engine.dynamic_loss_scale() and engine.initial_dynamic_scale() == 1024
    assert engine.dynamic_loss_scale_args() == {"init_scale": 1024, "scale_window": 50, "delayed_shift": 3,
                                                "consecutive_hysteresis": False, "min_scale": 0.25}
    assert engine.communication_data_type == torch.float16
    assert _engine({"bf16": {"enabled": True}}).communication_data_type == torch.bfloat16
    assert _engine({"bf16": {"enabled": True}, "communication_data_type": "fp32"}).communication_data_type == torch.float32


@pytest.mark.timeout(60)
@one_rank
def test_profiler_and_autotuning_getters_follow_deepspeeds_rules(tmp_path: Path) -> None:
    os.chdir(tmp_path)  # its own process
    engine = _engine({"flops_profiler": {"enabled": False, "profile_step": 3, "detailed": True}})
    assert not engine.flops_profiler_enabled() and engine.flops_profiler_profile_step() == 3
    assert engine.flops_profiler_detailed() and not engine.autotuning_enabled()
    assert engine.autotuning_metric_path() == os.path.join(str(tmp_path), "autotuning_metric.json")
    assert engine.checkpoint_tag_validation_enabled() and not engine.checkpoint_tag_validation_fail()
    strict = _engine({"checkpoint": {"tag_validation": "Fail"}})
    assert strict.checkpoint_tag_validation_fail()


@pytest.mark.timeout(60)
@one_rank
def test_save_fp16_model_is_save_16bit_model(tmp_path: Path) -> None:
    engine = _engine({})
    engine.save_fp16_model(str(tmp_path), "m.bin")
    saved = torch.load(tmp_path / "m.bin")
    torch.testing.assert_close(saved["weight"], engine.module.weight.detach())


@pytest.mark.timeout(60)
@one_rank
def test_log_level_sets_the_deepspeed_logger_and_a_bad_one_is_named() -> None:
    import logging

    from dslaunch.errors import ConfigError
    from dslaunch.utils.logging import logger, should_log_le

    saved = logger.level
    try:
        logger.setLevel(logging.DEBUG)
        engine = _engine({"log_level": "ERROR"})
        assert engine.log_level() == "ERROR" and logger.getEffectiveLevel() == logging.ERROR
        assert all(h.level == logging.ERROR for h in logger.handlers)
        assert should_log_le("critical") and not should_log_le("warning")
        logger.setLevel(logging.WARNING)
        assert _engine({}).log_level() is None and logger.getEffectiveLevel() == logging.WARNING  # left alone
        with pytest.raises(ConfigError, match=r"'log_level': must be one of debug, info, warning, error, critical"):
            _engine({"log_level": "verbose"})
    finally:  # its own process, but the logger is read again within it
        logger.setLevel(saved)
        for handler in logger.handlers:
            handler.setLevel(logging.NOTSET)


def test_raw_config_readers_and_constants_are_deepspeeds() -> None:
    from dslaunch.runtime.config import get_gradient_clipping, get_log_level
    from dslaunch.runtime.constants import GRADIENT_CLIPPING_DEFAULT, LOG_LEVEL_DEFAULT

    assert get_gradient_clipping({}) == GRADIENT_CLIPPING_DEFAULT == 1.0
    assert get_gradient_clipping({"gradient_clipping": 0.0}) == 0.0
    assert get_log_level({}) is LOG_LEVEL_DEFAULT is None and get_log_level({"log_level": "INFO"}) == "INFO"


@pytest.mark.timeout(60)
@one_rank
def test_zero_utils_predicates() -> None:
    from dslaunch.runtime.zero.utils import ZeRORuntimeException, is_zero_param, is_zero_supported_optimizer

    assert issubclass(ZeRORuntimeException, Exception)
    linear = torch.nn.Linear(2, 2)
    assert is_zero_supported_optimizer(torch.optim.AdamW(linear.parameters()))
    assert not is_zero_supported_optimizer(torch.optim.LBFGS(linear.parameters()))
    assert not is_zero_param(linear.weight)
    engine = _engine({"zero_optimization": {"stage": 3}})
    assert all(is_zero_param(p) for p in engine.module.parameters())
