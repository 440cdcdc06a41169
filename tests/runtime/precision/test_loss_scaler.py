"""Loss scalers: DeepSpeed's dynamic rules step by step, properties, static/none, overflow check."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dslaunch.errors import ConfigError
from dslaunch.runtime.config.sections import Fp16Config, parse_section
from dslaunch.runtime.precision.loss_scaler import (
    DynamicLossScaler,
    LossScaleAtMinimumError,
    NoLossScaler,
    StaticLossScaler,
    build_loss_scaler,
)

pytestmark = pytest.mark.timeout(60)


def _fp16(section: dict) -> Fp16Config:
    """The ``fp16`` section as ``load_config`` parses it (the scaler gets it parsed, never a dict)."""
    return parse_section(Fp16Config, {"enabled": True, **section}, "fp16")


def _scales(scaler: DynamicLossScaler, overflows: list[bool]) -> list[float]:
    """The scale after each update."""
    out = []
    for overflow in overflows:
        scaler.update(overflow)
        out.append(scaler.loss_scale)
    return out


# ------------------------------------------------------------------ build from the fp16 section


def test_build_picks_the_strategy() -> None:
    assert isinstance(build_loss_scaler(None), NoLossScaler)
    assert isinstance(build_loss_scaler(_fp16({"enabled": False})), NoLossScaler)
    static = build_loss_scaler(_fp16({"enabled": True, "loss_scale": 128}))
    assert isinstance(static, StaticLossScaler) and static.loss_scale == 128.0
    dynamic = build_loss_scaler(_fp16({"enabled": True}))
    assert isinstance(dynamic, DynamicLossScaler)
    assert (dynamic.loss_scale, dynamic.scale_window, dynamic.hysteresis, dynamic.min_scale,
            dynamic.consecutive_hysteresis) == (2.0**16, 1000, 2, 1.0, False)
    custom = build_loss_scaler(_fp16({"enabled": True, "loss_scale": 0, "initial_scale_power": 8, "loss_scale_window": 5,
                                      "hysteresis": 3, "consecutive_hysteresis": True, "min_loss_scale": 4}))
    assert (custom.loss_scale, custom.scale_window, custom.hysteresis, custom.min_scale,
            custom.consecutive_hysteresis) == (256.0, 5, 3, 4.0, True)


def test_build_accepts_a_parsed_dataclass() -> None:
    from dataclasses import dataclass

    @dataclass(frozen=True)
    class Fp16:
        enabled: bool = True
        loss_scale: float = 0.0
        initial_scale_power: int = 4
        loss_scale_window: int = 7
        hysteresis: int = 1
        consecutive_hysteresis: bool = False
        min_loss_scale: float = 2.0

    scaler = build_loss_scaler(Fp16())
    assert (scaler.loss_scale, scaler.scale_window, scaler.hysteresis, scaler.min_scale) == (16.0, 7, 1, 2.0)


@pytest.mark.parametrize("section, key", [
    ({"enabled": True, "loss_scale": -1}, "fp16.loss_scale"),
    ({"enabled": True, "initial_scale_power": 1.5}, "fp16.initial_scale_power"),
    ({"enabled": True, "hysteresis": 0}, "fp16.hysteresis"),
    ({"enabled": True, "min_loss_scale": 0}, "fp16.min_loss_scale"),
    ({"enabled": "yes"}, "fp16.enabled"),
])
def test_build_rejects_bad_values_naming_the_key(section: dict, key: str) -> None:
    with pytest.raises(ConfigError, match=f"'{key}'"):
        build_loss_scaler(_fp16(section))


def test_scale_loss_and_no_scaler() -> None:
    loss = torch.tensor(3.0)
    assert build_loss_scaler(_fp16({"loss_scale": 8})).scale_loss(loss).item() == 24.0
    none = NoLossScaler()
    assert none.scale_loss(loss) is loss
    none.update(True)
    assert none.loss_scale == 1.0


def test_static_scale_never_changes() -> None:
    scaler = StaticLossScaler(1024.0)
    for overflow in [True, True, False] * 5:
        scaler.update(overflow)
    assert scaler.loss_scale == 1024.0


# ------------------------------------------------------------------ dynamic rules, step by step


def test_doubles_after_window_clean_updates() -> None:
    scaler = DynamicLossScaler(init_scale=16, scale_window=3, hysteresis=1)
    # Counting from iteration 0 with no overflow yet, the scale doubles on the update whose
    # number of earlier clean updates is a multiple of the window: updates 4, 7, 10, ...
    assert _scales(scaler, [False] * 9) == [16, 16, 16, 32, 32, 32, 64, 64, 64]


def test_hysteresis_delays_the_first_halving() -> None:
    scaler = DynamicLossScaler(init_scale=1024, scale_window=100, hysteresis=3)
    # two overflows are absorbed (hysteresis 3 -> 2 -> 1), the third halves, and without
    # consecutive_hysteresis each further overflow halves right away.
    assert _scales(scaler, [True, True, True, True]) == [1024, 1024, 512, 256]
    assert scaler.cur_hysteresis == 1


def test_clean_updates_do_not_refill_hysteresis_without_consecutive() -> None:
    scaler = DynamicLossScaler(init_scale=1024, scale_window=100, hysteresis=2)
    assert _scales(scaler, [True, False, False, True]) == [1024, 1024, 1024, 512]


def test_consecutive_hysteresis_refills_after_each_clean_update() -> None:
    scaler = DynamicLossScaler(init_scale=1024, scale_window=100, hysteresis=2, consecutive_hysteresis=True)
    # isolated overflows are always absorbed; only two in a row halve.
    assert _scales(scaler, [True, False, True, False, True, True]) == [1024, 1024, 1024, 1024, 1024, 512]


def test_window_restarts_after_an_overflow_and_refills_hysteresis() -> None:
    scaler = DynamicLossScaler(init_scale=64, scale_window=2, hysteresis=2)
    scales = _scales(scaler, [True, True, False, False, False, True])
    # update 0: absorbed; 1: halves to 32 (last overflow at 1); 2: stable 0; 3: stable 1;
    # 4: stable 2 -> doubles to 64 and hysteresis refilled; 5: overflow absorbed again.
    assert scales == [64, 32, 32, 32, 64, 64]
    assert scaler.cur_hysteresis == 1


def test_never_below_min_and_raises_like_deepspeed_at_the_minimum() -> None:
    scaler = DynamicLossScaler(init_scale=8, scale_window=10, hysteresis=1, min_scale=3)
    assert _scales(scaler, [True, True]) == [4, 3]
    with pytest.raises(LossScaleAtMinimumError, match="min_loss_scale"):
        scaler.update(True)
    lenient = DynamicLossScaler(init_scale=2, hysteresis=1, min_scale=1, raise_error_at_min_scale=False)
    assert _scales(lenient, [True, True, True]) == [1, 1, 1]


def test_state_dict_roundtrip_continues_identically() -> None:
    pattern = [False, True, False, False, True, True, False, False, False, False, True, False] * 3
    full = DynamicLossScaler(init_scale=256, scale_window=3, hysteresis=2)
    expected = _scales(full, pattern)
    first = DynamicLossScaler(init_scale=256, scale_window=3, hysteresis=2)
    _scales(first, pattern[:13])
    resumed = DynamicLossScaler(init_scale=256, scale_window=3, hysteresis=2)
    resumed.load_state_dict(first.state_dict())
    assert _scales(resumed, pattern[13:]) == expected[13:]


# ------------------------------------------------------------------ properties


@settings(max_examples=200, deadline=None)
@given(overflows=st.lists(st.booleans(), max_size=200), power=st.integers(0, 24), min_power=st.integers(0, 6),
       window=st.integers(1, 20), hysteresis=st.integers(1, 4), consecutive=st.booleans())
def test_properties(overflows, power, min_power, window, hysteresis, consecutive) -> None:
    init, min_scale = 2.0**power, 2.0**min_power
    scaler = DynamicLossScaler(init_scale=init, scale_window=window, hysteresis=hysteresis,
                               consecutive_hysteresis=consecutive, min_scale=min_scale,
                               raise_error_at_min_scale=False)
    previous, clean_run = scaler.loss_scale, 0
    for overflow in overflows:
        scaler.update(overflow)
        scale = scaler.loss_scale
        assert scale >= min(min_scale, init)  # never halved below the floor
        exponent = math.log2(scale / init)
        assert exponent == int(exponent)  # a power of two times the initial scale
        assert scale in (previous, previous * 2, previous / 2, min_scale)  # one move at a time
        if overflow:
            assert scale <= previous
            clean_run = 0
        else:
            assert scale >= previous
            clean_run += 1
        if scale > previous:
            assert clean_run >= window  # growth only after a full window of clean updates
        assert 1 <= scaler.cur_hysteresis <= hysteresis
        previous = scale


@settings(max_examples=50, deadline=None)
@given(n=st.integers(1, 50), window=st.integers(1, 10))
def test_property_no_overflow_doubles_every_window(n: int, window: int) -> None:
    scaler = DynamicLossScaler(init_scale=1.0, scale_window=window, hysteresis=2)
    _scales(scaler, [False] * n)
    assert scaler.loss_scale == 2.0 ** ((n - 1) // window)
