"""The live rates' arithmetic: tokens and model FLOPs per step (``WorkMeter``), and what the
heartbeat and the monitors make of them (tokens/s, MFU), against hand counts."""

from __future__ import annotations

import dataclasses
import os
import time

import pytest
import torch
from torch import nn

from dslaunch.runtime.events import StepRecord
from dslaunch.runtime.heartbeat import Heartbeat
from dslaunch.runtime.observers import HeartbeatSender, MonitorEvents
from dslaunch.runtime.throughput import PROFILED, SIX_N_TOKENS, WorkMeter, model_params
from tests.runtime.test_heartbeat import _read_beats

pytestmark = pytest.mark.timeout(60)

N = 32 * 8 + (8 * 32 + 32)  # the embedding's weights, then the head's weights and bias, by hand


def _model() -> nn.Module:
    return nn.Sequential(nn.Embedding(32, 8), nn.Linear(8, 32))


def _record(step: int, samples: int) -> StepRecord:
    return StepRecord(step, samples, step, None, (0.1,), 1.0, None, False, 0)


def test_a_step_is_6n_per_token_until_the_profiler_has_counted_one() -> None:
    model = _model()
    profiled: list[int | None] = [None]
    meter = WorkMeter(model_params(model), lambda: profiled[0])
    model.register_forward_pre_hook(meter.count_tokens, with_kwargs=True)
    assert meter.params == N
    model(torch.zeros(2, 16, dtype=torch.long))
    model(input=torch.zeros(2, 16, dtype=torch.long))  # a keyword argument counts too
    with torch.no_grad():
        model(torch.zeros(5, 16, dtype=torch.long))  # evaluation: not training work
    meter.on_step(_record(1, 4))
    assert (meter.tokens, meter.flops, meter.basis) == (64, 6 * N * 64, SIX_N_TOKENS)
    model(torch.zeros(2, 16, dtype=torch.long))
    profiled[0] = 1000  # the profiler's count of one step wins over the estimate
    meter.on_step(_record(2, 8))
    assert (meter.tokens, meter.flops, meter.basis) == (96, 6 * N * 64 + 1000, PROFILED)


def test_without_token_ids_nor_a_profile_there_is_no_flops_count() -> None:
    model = nn.Linear(4, 4)
    meter = WorkMeter(model_params(model))
    model.register_forward_pre_hook(meter.count_tokens, with_kwargs=True)
    model(torch.randn(3, 4))
    meter.on_step(_record(1, 3))
    assert (meter.tokens, meter.flops, meter.basis) == (0, 0.0, None)


def test_the_beat_carries_tokens_per_second_and_mfu_of_the_same_window() -> None:
    r, w = os.pipe()
    hb, model, peak = Heartbeat(w, rank=0), _model(), 1e7
    meter = WorkMeter(model_params(model))
    sender = HeartbeatSender(hb, meter, dp_world_size=2, peak=peak)
    model.register_forward_pre_hook(meter.count_tokens, with_kwargs=True)
    t0 = time.monotonic()
    for step in range(1, 5):
        model(torch.zeros(2, 16, dtype=torch.long))  # 32 tokens a step on this rank
        meter.on_step(_record(step, 4 * step))
        sender.on_step(_record(step, 4 * step))
        time.sleep(0.01)
    elapsed = time.monotonic() - t0
    hb.exiting()
    last = _read_beats(r)[-1]
    # All ranks' tokens (this rank's x 2) over at least one step's window, no step under its sleep.
    assert 2 * 32 / elapsed <= last.tokens_per_s <= 2 * 32 / 0.01
    # The FLOPs moved with the tokens, so over the same window: 6N FLOPs per token of this rank.
    assert last.mfu == pytest.approx(last.tokens_per_s / 2 * 6 * N / peak, rel=2e-3)
    assert last.mfu_from == SIX_N_TOKENS and last.step == 4


class _Monitor:
    def __init__(self) -> None:
        self.events: list[tuple[str, object, int]] = []

    def start_at(self, samples: int) -> None:
        pass

    def write_events(self, events: list) -> None:
        self.events += events


def test_the_monitors_get_samples_tokens_and_mfu_per_second() -> None:
    now = [10.0]
    monitor, model = _Monitor(), _model()
    meter = WorkMeter(model_params(model))
    model.register_forward_pre_hook(meter.count_tokens, with_kwargs=True)
    watcher = MonitorEvents(monitor, batch_size=4, dp_world_size=2, fp16=False, device=torch.device("cpu"),
                            work=meter, peak=1e6, clock=lambda: now[0])
    for step in (1, 2):
        model(torch.zeros(2, 16, dtype=torch.long))
        meter.on_step(_record(step, 4 * step))
        watcher.on_step(_record(step, 4 * step))
        now[0] += 0.5
    rates = {name.removeprefix("Train/Samples/"): value for name, value, x in monitor.events if x == 8}
    assert rates["samples_per_sec"] == pytest.approx(4 / 0.5)
    assert rates["tokens_per_sec"] == pytest.approx(32 * 2 / 0.5)
    assert rates["mfu"] == pytest.approx(6 * N * 32 / 0.5 / 1e6)
    assert not any(name.endswith(("tokens_per_sec", "mfu")) for name, _, x in monitor.events if x == 4)


def test_a_first_window_of_its_own_size_is_no_resume() -> None:
    """The first step's window need not be train_batch_size (a script that ends each window itself:
    managed_gradient_accumulation false): the monitors start at 0 then, not as a resumed run; a
    record that does not say its window (None) is taken as train_batch_size's."""
    for window, resumed in ((20, False), (None, True)):
        monitor, meter = _Monitor(), WorkMeter(model_params(_model()))
        watcher = MonitorEvents(monitor, batch_size=12, dp_world_size=2, fp16=False, device=torch.device("cpu"),
                                work=meter)
        watcher.on_step(dataclasses.replace(_record(1, 20), window_samples=window))
        assert any(name == "Run/resume" for name, _, _ in monitor.events) is resumed, window
