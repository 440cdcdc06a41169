"""Timers: accumulation, reset, running timers, the log line, CUDA sync only when in use."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
import torch

from dslaunch.runtime.timers import STEP_TIMERS, Timer, Timers

pytestmark = pytest.mark.timeout(30)


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _no_sync() -> None:
    return None


def test_accumulates_intervals_and_resets() -> None:
    clock = FakeClock()
    timer = Timer("forward", sync=_no_sync, clock=clock)
    for duration in (0.5, 0.25):
        timer.start()
        clock.now += duration
        timer.stop()
        clock.now += 10.0  # time between intervals is not counted
    assert timer.count == 2 and timer.mean() == pytest.approx(0.375)
    assert timer.elapsed(reset=False) == pytest.approx(0.75)
    assert timer.elapsed() == pytest.approx(0.75)
    assert timer.elapsed() == 0.0 and timer.count == 0


def test_running_timer_reports_current_interval_and_keeps_running() -> None:
    clock = FakeClock()
    timer = Timer("step", sync=_no_sync, clock=clock)
    timer.start()
    clock.now = 2.0
    assert timer.elapsed(reset=True) == pytest.approx(2.0)
    assert timer.running
    clock.now = 3.0
    timer.stop()
    assert timer.elapsed() == pytest.approx(1.0)  # only the time since the reset


def test_misuse_is_reported() -> None:
    timer = Timer("backward", sync=_no_sync)
    with pytest.raises(RuntimeError, match="not running"):
        timer.stop()
    timer.start()
    with pytest.raises(RuntimeError, match="already running"):
        timer.start()


def test_log_line_format_order_normalizer_and_reset() -> None:
    clock = FakeClock()
    timers = Timers(sync=_no_sync, clock=clock)
    for name, seconds in (("step", 0.004), ("forward", 0.010), ("backward", 0.020)):
        timers(name).start()
        clock.now += seconds
        timers(name).stop()
    printed = []
    line = timers.log(STEP_TIMERS, normalizer=2, print_fn=printed.append)
    # allreduce was never started: left out; order follows the names given
    assert line == "time (ms) | forward: 5.00 | backward: 10.00 | step: 2.00"
    assert printed == [line]
    assert timers.log_line(["forward"]) == "time (ms) | forward: 0.00"
    with pytest.raises(ValueError):
        timers.log_line(normalizer=0)


def test_real_clock_measures_sleep() -> None:
    timers = Timers()
    timers("forward").start()
    time.sleep(0.02)
    timers("forward").stop()
    assert 0.015 <= timers("forward").elapsed() < 1.0
    assert "forward" in timers and "nope" not in timers


def test_sync_runs_around_each_clock_reading() -> None:
    calls = []
    timer = Timer("allreduce", sync=lambda: calls.append(1), clock=FakeClock())
    timer.start()
    timer.stop()
    assert len(calls) == 2


def test_default_sync_does_not_initialise_cuda() -> None:
    # a fresh process: on a GPU machine an earlier test in this one has initialised CUDA
    code = ("import torch; from dslaunch.runtime.timers import Timer; Timer('x').start(); "
            "print(torch.cuda.is_initialized())")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "False", done.stderr[-2000:]


def test_name_first_shorthands() -> None:
    clock = FakeClock()
    timers = Timers(sync=_no_sync, clock=clock)
    timers.start("allreduce")
    clock.now = 0.003
    timers.stop("allreduce")
    assert timers.elapsed("allreduce", reset=False) == pytest.approx(0.003)
    assert timers.log_line(["allreduce"]) == "time (ms) | allreduce: 3.00"
    assert timers.elapsed("allreduce") == 0.0


# Per forward: far above the tiny model's own forward time, and long enough that a step's overshoot on
# a machine at load 10 (tens of ms) keeps the mean below 2x, what the total of 2 steps would read.
SLEEP_S = 0.1


class _SlowModel(torch.nn.Module):
    """The test model with a forward that takes at least SLEEP_S."""

    def __init__(self) -> None:
        super().__init__()
        from tests.runtime.models import make_model

        self.inner = make_model()

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        time.sleep(SLEEP_S)
        return self.inner(tokens, labels)


def _forward_ms_logged(rank: int, world: int, ckpt_dir: str) -> list[float]:
    """Train 2 steps and checkpoint; resume and train to step 4 (steps_per_print=4); return the ms."""
    import contextlib
    import io
    import re

    import dslaunch
    from tests.runtime.models import batches

    config = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 4, "wall_clock_breakdown": True,
              "optimizer": {"type": "SGD", "params": {"lr": 1e-2}}}
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        engine, _, _, _ = dslaunch.initialize(model=_SlowModel(), config=config)
        for tokens, labels in batches(2, 2):
            engine.backward(engine(tokens, labels))
            engine.step()
        engine.save_checkpoint(ckpt_dir)
        engine, _, _, _ = dslaunch.initialize(model=_SlowModel(), config=config)
        engine.load_checkpoint(ckpt_dir)
        for tokens, labels in batches(2, 2):  # steps 3 and 4: the report at 4 covers 2 timed steps
            engine.backward(engine(tokens, labels))
            engine.step()
    return [float(ms) for ms in re.findall(r"forward: ([0-9.]+)", printed.getvalue())]


@pytest.mark.timeout(60)
def test_engine_logs_forward_ms_per_optimizer_step_also_after_resume(tmp_path) -> None:
    from tests.distributed import run_world

    (logged,) = run_world(_forward_ms_logged, 1, str(tmp_path))
    assert len(logged) == 1  # only at global step 4
    # Mean per step over the 2 steps since the resume: not their total, not divided by 4.
    assert SLEEP_S * 1000 <= logged[0] < 2 * SLEEP_S * 1000


def test_synchronized_wall_clock_timer_is_deepspeeds_in_milliseconds(capsys: pytest.CaptureFixture[str]) -> None:
    from dslaunch.runtime.timers import NoopTimer, SynchronizedWallClockTimer

    timers = SynchronizedWallClockTimer()
    timers("fwd").start()
    time.sleep(0.05)
    timers("fwd").stop()
    assert 50 <= timers("fwd").elapsed(reset=False) < 2000  # milliseconds, as DeepSpeed's
    assert 50 <= timers.get_mean(["fwd", "never"])["fwd"] < 2000
    assert set(timers.get_timers()) == {"fwd"}
    timers.log(["fwd", "never"], normalizer=2)  # no process group: printed as rank -1
    line = capsys.readouterr().out.strip()
    assert line.startswith("[Rank -1] time (ms) | fwd: ") and "never" not in line
    assert 25 <= float(line.rsplit(" ", 1)[1]) < 1000
    assert timers("fwd").elapsed() == 0  # the log reset it
    noop = NoopTimer()
    noop("x").start()
    noop("x").stop(reset=True)
    assert noop("x").elapsed(reset=False) == 0 and noop.get_timers() == {}
