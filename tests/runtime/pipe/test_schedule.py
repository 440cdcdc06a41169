"""Every registered schedule, simulated for many shapes: with non-blocking sends and blocking
receives each stage finishes (no hang), every message is received in the order sent, every micro
batch passes forward and backward once on every stage, and no buffer is reused while it still
holds a micro batch. DeepSpeed's schedules (1F1B, inference) also keep its lockstep: every stage
yields the same number of time steps and a message sent in step t is received in step t.
"""

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
    return simulate([make(micro, stages, s, chunks) for s in range(stages)])


def simulate(schedules: list[sched.PipeSchedule]) -> tuple[list[list[sched.PipeInstruction]], float]:
    """Run the stages' instruction streams round-robin; a receive waits for its message.

    Messages go where the schedule's placement says (the part after or before the chunk's); a part
    whose neighbour is on the same rank (DualPipeV's turn) needs no message, only that rank's
    forward (backward) of that part ran first. Returns what each stage did and when the last one
    finished (each rank's clock advances by its passes' costs and waits for the sender's clock on a
    receive; messages take no time).
    """
    stages, place = len(schedules), schedules[0].placement
    chunks = place.chunks
    streams = [sched.execution_order(x) for x in schedules]  # as the engine
    pos, clock = [0] * stages, [0.0] * stages
    queues: dict[tuple[type, int, int], deque] = {}  # (kind, from, to): (micro batch, chunk at the receiver), when
    passed: set[tuple[type, int, int, int]] = set()  # (pass, stage, micro batch, chunk) done
    done: list[list[sched.PipeInstruction]] = [[] for _ in range(stages)]
    sends = {sched.SendActivation: (1, sched.RecvActivation), sched.SendGrad: (-1, sched.RecvGrad)}
    recvs = {sched.RecvActivation: -1, sched.RecvGrad: 1}
    while any(pos[s] < len(streams[s]) for s in range(stages)):
        moved = False
        for s in range(stages):
            while pos[s] < len(streams[s]):
                ins = streams[s][pos[s]]
                if type(ins) in recvs:
                    peer = place.neighbour(s, ins.chunk, recvs[type(ins)])
                    queue = queues.get((type(ins), peer[0], s))
                    if not queue:
                        break
                    sent, when = queue.popleft()
                    assert sent == (ins.micro_batch, ins.chunk)  # in the order sent
                    clock[s] = max(clock[s], when)
                elif type(ins) in sends:
                    step, kind = sends[type(ins)]
                    peer = place.neighbour(s, ins.chunk, step)
                    assert peer[0] != s, ins  # no message to itself
                    queues.setdefault((kind, s, peer[0]), deque()).append(((ins.micro_batch, peer[1]), clock[s]))
                elif isinstance(ins, sched.ForwardPass | sched.BackwardPass):
                    forward = isinstance(ins, sched.ForwardPass)
                    if not forward:  # every forward before its backward
                        assert (sched.ForwardPass, s, ins.micro_batch, ins.chunk) in passed, ins
                    before = place.neighbour(s, ins.chunk, -1 if forward else 1)  # the part that feeds it
                    if before is not None and before[0] == s:
                        assert (type(ins), s, ins.micro_batch, before[1]) in passed, ins
                    assert (type(ins), s, ins.micro_batch, ins.chunk) not in passed, ins
                    passed.add((type(ins), s, ins.micro_batch, ins.chunk))
                    clock[s] += (FORWARD_COST if forward else BACKWARD_COST) / chunks
                done[s].append(ins)
                pos[s] += 1
                moved = True
        assert moved, f"{type(schedules[0]).__name__} hangs at {stages} stages, {schedules[0].micro_batches} " \
                      f"micro batches, {chunks} chunks: {pos}"
    assert not any(queues.values())  # nothing sent that nobody received
    return done, max(clock)


