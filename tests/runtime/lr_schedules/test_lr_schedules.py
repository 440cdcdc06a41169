"""LR schedules: values at chosen steps from DeepSpeed's documented formulas, state, validation."""

from __future__ import annotations

import math

import pytest
import torch

from dslaunch.errors import ConfigError
from dslaunch.runtime.lr_schedules import SCHEDULER_TYPES, build_lr_scheduler, validate_lr_scheduler

pytestmark = pytest.mark.timeout(30)


def _sched(sched_type, params, optimizer):
    """The engine's path: the section validated once (as when the config is parsed), then built."""
    return build_lr_scheduler(validate_lr_scheduler(sched_type, params), optimizer)


def _adam(lr: float = 0.1, groups: int = 1) -> torch.optim.Optimizer:
    return torch.optim.AdamW([{"params": [torch.zeros(2, requires_grad=True)]} for _ in range(groups)], lr=lr)


def _lrs_by_step(sched, steps: int) -> list[float]:
    """lr in the optimizer before the first step() and after each of ``steps`` steps."""
    out = [sched.optimizer.param_groups[0]["lr"]]
    for _ in range(steps):
        sched.step()
        out.append(sched.optimizer.param_groups[0]["lr"])
    return out


def test_warmup_lr_log_and_linear() -> None:
    opt = _adam()
    sched = _sched("WarmupLR", {"warmup_min_lr": 0.01, "warmup_max_lr": 0.1,
                                            "warmup_num_steps": 10}, opt)
    lrs = _lrs_by_step(sched, 15)
    assert lrs[0] == pytest.approx(0.01)  # built at iteration -1: min lr
    for t in range(15):  # lrs[t + 1] is the lr at last_batch_iteration t
        gamma = math.log(t + 1) / math.log(10) if t < 10 else 1.0
        assert lrs[t + 1] == pytest.approx(0.01 + 0.09 * gamma)
    assert sched.get_last_lr() == [pytest.approx(0.1)]

    lin = _sched("WarmupLR", {"warmup_max_lr": 0.2, "warmup_num_steps": 4, "warmup_type": "linear"},
                             _adam())
    assert _lrs_by_step(lin, 6) == pytest.approx([0.0, 0.0, 0.05, 0.1, 0.15, 0.2, 0.2])


def test_warmup_lr_max_defaults_to_optimizer_lr_and_num_steps_at_least_two() -> None:
    sched = _sched("WarmupLR", {"warmup_num_steps": 1, "warmup_type": "linear"}, _adam(lr=0.3))
    assert _lrs_by_step(sched, 3) == pytest.approx([0.0, 0.0, 0.15, 0.3])


def test_warmup_decay_lr() -> None:
    sched = _sched("WarmupDecayLR", {"total_num_steps": 20, "warmup_num_steps": 5,
                                                 "warmup_type": "linear"}, _adam())
    lrs = _lrs_by_step(sched, 25)
    for t in range(25):
        gamma = t / 5 if t < 5 else max(0.0, (20 - t) / 15)
        assert lrs[t + 1] == pytest.approx(0.001 * gamma)  # default warmup_max_lr 0.001
    assert lrs[-1] == 0.0


def test_warmup_cosine_lr_scales_optimizer_lr() -> None:
    sched = _sched("WarmupCosineLR", {"total_num_steps": 30, "warmup_num_steps": 10,
                                                  "warmup_min_ratio": 0.1, "cos_min_ratio": 0.01}, _adam(0.5))
    lrs = _lrs_by_step(sched, 35)
    for t in range(35):
        if t < 10:
            ratio = 0.1 + 0.9 * math.log(t + 1) / math.log(10)
        else:
            progress = min(1.0, (t - 10 + 1) / 20)
            ratio = 0.01 + 0.99 * (1 + math.cos(math.pi * progress)) / 2
        assert lrs[t + 1] == pytest.approx(0.5 * ratio), t
    assert lrs[-1] == pytest.approx(0.5 * 0.01)  # stays at the floor past total_num_steps


def test_warmup_cosine_lr_starts_at_zero_like_deepspeed() -> None:
    # DeepSpeed returns ratio 0 before the first step, whatever warmup_min_ratio is.
    opt = _adam(0.5)
    _sched("WarmupCosineLR", {"total_num_steps": 10, "warmup_min_ratio": 0.3}, opt)
    assert opt.param_groups[0]["lr"] == 0.0


