"""The worker's heartbeat: rate-limited sends over a real pipe, cheap per step, stack dumps on the
signal, and nothing at all outside dslaunch."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from dslaunch.runtime.heartbeat import LIVENESS_S, TICK_S, Heartbeat
from dslaunch.utils.beat import STACK_SIGNAL, Beat

pytestmark = pytest.mark.timeout(60)


def _read_beats(fd: int) -> list[Beat]:
    os.set_blocking(fd, False)
    data = b""
    try:
        while chunk := os.read(fd, 65536):
            data += chunk
    except BlockingIOError:
        pass
    return [b for line in data.splitlines() if (b := Beat.from_line(line)) is not None]


def test_beats_at_every_step_send_only_a_few_lines_a_second():
    r, w = os.pipe()
    hb = Heartbeat(w, rank=3)
    hb.start()
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < 1.2:
        hb.beat(n, loss=0.5, samples=8 * n)
        n += 1
    per_call = (time.perf_counter() - t0) / n
    time.sleep(TICK_S + 0.2)  # the thread sends the last step
    beats = _read_beats(r)
    # 'up' + about one per tick, whatever the number of steps (hundreds of thousands here)
    assert n > 10_000 and len(beats) == hb.writes <= 2 + 1.7 / TICK_S, (n, len(beats))
    assert beats[0].step is None and beats[-1].step == n - 1 and beats[-1].rank == 3
    assert [b.seq for b in beats] == list(range(1, len(beats) + 1))
    assert beats[-1].samples_per_s > 0 and beats[-1].loss == 0.5
    # GPU memory once this process uses CUDA (an earlier test on a GPU machine), else RSS
    cuda = "torch" in sys.modules and sys.modules["torch"].cuda.is_initialized()
    assert beats[-1].memory.kind == ("gpu" if cuda else "rss") and beats[-1].memory.peak >= beats[-1].memory.used > 0
    # The cost per step is measured by scripts/bench/heartbeat_bench.py, not asserted here.
    print(f"heartbeat.beat: {per_call * 1e9:.0f} ns per step over {n} steps, {len(beats)} lines sent")


def test_a_job_whose_steps_all_fall_within_one_tick_has_a_rate():
    # The rate runs between the steps' own times: 8 steps before the first send, then exit.
    r, w = os.pipe()
    hb = Heartbeat(w, rank=0)
    hb.start()
    t0 = time.monotonic()
    for step in range(1, 9):
        time.sleep(0.01)
        hb.beat(step, samples=64 * step)
    elapsed = time.monotonic() - t0
    hb.exiting()
    last = _read_beats(r)[-1]
    assert last.step == 8 and last.phase == "exit"
    # Whatever the sends' timing: at least one step of 64 samples within `elapsed`, and no step
    # shorter than its 10 ms sleep.
    assert 64 / elapsed <= last.samples_per_s <= 64 / 0.01


def test_the_rate_goes_on_after_the_sample_count_goes_back():
    # A checkpoint loaded mid-process restores an earlier count: the rate runs from there. The
    # first rate is slow (64 samples in >= 0.3 s), the one after the load fast (64 in a measured
    # window), so a rate frozen at the first cannot pass.
    r, w = os.pipe()
    hb = Heartbeat(w, rank=0)
    hb.beat(100, samples=6400)
    time.sleep(0.3)
    hb.beat(101, samples=6464)
    hb.exiting()  # sends the slow rate
    t0 = time.monotonic()
    for step in (1, 2, 3):  # the rate runs from the first step after the load: 128 samples
        hb.beat(step, samples=64 * step)
        if step < 3:
            time.sleep(0.01)
    window = time.monotonic() - t0
    hb.exiting()
    beats = _read_beats(r)
    slow = [b.samples_per_s for b in beats if b.step == 101][-1]
    assert slow <= 64 / 0.3
    assert beats[-1].step == 3 and 128 / window <= beats[-1].samples_per_s <= 128 / 0.02


def test_a_rank_without_progress_still_beats_for_liveness():
    r, w = os.pipe()
    hb = Heartbeat(w, rank=0)
    hb.beat(1)
    time.sleep(LIVENESS_S + 2 * TICK_S + 0.3)
    beats = _read_beats(r)
    assert len(beats) >= 3 and {b.step for b in beats[1:]} == {1}


def test_a_phase_is_sent_while_it_lasts_and_exiting_says_so_at_once():
    r, w = os.pipe()
    hb = Heartbeat(w, rank=0)
    hb.beat(1)
    with hb.phase("checkpoint"):
        time.sleep(2 * TICK_S + 0.2)
        inside = _read_beats(r)
    time.sleep(2 * TICK_S + 0.2)
    after = _read_beats(r)
    hb.exiting()
    (last,) = _read_beats(r)  # sent by the call itself, not by the thread's next tick
    assert inside[-1].phase == "checkpoint" and after[-1].phase is None and after[-1].step == 1
    assert last.phase == "exit" and last.step == 1


def test_a_wait_on_the_peers_is_sent_with_how_long_it_lasted_and_nests():
    r, w = os.pipe()
    hb = Heartbeat(w, rank=0)
    hb.beat(1)
    # Entering a wait is sent at the next tick (it may have lasted only a moment then); a wait with
    # nothing else changing is sent again at the liveness beat, LIVENESS_S after that first send.
    with hb.waiting("checkpoint all_gather"):
        with hb.waiting("all_reduce of gradients"):
            time.sleep(LIVENESS_S + 2 * TICK_S)
            inner = _read_beats(r)
        time.sleep(2 * TICK_S + 0.2)
        outer = _read_beats(r)
    time.sleep(2 * TICK_S + 0.2)
    after = _read_beats(r)
    assert inner[-1].waiting == "all_reduce of gradients" and inner[-1].waiting_s >= LIVENESS_S, inner
    assert outer[-1].waiting == "checkpoint all_gather" and outer[-1].waiting_s > inner[-1].waiting_s, outer
    assert after[-1].waiting is None and after[-1].waiting_s is None and after[-1].step == 1


def test_only_the_main_thread_s_waits_count():
    """A background checkpoint writer waiting for its peers says nothing about training."""
    import threading

    r, w = os.pipe()
    hb = Heartbeat(w, rank=0)
    hb.beat(1)
    inside = threading.Event()

    def background() -> None:
        with hb.waiting("checkpoint all_gather"):
            inside.set()
            time.sleep(2 * TICK_S + 0.2)

    t = threading.Thread(target=background)
    t.start()
    inside.wait()
    t.join()
    assert {b.waiting for b in _read_beats(r)} == {None}


def test_stacks_of_every_thread_on_the_signal_even_while_the_main_thread_sleeps(tmp_path):
    """A real worker process: the stack pipe gets faulthandler's dump while it sits in sleep()."""
    code = ("import time, dslaunch; dslaunch.heartbeat(1); print('ready', flush=True)\n"
            "def waiting_here():\n    time.sleep(30)\nwaiting_here()\n")
    beat_r, beat_w = os.pipe()
    stack_r, stack_w = os.pipe()
    env = {**os.environ, "DSLAUNCH_HEARTBEAT_FD": str(beat_w), "DSLAUNCH_STACK_FD": str(stack_w), "RANK": "1"}
    proc = subprocess.Popen([sys.executable, "-c", code], env=env, pass_fds=(beat_w, stack_w),
                            stdout=subprocess.PIPE, text=True)
    os.close(beat_w)
    os.close(stack_w)
    try:
        assert proc.stdout.readline() == "ready\n"
        (up, *_) = _read_beats(beat_r)
        assert up.stack_signal == STACK_SIGNAL and up.pid == proc.pid and up.rank == 1
        os.set_blocking(stack_r, False)
        text = ""
        for _ in range(10):  # 'ready' comes just before the sleep: on a loaded machine, ask again
            os.kill(proc.pid, signal.SIGSTOP)  # as the monitor finds a hung rank: resumed, then asked
            os.kill(proc.pid, signal.SIGCONT)
            os.kill(proc.pid, up.stack_signal)
            time.sleep(0.5)
            try:
                text += os.read(stack_r, 65536).decode()
            except BlockingIOError:
                continue
            if "in waiting_here" in text:
                break
        assert proc.poll() is None  # dumped, not killed
    finally:
        proc.kill()
        proc.wait()
    assert 'line 3 in waiting_here' in text and "in _run" in text, text  # main thread and the sender


