"""DualPipeV's schedule without processes: every rank's stream simulated together (the simulator
of ``test_schedule.py``): no rank waits forever, every message is received in the order sent and
none is left over, every forward comes before its backward (and after the forward that feeds it,
on the turning rank too), each micro batch passes each of the ``2 * stages`` parts once each way,
the activations held stay bounded whatever the number of micro batches; and the lists are
DeepSpeed 0.19.8's, compared with the real one where its venv exists."""

from __future__ import annotations

import json

import pytest

from dslaunch.runtime.pipe import schedule as sched
from dslaunch.runtime.pipe.placement import VShape
from dslaunch.runtime.pipe.vschedule import DualPipeVSchedule
from tests.deepspeed_reference import run_python
from tests.runtime.pipe.test_schedule import BACKWARD_COST, FORWARD_COST, simulate

SHAPES = [(stages, micro) for stages in (1, 2, 3, 4, 6) for micro in (2 * stages, 2 * stages + 1, 3 * stages + 2, 25)]


def _streams(stages: int, micro: int, forward_only: bool = False) -> list[DualPipeVSchedule]:
    return [DualPipeVSchedule(micro, stages, s, forward_only) for s in range(stages)]


def _peak(done: list[sched.PipeInstruction]) -> int:
    """The most (micro batch, chunk) activations a rank held at once: from a forward to its backward."""
    live = peak = 0
    for i in done:
        live += isinstance(i, sched.ForwardPass) - isinstance(i, sched.BackwardPass)
        peak = max(peak, live)
    return peak


@pytest.mark.parametrize("stages, micro", SHAPES)
def test_every_rank_finishes_and_runs_each_part_once_each_way(stages: int, micro: int) -> None:
    done, _ = simulate(_streams(stages, micro))
    for s, ops in enumerate(done):
        every = [(mb, c) for mb in range(micro) for c in (0, 1)]
        assert sorted((i.micro_batch, i.chunk) for i in ops if isinstance(i, sched.ForwardPass)) == every
        assert sorted((i.micro_batch, i.chunk) for i in ops if isinstance(i, sched.BackwardPass)) == every
        assert [i.name for i in ops[-3:]] == ["ReduceTiedGrads", "ReduceGrads", "OptimizerStep"]
        # rank 0 reads each micro batch once, for its first part; the labels are for its last
        loads = [i.micro_batch for i in ops if isinstance(i, sched.LoadMicroBatch)]
        assert loads == (list(range(micro)) if s == 0 else [])
        for i in ops:
            if isinstance(i, sched.BufferOpInstruction):
                assert i.buffer_id == i.chunk * micro + i.micro_batch < DualPipeVSchedule(micro, stages, s).num_pipe_buffers()


@pytest.mark.parametrize("stages", [1, 2, 3, 4, 6])
def test_the_activations_held_do_not_grow_with_the_micro_batches(stages: int) -> None:
    """Each rank holds at most ``2 * stages + 1`` chunk activations (DualPipe's bound: ``stages + 1``
    micro batches of two chunks, less one), at 2 * stages micro batches as at 40."""
    peaks = {micro: [_peak(ops) for ops in simulate(_streams(stages, micro))[0]] for micro in (2 * stages, 40)}
    assert peaks[2 * stages] == peaks[40]
    assert max(peaks[40]) <= 2 * stages + 1


@pytest.mark.parametrize("stages, micro", SHAPES)
def test_forward_only_runs_no_backward_and_no_step(stages: int, micro: int) -> None:
    done, _ = simulate(_streams(stages, micro, forward_only=True))
    for ops in done:
        assert sorted((i.micro_batch, i.chunk) for i in ops if isinstance(i, sched.ForwardPass)) == [
            (mb, c) for mb in range(micro) for c in (0, 1)]
        assert not [i for i in ops if isinstance(i, sched.BackwardPass | sched.SendGrad | sched.RecvGrad
                                                  | sched.OptimizerStep)]