def _assert_buffers_not_reused_while_held(done: list[sched.PipeInstruction], buffers: int) -> None:
    """A buffer holds a micro batch from its first instruction to its last; no other micro batch
    may use it in between (DeepSpeed's engine keeps a micro batch's tensors in its buffer)."""
    ops = [i for i in done if isinstance(i, sched.BufferOpInstruction)]
    last = {(i.micro_batch, i.chunk): n for n, i in enumerate(ops)}
    holder: dict[tuple[int, int], tuple[int, int]] = {}
    for n, i in enumerate(ops):
        assert 0 <= i.buffer_id < buffers, i
        slot, key = (i.buffer_id, i.chunk), (i.micro_batch, i.chunk)
        held = holder.get(slot)
        assert held is None or held == key or last[held] < n, f"{i}: buffer still holds micro batch {held}"
        holder[slot] = key


@pytest.mark.parametrize("name, stages, micro, chunks", CASES)
def test_training_schedules_finish_and_cover_every_micro_batch(name: str, stages: int, micro: int,
                                                               chunks: int) -> None:
    make = sched.SCHEDULES[name]
    for s, done in enumerate(_simulate(make, stages, micro, chunks)[0]):
        fwd = [(i.micro_batch, i.chunk) for i in done if isinstance(i, sched.ForwardPass)]
        bwd = [(i.micro_batch, i.chunk) for i in done if isinstance(i, sched.BackwardPass)]
        every = [(mb, c) for mb in range(micro) for c in range(chunks)]
        assert sorted(fwd) == sorted(bwd) == every
        assert [i.name for i in done[-3:]] == ["ReduceTiedGrads", "ReduceGrads", "OptimizerStep"]
        live = peak = 0
        for i in done:  # a micro batch's activations live from its forward to its backward
            live += isinstance(i, sched.ForwardPass) - isinstance(i, sched.BackwardPass)
            peak = max(peak, live)
        buffers = make(micro, stages, s, chunks).num_pipe_buffers()
        assert peak <= buffers
        _assert_buffers_not_reused_while_held(done, buffers)


@pytest.mark.parametrize("name, stages, micro, chunks", CASES)
def test_the_engine_sends_right_after_the_pass(name: str, stages: int, micro: int, chunks: int) -> None:
    """In the engine's order a pass's outputs (or input gradients) go out right after it, not
    after the next step's receive as in DeepSpeed's lists (whose sends block)."""
    follows = {sched.SendActivation: sched.ForwardPass, sched.SendGrad: sched.BackwardPass}
    for s in range(stages):
        order = sched.execution_order(sched.SCHEDULES[name](micro, stages, s, chunks))
        for n, i in enumerate(order):
            if type(i) in follows:
                before = order[n - 1]
                assert type(before) is follows[type(i)] and before.micro_batch == i.micro_batch, (s, n, order)


def _messages(cmds: list[sched.PipeInstruction], kind: type, to_chunk: int = 0) -> list[tuple[int, int]]:
    """(micro batch, chunk at the receiver) of the ``kind`` instructions in ``cmds``."""
    return [(i.micro_batch, i.chunk + to_chunk) for i in cmds if type(i) is kind]


def _assert_lockstep(make: type[sched.PipeSchedule], stages: int, micro: int, chunks: int = 1) -> list[list]:
    """Every stage yields the same number of steps, and in each step the messages one stage sends
    to its neighbour are those the neighbour receives in that step, in the same order."""
    steps = [list(make(micro, stages, s, chunks).steps()) for s in range(stages)]
    assert len({len(st) for st in steps}) == 1
    for t in range(len(steps[0])):
        for s in range(stages):
            nxt, prv = (s + 1) % stages, (s - 1) % stages  # the ring joins the last chunk to the next
            assert (_messages(steps[s][t], sched.SendActivation, int(s == stages - 1))
                    == _messages(steps[nxt][t], sched.RecvActivation)), (t, s)
            assert _messages(steps[s][t], sched.SendGrad, -int(s == 0)) == _messages(steps[prv][t], sched.RecvGrad), (t, s)
    return steps


