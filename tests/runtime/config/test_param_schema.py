"""Every number in a ds_config is finite and in a stated range; errors name the key and the range."""

from __future__ import annotations

import math

import pytest

from dslaunch.errors import ConfigError
from dslaunch.runtime.config import load_config
from dslaunch.runtime.config.param_schema import integer, number
from dslaunch.runtime.config.sections import Fp16Config, parse_section
from dslaunch.runtime.precision.loss_scaler import build_loss_scaler

pytestmark = pytest.mark.timeout(60)

INF, NAN = math.inf, math.nan
_ADAM = {"type": "Adam", "params": {}}


def _error(raw: dict) -> str:
    with pytest.raises(ConfigError) as info:
        load_config({"train_batch_size": 2, **raw}, 1)
    msg = str(info.value)
    assert "\n" not in msg and len(msg) < 300
    return msg


def _opt(type_: str, **params: object) -> dict:
    return {"optimizer": {"type": type_, "params": params}}


def _sched(type_: str, **params: object) -> dict:
    return {"optimizer": _ADAM, "scheduler": {"type": type_, "params": params}}


@pytest.mark.parametrize("raw, key, valid", [
    # the cases: silently trained to NaN / skipped every step / tracebacks
    (_opt("Adam", lr=INF), "optimizer.params.lr", ">= 0 and finite"),
    (_opt("Adam", lr=NAN), "optimizer.params.lr", ">= 0 and finite"),
    ({"fp16": {"enabled": True, "loss_scale": INF}}, "fp16.loss_scale", "in [0, 2**64]"),
    ({"gradient_clipping": NAN}, "gradient_clipping", ">= 0 and finite"),
    ({"dist_init_timeout": INF}, "dist_init_timeout", "in (0, 1e8]"),
    ({"dist_init_timeout": 1e300}, "dist_init_timeout", "in (0, 1e8]"),
    ({"fp16": {"enabled": True, "initial_scale_power": 2000}}, "fp16.initial_scale_power", "in [0, 64]"),
    ({"fp16": {"min_loss_scale": -INF}}, "fp16.min_loss_scale", "<= 2**64 and finite"),
    # a huge int is not a float (float(10**400) raises OverflowError)
    (_opt("Adam", lr=10**400), "optimizer.params.lr", "<401-digit integer>"),
    ({"train_batch_size": 10**400}, "train_batch_size", "an integer in [1, 1e12]"),
    ({"gradient_accumulation_steps": 1e300}, "gradient_accumulation_steps", "an integer in [1, 1e12]"),
    ({"zero_optimization": {"reduce_bucket_size": 10**13}}, "zero_optimization.reduce_bucket_size", "1e12"),
    ({"zero_optimization": {"stage": 7}}, "zero_optimization.stage", "an integer in [0, 3]"),
    ({"steps_per_print": -INF}, "steps_per_print", "an integer in [1, 1e12]"),  # +inf: never (accelerate)
    ({"gradient_predivide_factor": INF}, "gradient_predivide_factor", "> 0 and finite"),
    # bool is not a number: True must not pass as 1
    ({"gradient_clipping": True}, "gradient_clipping", "must be a number"),
    ({"train_micro_batch_size_per_gpu": True}, "train_micro_batch_size_per_gpu", "got bool True"),
    # optimizer params
    (_opt("Adam", eps=0), "optimizer.params.eps", "> 0 and finite"),
    (_opt("Adam", betas=[NAN, 0.9]), "optimizer.params.betas[0]", "in [0, 1)"),
    (_opt("AdamW", betas=[0.9, 1.0]), "optimizer.params.betas[1]", "in [0, 1)"),
    (_opt("Adam", weight_decay=-INF), "optimizer.params.weight_decay", ">= 0 and finite"),
    (_opt("SGD", dampening=NAN), "optimizer.params.dampening", "finite"),
    (_opt("Lamb", max_coeff=INF), "optimizer.params.max_coeff", ">= 0 and finite"),
    (_opt("Adagrad", eps=0.0), "optimizer.params.eps", "> 0"),
    (_opt("RMSprop", lr=NAN), "optimizer.params.lr", "finite"),  # torch.optim by name
    (_opt("Adamax", betas=[0.9, INF]), "optimizer.params.betas[1]", "finite"),
    # every scheduler param
    (_sched("WarmupLR", warmup_max_lr=INF), "scheduler.params.warmup_max_lr", ">= 0 and finite"),
    (_sched("WarmupLR", warmup_min_lr=[0.0, NAN]), "scheduler.params.warmup_min_lr[1]", ">= 0 and finite"),
    (_sched("WarmupLR", warmup_num_steps=10**13), "scheduler.params.warmup_num_steps", "in [1, 1e12]"),
    (_sched("WarmupDecayLR", total_num_steps=INF), "scheduler.params.total_num_steps", "an integer"),
    (_sched("WarmupCosineLR", total_num_steps=10, cos_min_ratio=NAN), "scheduler.params.cos_min_ratio",
     "in [0, 1]"),
    (_sched("OneCycle", cycle_min_lr=0.0, cycle_max_lr=INF), "scheduler.params.cycle_max_lr", "finite"),
    (_sched("OneCycle", cycle_min_lr=0, cycle_max_lr=1, cycle_max_mom=1.0), "scheduler.params.cycle_max_mom",
     "in [0, 1)"),
    (_sched("OneCycle", cycle_min_lr=0, cycle_max_lr=1, decay_lr_rate=INF), "scheduler.params.decay_lr_rate",
     ">= 0 and finite"),
    (_sched("LRRangeTest", lr_range_test_step_rate=NAN), "scheduler.params.lr_range_test_step_rate", "finite"),
    (_sched("WarmupLR", last_batch_iteration=-2), "scheduler.params.last_batch_iteration", "in [-1, 1e12]"),
    ({"checkpoint": {"keep_last": 10**20}}, "checkpoint.keep_last", "in [1, 1e12]"),
])
def test_non_finite_and_out_of_range_numbers_name_key_and_range(raw: dict, key: str, valid: str) -> None:
    msg = _error(raw)
    assert msg.startswith(f"'{key}': must be "), msg
    assert valid in msg, msg