@pytest.mark.parametrize("stages, micro", [(2, 4), (4, 8), (4, 16), (8, 16), (8, 32)])
def test_the_bubble_is_below_1f1bs_on_the_same_ranks(stages: int, micro: int) -> None:
    """Simulated batch time, the same model on the same ranks (a DualPipeV chunk is half a 1F1B
    stage): DualPipeV idles less than 1F1B, though without DualPipe's weight-gradient split and
    overlap it keeps a bubble of its own."""
    work = micro * (FORWARD_COST + BACKWARD_COST)
    one = simulate([sched.TrainSchedule(micro, stages, s) for s in range(stages)])[1] - work
    v = simulate(_streams(stages, micro))[1] - work
    assert 0 < v < one


def test_messages_go_out_and_come_back_over_the_ranks() -> None:
    """Rank 1 of 3: phase 0 from rank 0 to rank 2, phase 1 from rank 2 to rank 0."""
    v = VShape(3)
    assert [v.part(1, c) for c in (0, 1)] == [1, 4]
    assert v.neighbour(1, 0, 1) == (2, 0) and v.neighbour(1, 0, -1) == (0, 0)
    assert v.neighbour(1, 1, 1) == (0, 1) and v.neighbour(1, 1, -1) == (2, 1)
    assert v.neighbour(2, 0, 1) == (2, 1)  # the turn: on the last rank itself
    assert v.ends(0, 0) == (True, False) and v.ends(0, 1) == (False, True)
    assert sched.RecvActivation(0, chunk=1).describe(1, 3, v) == ("stage 1 waiting to receive activations of "
                                                                  "micro-batch 0 (chunk 1) from stage 2")


def test_deepspeeds_construction_and_refusal() -> None:
    schedule = sched.DualPipeVSchedule(micro_batches=4, stages=2, stage_id=1)  # DeepSpeed's path and keywords
    assert (schedule.num_pipe_buffers(), schedule.num_stages, schedule.forward_only) == (8, 2, False)
    with pytest.raises(ValueError, match="DualPipeV needs at least 2 \\* 3 micro-batches, got 5"):
        DualPipeVSchedule(5, 3, 0)


_DEEPSPEED_LISTS = """
import json, sys
from deepspeed.runtime.pipe import schedule as S
out = {}
for stages, micro, forward_only in json.loads(sys.argv[1]):
    for r in range(stages):
        out[f"{stages},{micro},{forward_only},{r}"] = [
            [[type(i).__name__, getattr(i, "buffer_id", -1), getattr(i, "phase", 0)] for i in step]
            for step in S.DualPipeVSchedule(micro_batches=micro, stages=stages, stage_id=r, forward_only=forward_only).steps()]
print(json.dumps(out))
"""


@pytest.mark.timeout(120)
def test_the_lists_are_deepspeeds(deepspeed_python) -> None:
    """Instruction types, buffer ids, phases and order, every rank, 1-6 ranks, forward-only too."""
    cases = [(stages, micro, fo) for stages, micro in SHAPES for fo in (False, True)]
    proc = run_python(deepspeed_python, ["-c", _DEEPSPEED_LISTS, json.dumps(cases)],
                      {"DS_ACCELERATOR": "cpu", "PATH": "/usr/bin:/bin"}, timeout=100)
    assert proc.returncode == 0, proc.stderr[-2000:]
    theirs = json.loads(proc.stdout.splitlines()[-1])
    assert len(theirs) == sum(stages for stages, _, _ in cases)
    for key, want in theirs.items():
        stages, micro, fo, r = json.loads(f"[{key.replace('True', 'true').replace('False', 'false')}]")
        ours = [[[type(i).__name__, i.buffer_id, i.chunk] for i in step]
                for step in DualPipeVSchedule(micro, stages, r, fo).steps()]
        assert ours == want, key
