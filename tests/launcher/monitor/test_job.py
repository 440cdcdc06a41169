"""The job monitor's hang report (``JobMonitor.diagnose_hang`` and ``finish``), fed beats the way the
gang loop feeds it, through a node handle that answers with them."""

from __future__ import annotations

import time

import pytest

from dslaunch.launcher.monitor.events import EventLog
from dslaunch.launcher.monitor.gang import GangResult, NodeHandle
from dslaunch.launcher.monitor.health import FIRST_STEP_ALLOWANCE_S, SILENT_AFTER_S
from dslaunch.launcher.monitor.job import JobMonitor
from dslaunch.launcher.spec import HANG_EXIT_CODE, JobSpec, MonitorSpec, NodeResult, NodeSpec, WorkerSpec
from dslaunch.utils.beat import Beat

pytestmark = pytest.mark.timeout(30)


class BeatingNode(NodeHandle):
    """A node whose ranks sent ``beats`` and whose stack dumps say ``stacks``; it never ends."""

    def __init__(self, beats: dict[int, Beat], stacks: dict[int, dict]) -> None:
        self.node = NodeSpec(0, "node0", tuple(WorkerSpec(r, r, ("python",)) for r in sorted(beats)))
        self._beats, self._stacks = beats, stacks

    def poll(self) -> NodeResult | None:
        return None

    def stop(self, sig: int) -> None:
        pass

    def kill(self) -> None:
        pass

    def beats(self) -> dict[int, Beat]:
        return self._beats

    def stacks(self) -> dict[int, dict]:
        return self._stacks


def _report(beats: dict[int, Beat], stalled: list[int] | None = None, hang_timeout: float = 5.0) -> str:
    node = BeatingNode(beats, {r: {"stopped": False, "stack": None} for r in beats})
    job = JobSpec((node.node,), "127.0.0.1", 29500, len(beats), monitor=MonitorSpec(hang_timeout))
    monitor = JobMonitor(job, EventLog(None))
    monitor.observe([node])
    failure, _ = monitor.diagnose_hang([node], sorted(beats) if stalled is None else stalled)
    details = monitor.finish(GangResult(HANG_EXIT_CODE, failure), [], None)
    return f"{failure.describe()}; {details}"


def test_a_hang_in_a_checkpoint_save_says_the_save_s_allowance_ran_out_not_the_hang_timeout():
    text = _report({0: Beat(0, 1, 9, phase="checkpoint", waiting="checkpoint all_gather", waiting_s=61.0),
                    1: Beat(1, 1, 9, phase="checkpoint")})
    assert text.startswith(f"rank 1 on node0 hung at step 9 (no progress for {FIRST_STEP_ALLOWANCE_S:g} s: "
                           "the allowance while saving or loading a checkpoint"), text
    assert "--hang_timeout 5 s is for steps" in text and "no progress for 5 s" not in text, text
    assert "rank 0 waited for it in checkpoint all_gather" in text, text


def test_a_hang_between_steps_names_the_hang_timeout():
    text = _report({0: Beat(0, 1, 3, waiting="all_reduce of gradients", waiting_s=5.2), 1: Beat(1, 1, 3)})
    assert text == ("rank 1 on node0 hung at step 3 (no progress for 5 s: --hang_timeout); "
                    "rank 0 waited for it in all_reduce of gradients"), text


def test_the_allowance_named_is_the_one_that_ran_out_not_the_blamed_rank_s_longer_one():
    # Rank 1 stopped before its first step's beat went out: it is blamed (lowest step), but the
    # timeout that fired is rank 0's --hang_timeout, not the first step's 60 s.
    text = _report({0: Beat(0, 1, 3, waiting="all_reduce of gradients", waiting_s=5.2), 1: Beat(1, 1, None)},
                   stalled=[0])
    assert text.startswith("rank 1 on node0 hung (no progress for 5 s: --hang_timeout)"), text


def test_a_pipeline_stage_s_activity_is_told_for_the_blamed_rank_and_the_ranks_waiting_for_it():
    text = _report({0: Beat(0, 1, 3, waiting="pipeline receive from rank 1", waiting_s=5.2,
                            activity="stage 0 waiting to receive gradients of micro-batch 1 from stage 1"),
                    1: Beat(1, 1, 3, activity="stage 1 in the forward pass of micro-batch 2")})
    assert text == ("rank 1 on node0 hung at step 3 (no progress for 5 s: --hang_timeout); it was stage 1 in the "
                    "forward pass of micro-batch 2; rank 0 waited for it in pipeline receive from rank 1 (stage 0 "
                    "waiting to receive gradients of micro-batch 1 from stage 1)"), text


class SlowDumpNode(BeatingNode):
    """Its ranks' stacks come ``after_s`` after they were asked for (dumps of many ranks, a loaded
    machine); meanwhile the ranks are frozen and send no beat."""

    def __init__(self, beats: dict[int, Beat], after_s: float) -> None:
        super().__init__(beats, {r: {"stopped": False, "stack": None} for r in beats})
        self._after_s, self._ready_at = after_s, None

    def request_stacks(self) -> None:
        self._ready_at = time.monotonic() + self._after_s

    def stacks(self) -> dict[int, dict] | None:
        return self._stacks if self._ready_at is not None and time.monotonic() >= self._ready_at else None


def test_silence_is_judged_when_the_hang_is_found_not_after_the_stack_dumps():
    # Rank 0's last beat was heard a second before rank 1's; both were alive. The dumps take long
    # enough that, judged after them, rank 0 alone would look silent and be blamed (a flake seen
    # beside two CPU hogs): the rank not waiting for its peers is the one behind.
    node = SlowDumpNode({0: Beat(0, 1, 3, waiting="all_reduce of gradients", waiting_s=1.0), 1: Beat(1, 1, 3)},
                        after_s=SILENT_AFTER_S - 0.5)
    job = JobSpec((node.node,), "127.0.0.1", 29500, 2, monitor=MonitorSpec(4.0))
    monitor = JobMonitor(job, EventLog(None))
    monitor.observe([node])
    time.sleep(1.0)
    node._beats = {**node._beats, 1: Beat(1, 2, 3)}
    monitor.observe([node])
    failure, _ = monitor.diagnose_hang([node], [0, 1])
    assert failure.rank == 1, failure.describe()
