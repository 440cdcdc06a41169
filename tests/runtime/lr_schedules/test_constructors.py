"""Schedules built in Python (``WarmupLR(optimizer, ...)``) check their params as the config's
``scheduler.params`` are checked, and keep a tensor lr the tensor it was."""

from __future__ import annotations

import pytest
import torch

from dslaunch.errors import ConfigError
from dslaunch.runtime.lr_schedules import LRRangeTest, OneCycle, WarmupCosineLR, WarmupDecayLR, WarmupLR


def _sgd(lr: object = 0.1) -> torch.optim.SGD:
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=lr)


@pytest.mark.parametrize("build, key", [
    (lambda o: WarmupLR(o, warmup_num_steps=-5), "warmup_num_steps"),
    (lambda o: WarmupLR(o, warmup_num_steps=None), "warmup_num_steps"),
    (lambda o: WarmupDecayLR(o, total_num_steps=100, warmup_num_steps=0), "warmup_num_steps"),
    (lambda o: WarmupCosineLR(o, total_num_steps=100, warmup_type="cubic"), "warmup_type"),
    (lambda o: LRRangeTest(o, lr_range_test_step_size=0), "lr_range_test_step_size"),
    (lambda o: OneCycle(o, cycle_min_lr=0.01, cycle_max_lr=0.1, cycle_first_step_size=0), "cycle_first_step_size"),
])
def test_bad_params_are_refused_before_any_lr_is_written(build, key) -> None:
    opt = _sgd()
    with pytest.raises(ConfigError, match=f"scheduler.params.{key}") as err:
        build(opt)
    assert isinstance(err.value, ValueError)  # what DeepSpeed raises there
    assert opt.param_groups[0]["lr"] == 0.1


def test_derived_defaults_still_apply() -> None:
    opt = _sgd(0.5)
    WarmupLR(opt, warmup_max_lr=None, warmup_num_steps=10).step(20)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.5)
    WarmupDecayLR(_sgd(), total_num_steps=100)  # its own required param, checked for the subclass


@pytest.mark.parametrize("shape", [(), (1,)])
def test_a_tensor_lr_stays_the_same_tensor(shape) -> None:
    lr = torch.full(shape, 0.1, dtype=torch.float64)
    opt = _sgd(lr)
    sched = WarmupCosineLR(opt, total_num_steps=100, warmup_num_steps=10, warmup_type="linear")
    for _ in range(5):
        sched.step()
    assert opt.param_groups[0]["lr"] is lr
    assert lr.flatten()[0].item() == pytest.approx(0.1 * 4 / 10)  # base 0.1, not the written tensor
    assert sched.get_last_lr() == pytest.approx([0.04])
