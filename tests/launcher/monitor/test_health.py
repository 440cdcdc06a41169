"""Health from heartbeats: the hang rule (first-step allowance included), who is blamed, and what a
rank was doing, judged on the controller's clock with beats as workers send them."""

from __future__ import annotations

import pytest

from dslaunch.launcher.monitor.health import (
    FIRST_STEP_ALLOWANCE_S,
    SILENT_AFTER_S,
    Health,
    top_frame,
    waited_for,
)
from dslaunch.utils.beat import Beat, ExpertExchange

pytestmark = pytest.mark.timeout(30)

WAITING = """Thread 0x00007f01 (most recent call first):
  File "/venv/lib/python3.11/site-packages/dslaunch/runtime/heartbeat.py", line 103 in _run
  File "/usr/lib/python3.11/threading.py", line 982 in run

Current thread 0x00007f02 (most recent call first):
  File "/venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py", line 3252 in all_reduce
  File "/venv/lib/python3.11/site-packages/torch/distributed/c10d_logger.py", line 83 in wrapper
  File "/job/train.py", line 40 in train_step
  File "/job/train.py", line 60 in <module>
"""
COMPUTING = """Current thread 0x00007f02 (most recent call first):
  File "/job/model.py", line 12 in forward
  File "/job/train.py", line 60 in <module>
"""