def test_one_cycle_lr_and_momentum() -> None:
    opt = _adam()
    sched = _sched("OneCycle", {"cycle_min_lr": 0.01, "cycle_max_lr": 0.11,
                                            "cycle_first_step_size": 4, "cycle_second_step_size": 6,
                                            "decay_step_size": 2, "decay_lr_rate": 0.5,
                                            "decay_mom_rate": 0.1}, opt)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.01)
    assert opt.param_groups[0]["betas"] == (0.8, 0.999)  # beta2 kept
    expected_lr, expected_mom = [], []
    for t in range(14):
        pos = t + 1
        if t < 10:
            scale = pos / 4 if pos <= 4 else (10 - pos) / 6
            expected_lr.append(0.01 + 0.1 * scale)
            expected_mom.append(0.9 - 0.1 * scale)
        else:
            k = (t - 10 + 1) / 2
            expected_lr.append(0.01 / (1 + 0.5 * k))
            expected_mom.append(0.9 * (1 + 0.1 * k))
    assert sched.get_mom() == [(pytest.approx(0.9), 0.999)]  # DeepSpeed's: each group's betas to come
    for t in range(14):
        sched.step()
        assert opt.param_groups[0]["lr"] == pytest.approx(expected_lr[t]), t
        assert opt.param_groups[0]["betas"][0] == pytest.approx(expected_mom[t]), t
        assert sched.get_mom() == [opt.param_groups[0]["betas"]], t
    # the peak is reached exactly at the end of the first half
    peak = _sched("OneCycle", {"cycle_min_lr": 0.0, "cycle_max_lr": 1.0,
                                           "cycle_first_step_size": 3}, _adam())
    assert max(_lrs_by_step(peak, 6)) == pytest.approx(1.0)


def test_one_cycle_with_no_second_half_rises_the_whole_cycle_then_drops() -> None:
    sched = _sched("OneCycle", {"cycle_min_lr": 0.0, "cycle_max_lr": 1.0, "cycle_first_step_size": 4,
                                "cycle_second_step_size": 0}, _adam())
    assert sched.step_ratio == 1.0  # DeepSpeed's attribute: the rising part's share of the cycle
    assert _lrs_by_step(sched, 5) == pytest.approx([0.0, 0.25, 0.5, 0.75, 0.0, 0.0])
    even = _sched("OneCycle", {"cycle_min_lr": 0.0, "cycle_max_lr": 1.0, "cycle_first_step_size": 3,
                               "cycle_second_step_size": 9}, _adam())
    assert even.step_ratio == 0.25


def test_one_cycle_stairs_and_sgd_without_betas() -> None:
    sgd = torch.optim.SGD([torch.zeros(2, requires_grad=True)], lr=0.1)
    sched = _sched("OneCycle", {"cycle_min_lr": 0.0, "cycle_max_lr": 1.0, "cycle_first_step_size": 6,
                                            "cycle_first_stair_count": 3}, sgd)
    lrs = _lrs_by_step(sched, 12)
    # rising: floor(pos * 3 / 6) / 3 for pos 1..6, then falling symmetric with the same stairs
    rising = [math.floor(p * 3 / 6) / 3 for p in range(1, 7)]
    falling = [math.floor((12 - p) * 3 / 6) / 3 for p in range(7, 13)]
    assert lrs[1:] == pytest.approx(rising + falling)
    assert "betas" not in sgd.param_groups[0] and sched.get_mom() is None  # nothing to cycle


@pytest.mark.parametrize("staircase", [False, True])
def test_lr_range_test(staircase: bool) -> None:
    sched = _sched("LRRangeTest", {"lr_range_test_min_lr": 0.001, "lr_range_test_step_size": 4,
                                               "lr_range_test_step_rate": 2.0,
                                               "lr_range_test_staircase": staircase}, _adam())
    lrs = _lrs_by_step(sched, 10)
    assert lrs[0] == pytest.approx(0.001)
    for t in range(10):
        interval = (t + 1) / 4
        interval = math.floor(interval) if staircase else interval
        assert lrs[t + 1] == pytest.approx(0.001 * (1 + 2.0 * interval))


