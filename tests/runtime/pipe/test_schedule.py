"""Every registered schedule, simulated for many shapes: with non-blocking sends and blocking
receives each stage finishes (no hang), every message is received in the order sent, and every
micro batch passes forward and backward once on every stage."""

from __future__ import annotations

from collections import deque

import pytest

from dslaunch.runtime.pipe import schedule as sched

SHAPES = [(stages, micro) for stages in (1, 2, 3, 4, 7) for micro in (1, 2, 3, 4, 8)]


def _simulate(make: type[sched.PipeSchedule], stages: int, micro: int) -> list[list[sched.PipeInstruction]]:
    """Run the stages' instruction streams round-robin; a receive waits for its message."""
    streams = [[i for step in make(micro, stages, s).steps() for i in step] for s in range(stages)]
    pos = [0] * stages
    act = [deque() for _ in range(stages)]  # act[s]: activations sent to stage s
    grad = [deque() for _ in range(stages)]  # grad[s]: gradients sent to stage s
    done: list[list[sched.PipeInstruction]] = [[] for _ in range(stages)]
    while any(pos[s] < len(streams[s]) for s in range(stages)):
        moved = False
        for s in range(stages):
            while pos[s] < len(streams[s]):
                ins = streams[s][pos[s]]
                if isinstance(ins, sched.RecvActivation | sched.RecvGrad):
                    queue = act[s] if isinstance(ins, sched.RecvActivation) else grad[s]
                    if not queue:
                        break
                    assert queue.popleft() == ins.buffer_id  # in the order sent
                elif isinstance(ins, sched.SendActivation):
                    act[s + 1].append(ins.buffer_id)
                elif isinstance(ins, sched.SendGrad):
                    grad[s - 1].append(ins.buffer_id)
                done[s].append(ins)
                pos[s] += 1
                moved = True
        assert moved, f"{make.__name__} hangs at {stages} stages, {micro} micro batches: {pos}"
    assert not any(act) and not any(grad)  # nothing sent that nobody received
    return done


@pytest.mark.parametrize("name", list(sched.SCHEDULES))
@pytest.mark.parametrize("stages, micro", SHAPES)
def test_training_schedules_finish_and_cover_every_micro_batch(name: str, stages: int, micro: int) -> None:
    for s, done in enumerate(_simulate(sched.SCHEDULES[name], stages, micro)):
        fwd = [i.buffer_id for i in done if isinstance(i, sched.ForwardPass)]
        bwd = [i.buffer_id for i in done if isinstance(i, sched.BackwardPass)]
        assert sorted(fwd) == sorted(bwd) == list(range(micro))
        assert bwd == sorted(bwd)  # the last backward is the accumulation boundary
        assert [i.name for i in done[-3:]] == ["ReduceGrads", "ReduceTiedGrads", "OptimizerStep"]
        live = peak = 0
        for i in done:  # a micro batch's activations live from its forward to its backward
            live += isinstance(i, sched.ForwardPass) - isinstance(i, sched.BackwardPass)
            peak = max(peak, live)
        assert peak <= sched.SCHEDULES[name](micro, stages, s).num_pipe_buffers()


@pytest.mark.parametrize("stages, micro", SHAPES)
def test_inference_schedule_finishes(stages: int, micro: int) -> None:
    for done in _simulate(sched.InferenceSchedule, stages, micro):
        assert [i.buffer_id for i in done if isinstance(i, sched.ForwardPass)] == list(range(micro))


def test_1f1b_is_deepspeeds_order() -> None:
    names = [repr(i) for step in sched.TrainSchedule(3, 2, 0).steps() for i in step]
    assert names == ["LoadMicroBatch(0)", "ForwardPass(0)", "SendActivation(0)",
                     "LoadMicroBatch(1)", "ForwardPass(1)", "SendActivation(1)", "RecvGrad(0)", "BackwardPass(0)",
                     "LoadMicroBatch(2)", "ForwardPass(2)", "SendActivation(2)", "RecvGrad(1)", "BackwardPass(1)",
                     "RecvGrad(2)", "BackwardPass(2)", "ReduceGrads()", "ReduceTiedGrads()", "OptimizerStep()"]