def _health(timeout: float | None = 5.0, world: int = 3) -> Health:
    return Health([(r, r // 2, f"host{r // 2}") for r in range(world)], timeout)


def test_a_rank_is_stalled_after_the_timeout_without_a_new_step_and_alive_beats_do_not_count():
    h = _health()
    h.update({0: Beat(0, 1, 4), 1: Beat(1, 1, 4), 2: Beat(2, 1, 4)}, now=0.0)
    h.update({0: Beat(0, 2, 5), 1: Beat(1, 2, 5), 2: Beat(2, 2, 4)}, now=1.0)
    h.update({0: Beat(0, 3, 5), 1: Beat(1, 3, 5), 2: Beat(2, 3, 4)}, now=5.5)  # alive, not moving
    assert h.stalled(now=5.5) == [2]
    assert h.stalled(now=6.5) == [0, 1, 2]
    assert _health(timeout=None).stalled(now=1e9) == []


def test_the_first_step_gets_the_longer_allowance_and_silent_ranks_are_not_judged():
    h = _health()
    h.update({0: Beat(0, 1, None), 1: Beat(1, 1, None)}, now=0.0)  # up, before step 1; rank 2 never beat
    assert h.stalled(now=FIRST_STEP_ALLOWANCE_S - 1) == []
    assert h.stalled(now=FIRST_STEP_ALLOWANCE_S + 1) == [0, 1]
    assert not h.all_up()


def test_a_checkpoint_or_exit_phase_gets_the_first_step_allowance_from_when_it_began_or_ended():
    h = _health(world=2)
    h.update({0: Beat(0, 1, 4), 1: Beat(1, 1, 4)}, now=0.0)
    h.update({0: Beat(0, 2, 4, phase="checkpoint"), 1: Beat(1, 2, 4, phase="exit")}, now=4.0)
    assert h.stalled(now=4.0 + FIRST_STEP_ALLOWANCE_S - 1) == []
    assert h.stalled(now=4.0 + FIRST_STEP_ALLOWANCE_S + 1) == [0, 1]
    # The save ends: the ordinary timeout runs again, from then (not from the last step).
    h.update({0: Beat(0, 3, 4), 1: Beat(1, 3, 4, phase="exit")}, now=30.0)
    assert h.stalled(now=34.0) == []
    assert h.stalled(now=35.5) == [0]


def test_blame_goes_to_the_lowest_step_then_the_stopped_then_the_silent_then_not_in_a_collective():
    h = _health()
    h.update({0: Beat(0, 1, 7), 1: Beat(1, 1, 7), 2: Beat(2, 1, 6)}, now=0.0)
    assert h.behind({}, now=1.0) == [2]  # behind by a step
    h = _health()
    h.update({0: Beat(0, 1, 7), 1: Beat(1, 1, 7), 2: Beat(2, 1, 7)}, now=0.0)
    h.update({0: Beat(0, 2, 7), 2: Beat(2, 2, 7)}, now=SILENT_AFTER_S + 1)  # rank 1 went quiet
    stacks = {0: {"stopped": False, "stack": WAITING}, 1: {"stopped": False, "stack": WAITING},
              2: {"stopped": True, "stack": WAITING}}
    assert h.behind(stacks, now=SILENT_AFTER_S + 2) == [2]  # stopped beats silent
    stacks[2]["stopped"] = False
    assert h.behind(stacks, now=SILENT_AFTER_S + 2) == [1]
    h.update({1: Beat(1, 2, 7)}, now=SILENT_AFTER_S + 2)
    stacks[0]["stack"] = COMPUTING
    assert h.behind(stacks, now=SILENT_AFTER_S + 2) == [0]  # the others wait for it in all_reduce
    stacks[0]["stack"] = WAITING
    assert h.behind(stacks, now=SILENT_AFTER_S + 2) == [0, 1, 2]  # nothing tells them apart: all named


ENGINE_WAIT = """Current thread 0x00007f02 (most recent call first):
  File "/venv/lib/python3.11/site-packages/dslaunch/runtime/zero/reducer.py", line 188 in _finish
  File "/job/train.py", line 60 in <module>
"""


def test_a_rank_waiting_in_a_collective_the_engine_marked_is_not_blamed_whatever_its_stack():
    # The engine's work.wait() is dslaunch's frame, not torch.distributed's: the beat tells.
    h = _health(world=2)
    h.update({0: Beat(0, 1, 3, waiting="all_reduce of gradients", waiting_s=4.5), 1: Beat(1, 1, 3)}, now=0.0)
    stacks = {0: {"stopped": False, "stack": ENGINE_WAIT}, 1: {"stopped": False, "stack": COMPUTING}}
    assert h.behind(stacks, now=1.0) == [1]
    assert h.waiting(0, stacks[0], now=1.0) and not h.waiting(1, stacks[1], now=1.0)
    # A stopped or silent rank's last beat may predate where it stopped: its stack tells.
    assert not h.waiting(0, {"stopped": True, "stack": ENGINE_WAIT}, now=1.0)
    assert not h.waiting(0, stacks[0], now=SILENT_AFTER_S + 1)
    # A collective the script calls on torch.distributed itself is not marked: its stack tells.
    h.update({0: Beat(0, 2, 3)}, now=1.0)
    assert h.behind({0: {"stack": WAITING}, 1: {"stack": COMPUTING}}, now=1.0) == [1]


def test_the_member_an_moe_all_to_all_waits_for_is_blamed_though_it_waits_elsewhere():
    # World 4, one expert group over ranks 0-3 (2 experts each): rank 3 skipped layer 1's dispatch
    # and waits in the gradient all-reduce; every rank waits, only the exchange tells who is missing.
    dispatch = ExpertExchange("dispatch", 1, (0, 1, 2, 3), 2)
    assert str(dispatch) == "moe all_to_all (dispatch) of layer 1, experts 0-7 on ranks 0-3"
    assert ExpertExchange.parse(str(dispatch)) == dispatch and ExpertExchange.parse("all_reduce") is None
    h = _health(world=4)
    h.update({r: Beat(r, 1, 5, waiting=str(dispatch), waiting_s=5.0) for r in range(3)}, now=0.0)
    h.update({3: Beat(3, 1, 5, waiting="all_reduce of gradients", waiting_s=5.0)}, now=0.0)
    stacks = {r: {"stopped": False, "stack": ENGINE_WAIT} for r in range(4)}
    assert h.absent_from_exchanges(stacks, now=1.0) == {3}
    assert h.behind(stacks, now=1.0) == [3]
    waits = {r: str(dispatch) for r in range(3)} | {3: "all_reduce of gradients"}
    assert waited_for(str(dispatch), waits) == "moe all_to_all (dispatch) of layer 1, experts 6-7 on rank 3"
    assert waited_for("all_reduce of gradients", waits) == "all_reduce of gradients"
    # Two expert groups (ranks 0,2 and 1,3, one expert each): only the group with a rank missing counts.
    even, odd = ExpertExchange("combine, backward", 0, (0, 2), 1), ExpertExchange("combine, backward", 0, (1, 3), 1)
    h.update({0: Beat(0, 2, 5, waiting=str(even)), 2: Beat(2, 2, 5, waiting=str(even)),
              1: Beat(1, 2, 5, waiting=str(odd)), 3: Beat(3, 2, 5)}, now=1.0)
    stacks[3] = {"stopped": False, "stack": COMPUTING}
    assert h.behind(stacks, now=1.5) == [3]
    assert waited_for(str(odd), {1: str(odd)}) == "moe all_to_all (combine, backward) of layer 0, expert 1 on rank 3"


def test_the_allowance_that_applies_is_named():
    h = _health(world=3)
    h.update({0: Beat(0, 1, 4), 1: Beat(1, 1, 4, phase="checkpoint"), 2: Beat(2, 1, None)}, now=0.0)
    assert h.allowance(0) == (5.0, "--hang_timeout")
    seconds, why = h.allowance(1)
    assert seconds == FIRST_STEP_ALLOWANCE_S and "while saving or loading a checkpoint" in why
    assert "--hang_timeout 5 s is for steps" in why
    assert "before its first step" in h.allowance(2)[1]
    long = _health(timeout=600.0, world=2)
    long.update({0: Beat(0, 1, 4, phase="exit")}, now=0.0)
    assert long.allowance(0) == (600.0, "--hang_timeout, while the process exits")


def test_top_frame_names_the_library_call_and_the_scripts_own_line():
    assert top_frame(WAITING) == ("all_reduce (torch/distributed/distributed_c10d.py:3252) "
                                  "from /job/train.py:40 in train_step")
    assert top_frame(COMPUTING) == "/job/model.py:12 in forward"
    assert top_frame(None) is None and top_frame("garbage") is None
    # py-spy's dump of a rank stopped inside a frozen standard-library module (os.environ, 3.11+):
    # that frame is the library's, the script's own line is still named (a CI run took it as the script's)
    frozen = ('Thread 7 (idle): "MainThread"\n    _Environ.__getitem__ (<frozen os>:676)\n'
              "    main (/job/train_loop.py:39)\n    <module> (/job/train_loop.py:58)\n")
    assert top_frame(frozen) == "_Environ.__getitem__ (<frozen os>:676) from /job/train_loop.py:39 in main"


def test_summary_reports_the_slowest_rank_and_memory():
    h = _health(world=2)
    from dslaunch.utils.beat import Memory

    h.update({0: Beat(0, 1, 10, 80.0, 0.25, Memory("gpu", 3 << 30, 5 << 30, 80 << 30)),
              1: Beat(1, 1, 9, 79.0, None, Memory("gpu", 4 << 30, 4 << 30, 80 << 30))}, now=0.0)
    assert not h.summary(now=1.0)["lagging"]  # a step apart between two beats: not lag
    s = h.summary(now=SILENT_AFTER_S + 1)
    assert (s["step"], s["slowest_rank"], s["slowest_step"], s["samples_per_s"], s["loss"]) == (10, 1, 9, 80.0, 0.25)
    assert s["lagging"]
    assert s["memory"] == {"kind": "gpu", "used": 4 << 30, "peak": 5 << 30, "total": 80 << 30}
    from dslaunch.launcher.monitor.status import format_progress

    assert format_progress(s) == ("step 10 | 80.0 samples/s | loss 0.25 | slowest rank 1 (step 9) | "
                                  "GPU 4.0/80.0 GiB (peak 5.0)")


def test_summary_takes_the_job_s_tokens_per_second_and_the_mean_mfu_of_the_ranks():
    from dslaunch.launcher.monitor.status import format_progress

    h = _health(world=3)
    h.update({0: Beat(0, 1, 5, 8.0, tokens_per_s=512.0, mfu=0.30, mfu_from="profiled"),
              1: Beat(1, 1, 5, 8.0, tokens_per_s=500.0, mfu=0.20, mfu_from="profiled"),
              2: Beat(2, 1, 5, 8.0)}, now=0.0)  # a rank without token ids: no rates of its own
    s = h.summary(now=1.0)
    assert (s["tokens_per_s"], s["mfu"], s["mfu_from"]) == (512.0, 0.25, "profiled")
    assert format_progress(s) == "step 5 | 8.0 samples/s | 512 tokens/s | MFU 25.0% (profiled)"
    h = _health(world=1)
    h.update({0: Beat(0, 1, 5, 8.0)}, now=0.0)
    assert "tokens/s" not in format_progress(h.summary(now=1.0)) and "mfu" not in h.summary(now=1.0)