@pytest.mark.parametrize("name, params", [
    ("WarmupLR", {"warmup_num_steps": 7}),
    ("WarmupDecayLR", {"total_num_steps": 30, "warmup_num_steps": 7}),
    ("WarmupCosineLR", {"total_num_steps": 30, "warmup_num_steps": 7}),
    ("OneCycle", {"cycle_min_lr": 0.01, "cycle_max_lr": 0.1, "cycle_first_step_size": 5, "decay_step_size": 3,
                  "decay_lr_rate": 0.1}),
    ("LRRangeTest", {"lr_range_test_step_size": 3}),
])
def test_state_dict_resume_continues_identically(name: str, params: dict) -> None:
    full = _sched(name, params, _adam())
    expected = _lrs_by_step(full, 20)
    first = _sched(name, params, _adam())
    _lrs_by_step(first, 8)
    state = first.state_dict()
    assert state == {"last_batch_iteration": 7}
    resumed = _sched(name, params, _adam())
    resumed.load_state_dict(state)
    assert resumed.get_last_lr() == pytest.approx([expected[8]])
    assert resumed.optimizer.param_groups[0]["lr"] == pytest.approx(expected[8])
    assert _lrs_by_step(resumed, 12)[1:] == pytest.approx(expected[9:])


def test_per_group_lists_and_length_check() -> None:
    opt = _adam(groups=2)
    _sched("WarmupLR", {"warmup_min_lr": [0.1, 0.2], "warmup_max_lr": [1.0, 2.0]}, opt)
    assert [g["lr"] for g in opt.param_groups] == [0.1, 0.2]
    with pytest.raises(ConfigError, match=r"'scheduler.params.warmup_min_lr'.*3 values.*2 param groups"):
        _sched("WarmupLR", {"warmup_min_lr": [0.1, 0.2, 0.3]}, _adam(groups=2))


def test_explicit_step_index() -> None:
    sched = _sched("LRRangeTest", {"lr_range_test_step_size": 1}, _adam())
    sched.step(9)
    assert sched.last_batch_iteration == 9 and sched.get_last_lr() == [pytest.approx(0.001 * 11)]


def test_defaults_follow_deepspeed() -> None:
    assert validate_lr_scheduler("WarmupLR", {}).params == {
        "warmup_min_lr": 0.0, "warmup_max_lr": None, "warmup_num_steps": 1000, "warmup_type": "log",
        "last_batch_iteration": -1}
    cos = validate_lr_scheduler("WarmupCosineLR", {"total_num_steps": 100}).params
    assert cos["cos_min_ratio"] == 0.0001 and cos["warmup_min_ratio"] == 0.0
    one = validate_lr_scheduler("OneCycle", {"cycle_min_lr": 0.1, "cycle_max_lr": 1}).params
    assert (one["cycle_first_step_size"], one["cycle_min_mom"], one["cycle_max_mom"]) == (2000, 0.8, 0.9)
    rt = validate_lr_scheduler("LRRangeTest", None).params
    assert (rt["lr_range_test_min_lr"], rt["lr_range_test_step_size"], rt["lr_range_test_step_rate"]) == (
        1e-3, 2000, 1.0)


@pytest.mark.parametrize("name, params, key", [
    ("WarmupLR", {"warmup_num_step": 10}, "scheduler.params.warmup_num_step"),
    ("WarmupLR", {"warmup_num_steps": 0}, "scheduler.params.warmup_num_steps"),
    ("WarmupLR", {"warmup_num_steps": 2.5}, "scheduler.params.warmup_num_steps"),
    ("WarmupLR", {"warmup_type": "cosine"}, "scheduler.params.warmup_type"),
    ("WarmupDecayLR", {}, "scheduler.params.total_num_steps"),
    ("OneCycle", {"cycle_min_lr": 0.1}, "scheduler.params.cycle_max_lr"),
    ("WarmupCosineLR", {"total_num_steps": 10, "cos_min_ratio": 2}, "scheduler.params.cos_min_ratio"),
    ("LRRangeTest", {"lr_range_test_staircase": "yes"}, "scheduler.params.lr_range_test_staircase"),
    ("WarmupLR", {"warmup_max_lr": "auto"}, "scheduler.params.warmup_max_lr"),
])
def test_invalid_params_name_the_key(name: str, params: dict, key: str) -> None:
    with pytest.raises(ConfigError) as err:
        validate_lr_scheduler(name, params)
    assert f"'{key}'" in str(err.value)


def test_unknown_type_and_param_suggestions() -> None:
    with pytest.raises(ConfigError) as err:
        validate_lr_scheduler("WarmupCosine", {})
    assert "did you mean 'WarmupCosineLR'" in str(err.value)
    assert all(name in str(err.value) for name in SCHEDULER_TYPES)
    with pytest.raises(ConfigError, match="did you mean 'warmup_max_lr'"):
        validate_lr_scheduler("WarmupLR", {"warmup_max_rl": 0.1})
    assert validate_lr_scheduler("warmuplr", {}).name == "WarmupLR"