def test_the_edges_of_each_range_are_accepted() -> None:
    cfg = load_config({"train_batch_size": 2, "gradient_clipping": 0, "dist_init_timeout": 1e8,
                       "fp16": {"enabled": True, "loss_scale": 2.0**64, "initial_scale_power": 64},
                       "optimizer": {"type": "Adam", "params": {"lr": 0, "betas": [0, 0.999999], "eps": 1e-300}},
                       "scheduler": {"type": "OneCycle", "params": {"cycle_min_lr": 0, "cycle_max_lr": 1e3,
                                                                    "cycle_max_mom": 0.99}}}, 1)
    assert cfg.fp16.initial_scale_power == 64 and cfg.dist_init_timeout == 1e8
    assert load_config({"train_batch_size": 10**12, "train_micro_batch_size_per_gpu": 10**12}, 1).train_batch_size \
        == 10**12
    assert load_config({"train_batch_size": 2, "steps_per_print": 1e3}, 1).steps_per_print == 1000


@pytest.mark.parametrize("section, key", [
    ({"enabled": True, "initial_scale_power": 2000}, "fp16.initial_scale_power"),  # was OverflowError
    ({"enabled": True, "loss_scale": INF}, "fp16.loss_scale"),
    ({"enabled": True, "min_loss_scale": NAN}, "fp16.min_loss_scale"),
])
def test_the_loss_scaler_section_uses_the_same_ranges(section: dict, key: str) -> None:
    with pytest.raises(ConfigError, match=f"^'{key}': must be (an integer )?(in |<= )"):
        build_loss_scaler(parse_section(Fp16Config, section, "fp16"))


def test_checkers_directly() -> None:
    assert number(0.0, 1.0, high_open=True)("k", 0) == 0.0
    assert integer(-1, 5)("k", 5.0) == 5 and isinstance(integer(-1, 5)("k", 5.0), int)
    for bad in (True, False, INF, -INF, NAN, "1", None, [1], 10**5000):
        with pytest.raises(ConfigError, match="^'k': must be "):
            number()("k", bad)
        with pytest.raises(ConfigError, match=r"^'k': must be an integer in \[0, 1e12\], got "):
            integer()("k", bad)
