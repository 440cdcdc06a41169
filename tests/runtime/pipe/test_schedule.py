"""Every registered schedule, simulated for many shapes: with non-blocking sends and blocking
receives each stage finishes (no hang), every message is received in the order sent, and every
micro batch passes forward and backward once on every stage."""

from __future__ import annotations

from collections import deque

import pytest

from dslaunch.runtime.pipe import schedule as sched

SHAPES = [(stages, micro) for stages in (1, 2, 3, 4, 7) for micro in (1, 2, 3, 4, 8)]
# (schedule, stages, micro batches, chunks) for every registered training schedule
CASES = [("1f1b", stages, micro, 1) for stages, micro in SHAPES] + [
    ("interleaved", stages, stages * k, chunks) for stages in (2, 3, 4) for k in (1, 2, 3) for chunks in (1, 2, 3)]
FORWARD_COST, BACKWARD_COST = 1.0, 2.0  # of a whole stage; a chunk costs its share


def _simulate(make: type[sched.PipeSchedule], stages: int, micro: int, chunks: int = 1
              ) -> tuple[list[list[sched.PipeInstruction]], float]:
    """Run the stages' instruction streams round-robin; a receive waits for its message.

    Returns what each stage did and when the last one finished (each rank's clock advances by
    its passes' costs and waits for the sender's clock on a receive; messages take no time).
    """
    streams = [[i for step in make(micro, stages, s, chunks).steps() for i in step] for s in range(stages)]
    pos, clock = [0] * stages, [0.0] * stages
    act = [deque() for _ in range(stages)]  # act[s]: activations sent to stage s, with the send time
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
                    sent, when = queue.popleft()
                    assert sent == (ins.buffer_id, ins.chunk)  # in the order sent
                    clock[s] = max(clock[s], when)
                elif isinstance(ins, sched.SendActivation):
                    act[(s + 1) % stages].append(((ins.buffer_id, ins.chunk + (s == stages - 1)), clock[s]))
                elif isinstance(ins, sched.SendGrad):
                    grad[(s - 1) % stages].append(((ins.buffer_id, ins.chunk - (s == 0)), clock[s]))
                elif isinstance(ins, sched.ForwardPass | sched.BackwardPass):
                    cost = FORWARD_COST if isinstance(ins, sched.ForwardPass) else BACKWARD_COST
                    clock[s] += cost / chunks
                done[s].append(ins)
                pos[s] += 1
                moved = True
        assert moved, f"{make.__name__} hangs at {stages} stages, {micro} micro batches, {chunks} chunks: {pos}"
    assert not any(act) and not any(grad)  # nothing sent that nobody received
    return done, max(clock)


@pytest.mark.parametrize("name, stages, micro, chunks", CASES)
def test_training_schedules_finish_and_cover_every_micro_batch(name: str, stages: int, micro: int,
                                                               chunks: int) -> None:
    make = sched.SCHEDULES[name]
    for s, done in enumerate(_simulate(make, stages, micro, chunks)[0]):
        fwd = [(i.buffer_id, i.chunk) for i in done if isinstance(i, sched.ForwardPass)]
        bwd = [(i.buffer_id, i.chunk) for i in done if isinstance(i, sched.BackwardPass)]
        every = [(mb, c) for mb in range(micro) for c in range(chunks)]
        assert sorted(fwd) == sorted(bwd) == every
        assert [i.name for i in done[-3:]] == ["ReduceGrads", "ReduceTiedGrads", "OptimizerStep"]
        live = peak = 0
        for i in done:  # a micro batch's activations live from its forward to its backward
            live += isinstance(i, sched.ForwardPass) - isinstance(i, sched.BackwardPass)
            peak = max(peak, live)
        assert peak <= make(micro, stages, s, chunks).num_pipe_buffers()


@pytest.mark.parametrize("stages, micro", [(2, 4), (4, 8), (4, 16), (8, 16)])
def test_interleaving_shrinks_the_bubble(stages: int, micro: int) -> None:
    """The simulated time of a batch: 1F1B's bubble is (stages - 1) passes of a whole stage; with
    2 chunks it halves (more chunks: smaller still)."""
    work = micro * (FORWARD_COST + BACKWARD_COST)
    one = _simulate(sched.TrainSchedule, stages, micro)[1]
    assert one == pytest.approx(work + (stages - 1) * (FORWARD_COST + BACKWARD_COST))
    bubbles = [_simulate(sched.InterleavedSchedule, stages, micro, chunks)[1] - work for chunks in (1, 2, 4)]
    assert bubbles[0] == pytest.approx(one - work)
    assert bubbles[1] == pytest.approx(bubbles[0] / 2) and bubbles[2] == pytest.approx(bubbles[0] / 4)


@pytest.mark.parametrize("stages, micro", SHAPES)
def test_inference_schedule_finishes(stages: int, micro: int) -> None:
    for done in _simulate(sched.InferenceSchedule, stages, micro)[0]:
        assert [i.buffer_id for i in done if isinstance(i, sched.ForwardPass)] == list(range(micro))


def test_1f1b_is_deepspeeds_order() -> None:
    names = [repr(i) for step in sched.TrainSchedule(3, 2, 0).steps() for i in step]
    assert names == ["LoadMicroBatch(0)", "ForwardPass(0)", "SendActivation(0)",
                     "LoadMicroBatch(1)", "ForwardPass(1)", "SendActivation(1)", "RecvGrad(0)", "BackwardPass(0)",
                     "LoadMicroBatch(2)", "ForwardPass(2)", "SendActivation(2)", "RecvGrad(1)", "BackwardPass(1)",
                     "RecvGrad(2)", "BackwardPass(2)", "ReduceGrads()", "ReduceTiedGrads()", "OptimizerStep()"]


def test_instructions_say_what_a_stage_does_for_the_hang_report() -> None:
    assert sched.RecvActivation(5).describe(2, 4) == "stage 2 waiting to receive activations of micro-batch 5 from stage 1"
    assert sched.RecvGrad(0).describe(3, 4) == "stage 3 waiting to receive gradients of micro-batch 0 from stage 0"
    assert sched.ForwardPass(3, chunk=1).describe(0, 2) == "stage 0 in the forward pass of micro-batch 3 (chunk 1)"
    assert sched.OptimizerStep().describe(1, 2) == ("stage 1 in the optimizer step (first waiting until its sends "
                                                    "were received)")