@pytest.mark.parametrize("stages, micro", SHAPES)
def test_1f1b_runs_deepspeeds_lockstep(stages: int, micro: int) -> None:
    """DeepSpeed's time steps: 2 * (micro + stages - 1) of them; stage s forwards micro batch m in
    step 2m + s and runs its backward in step 2m + 2 * stages - 1 - s, in buffer m % buffers."""
    steps = _assert_lockstep(sched.TrainSchedule, stages, micro)
    for s, stage_steps in enumerate(steps):
        schedule = sched.TrainSchedule(micro, stages, s)
        assert len(stage_steps) == 2 * (micro + stages - 1)
        assert schedule.num_pipe_buffers() == max(2, min(stages - s, micro))
        for t, cmds in enumerate(stage_steps):
            for i in cmds:
                if isinstance(i, sched.BufferOpInstruction):
                    assert i.buffer_id == i.micro_batch % schedule.num_pipe_buffers()
                if isinstance(i, sched.ForwardPass):
                    assert t == 2 * i.micro_batch + s
                if isinstance(i, sched.BackwardPass):
                    assert t == 2 * i.micro_batch + 2 * stages - 1 - s
        assert [i.name for i in stage_steps[-1][-3:]] == ["ReduceTiedGrads", "ReduceGrads", "OptimizerStep"]


@pytest.mark.parametrize("stages, micro", SHAPES)
def test_inference_runs_deepspeeds_lockstep(stages: int, micro: int) -> None:
    steps = _assert_lockstep(sched.InferenceSchedule, stages, micro)
    for s, stage_steps in enumerate(steps):
        assert len(stage_steps) == micro + stages - 1
        for t, cmds in enumerate(stage_steps):
            fwd = [i for i in cmds if isinstance(i, sched.ForwardPass)]
            assert [i.micro_batch for i in fwd] == ([t - s] if 0 <= t - s < micro else [])
            assert all(i.buffer_id == i.micro_batch % 2 for i in cmds)


@pytest.mark.parametrize("stages, micro, chunks", [(2, 4, 2), (3, 3, 2), (4, 8, 3)])
def test_inference_with_virtual_stages_keeps_the_lockstep(stages: int, micro: int, chunks: int) -> None:
    """Virtual stage v = chunk * stages + stage forwards micro batch t - v in step t; the last
    stage's outputs go round to the first stage's next chunk in the same step."""
    steps = _assert_lockstep(sched.InferenceSchedule, stages, micro, chunks)
    for s, stage_steps in enumerate(steps):
        assert len(stage_steps) == micro + stages * chunks - 1
        for t, cmds in enumerate(stage_steps):
            for i in cmds:
                if isinstance(i, sched.ForwardPass):
                    assert i.micro_batch == t - (i.chunk * stages + s)
    for done in _simulate(sched.InferenceSchedule, stages, micro, chunks)[0]:
        assert sorted((i.micro_batch, i.chunk) for i in done if isinstance(i, sched.ForwardPass)) == [
            (mb, c) for mb in range(micro) for c in range(chunks)]


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
    for s, done in enumerate(_simulate(sched.InferenceSchedule, stages, micro)[0]):
        assert [i.micro_batch for i in done if isinstance(i, sched.ForwardPass)] == list(range(micro))
        _assert_buffers_not_reused_while_held(done, sched.InferenceSchedule(micro, stages, s).num_pipe_buffers())


@pytest.mark.parametrize("micro", [1, 4])
def test_data_parallel_schedule_accumulates_in_one_buffer(micro: int) -> None:
    done = _simulate(sched.DataParallelSchedule, 1, micro)[0][0]
    assert [i.micro_batch for i in done if isinstance(i, sched.BackwardPass)] == list(range(micro))
    assert {i.buffer_id for i in done if isinstance(i, sched.BufferOpInstruction)} == {0}
    assert [i.name for i in done[-2:]] == ["ReduceGrads", "OptimizerStep"]