def test_outside_dslaunch_everything_is_a_no_op():
    code = ("import os, dslaunch; from dslaunch.runtime import heartbeat\n"
            "dslaunch.heartbeat(1); heartbeat.start()\n"
            "with heartbeat.waiting('all_reduce'): pass\n"
            "assert heartbeat.reporter() is None\n"
            "import sys; assert 'torch' not in sys.modules, 'imports torch'\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("DSLAUNCH_")}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr


def test_what_a_rank_raised_is_sent_at_once_and_only_the_first_time():
    r, w = os.pipe()
    hb = Heartbeat(w, rank=3)
    hb.beat(4)
    _read_beats(r)
    before = time.time()
    try:
        raise ValueError("stage 3 broke")
    except ValueError as err:
        hb.raised(err)
    (beat,) = _read_beats(r)  # sent by the call itself
    assert beat.raised == "ValueError: stage 3 broke" and before <= beat.raised_at <= time.time()
    assert beat.raised_trace.startswith("Traceback") and "stage 3 broke" in beat.raised_trace
    hb.raised(RuntimeError("an echo of it, later"))
    time.sleep(2 * TICK_S + 0.2)
    hb.beat(5)
    time.sleep(2 * TICK_S + 0.2)
    later = _read_beats(r)
    assert later and all(b.raised == "ValueError: stage 3 broke" for b in later)  # every later beat keeps it


def test_a_huge_exception_still_fits_one_beat_and_keeps_what_was_raised():
    line = Beat(0, 1, raised="E: " + "x" * 290, raised_at=1.0, raised_trace="y" * 2000,
                activity="z" * 300).to_line()
    assert len(line) <= 4000 and Beat.from_line(line).raised.startswith("E: x")
    huge = Beat(0, 1, raised="E: x", raised_at=1.0, raised_trace="y" * 5000).to_line()
    assert len(huge) <= 4000 and Beat.from_line(huge).raised == "E: x" and Beat.from_line(huge).raised_trace is None


def test_an_uncaught_exception_reaches_the_agent_before_the_process_ends():
    r, w = os.pipe()
    code = ("import dslaunch.runtime.heartbeat as h; h.start(); "
            "raise KeyError('the first one')")
    env = {**os.environ, "DSLAUNCH_HEARTBEAT_FD": str(w), "RANK": "1"}
    out = subprocess.run([sys.executable, "-c", code], env=env, pass_fds=(w,), capture_output=True, text=True,
                         timeout=60)
    os.close(w)
    assert out.returncode == 1 and "KeyError: 'the first one'" in out.stderr  # still printed as Python does
    raised = [b for b in _read_beats(r) if b.raised]
    assert raised and raised[0].rank == 1 and raised[0].raised == "KeyError: 'the first one'"