def test_1f1b_is_deepspeeds_order() -> None:
    steps = [[repr(i) for i in step] for step in sched.TrainSchedule(3, 2, 0).steps()]
    assert steps == [["LoadMicroBatch(buffer_id=0)", "ForwardPass(buffer_id=0)"],
                     ["SendActivation(buffer_id=0)"],
                     ["LoadMicroBatch(buffer_id=1)", "ForwardPass(buffer_id=1)"],
                     ["RecvGrad(buffer_id=0)", "SendActivation(buffer_id=1)", "BackwardPass(buffer_id=0)"],
                     ["LoadMicroBatch(buffer_id=0, micro_batch=2)", "ForwardPass(buffer_id=0, micro_batch=2)"],
                     ["RecvGrad(buffer_id=1)", "SendActivation(buffer_id=0, micro_batch=2)", "BackwardPass(buffer_id=1)"],
                     [],
                     ["RecvGrad(buffer_id=0, micro_batch=2)", "BackwardPass(buffer_id=0, micro_batch=2)",
                      "ReduceTiedGrads()", "ReduceGrads()", "OptimizerStep()"]]
    last = [[repr(i) for i in step] for step in sched.TrainSchedule(3, 2, 1).steps()]
    assert last[:4] == [[], ["RecvActivation(buffer_id=0)", "LoadMicroBatch(buffer_id=0)", "ForwardPass(buffer_id=0)"],
                        ["BackwardPass(buffer_id=0)"],
                        ["SendGrad(buffer_id=0)", "RecvActivation(buffer_id=1)", "LoadMicroBatch(buffer_id=1)",
                         "ForwardPass(buffer_id=1)"]]


def test_inference_orders_sends_and_receives_by_stage_parity() -> None:
    """As DeepSpeed (whose sends block): even stages send first, odd stages receive first."""
    def names(stage: int) -> list[str]:
        return [i.name for i in list(sched.InferenceSchedule(3, 4, stage).steps())[stage + 1]]
    assert names(1) == ["RecvActivation", "SendActivation", "ForwardPass"]
    assert names(2) == ["SendActivation", "RecvActivation", "ForwardPass"]
    assert names(3) == ["LoadMicroBatch", "RecvActivation", "ForwardPass"]


def test_instructions_say_what_a_stage_does_for_the_hang_report() -> None:
    assert sched.RecvActivation(5).describe(2, 4) == "stage 2 waiting to receive activations of micro-batch 5 from stage 1"
    assert sched.RecvGrad(0).describe(3, 4) == "stage 3 waiting to receive gradients of micro-batch 0 from stage 0"
    assert sched.ForwardPass(3, chunk=1).describe(0, 2) == "stage 0 in the forward pass of micro-batch 3 (chunk 1)"
    # the micro batch, not the buffer it shares with others
    assert sched.RecvGrad(buffer_id=1, micro_batch=7).describe(0, 2) == ("stage 0 waiting to receive gradients of "
                                                                         "micro-batch 7 from stage 1")
    assert sched.OptimizerStep().describe(1, 2) == ("stage 1 in the optimizer step (first waiting until its sends "
                                                    "were received)")


def test_deepspeeds_keyword_construction_and_queries() -> None:
    load = sched.LoadMicroBatch(buffer_id=0)
    assert isinstance(load, sched.BufferOpInstruction) and load.buffer_id == load.micro_batch == 0
    schedule = sched.TrainSchedule(micro_batches=4, stages=3, stage_id=2)
    assert (schedule.stage, schedule.num_stages, schedule.num_micro_batches) == (2, 3, 4)
    assert schedule.is_last_stage and not schedule.is_first_stage
    assert list(schedule) == list(schedule)  # iterable again, as DeepSpeed's
    with pytest.raises(ValueError, match="one chunk per stage"):
        sched.TrainSchedule(4, 2, 0, chunks=2)
