"""The engine's event seam: which observers ``Events`` calls, the order of the phases a training
loop sends, and the step records (checked against the engine's own counters), on a real engine."""

from __future__ import annotations

import pytest

from dslaunch.runtime.events import Events, Observer, StepRecord
from tests.distributed import run_world

pytestmark = pytest.mark.timeout(60)


class _Log(Observer):
    def __init__(self, log: list) -> None:
        self.log = log

    def phase_begin(self, name: str) -> None:
        self.log.append(("begin", name))

    def phase_end(self, name: str) -> None:
        self.log.append(("end", name))

    def on_step(self, record: StepRecord) -> None:
        self.log.append(("step", record))


class _StepsOnly(Observer):
    def __init__(self) -> None:
        self.records: list[StepRecord] = []

    def on_step(self, record: StepRecord) -> None:
        self.records.append(record)


def test_only_observers_that_watch_something_are_called_and_phases_nest() -> None:
    log: list = []
    events = Events([Observer(), _Log(log), _StepsOnly()])
    built = []

    def record() -> StepRecord:
        built.append(1)
        return StepRecord(1, 4, 0, None, (0.1,), 1.0, None, False, 0)

    with events.phase("forward"):
        log.append("body")
    events.step(record)
    assert log[:3] == [("begin", "forward"), "body", ("end", "forward")] and log[3][0] == "step"
    assert built == [1]
    quiet = Events([Observer(), _StepsOnly()])
    assert quiet.phase("forward") is quiet.phase("backward")  # one shared no-op: no observer watches phases
    nobody = Events([Observer()])
    nobody.step(record)
    assert built == [1]  # no step observer: no record is built


def test_a_phase_that_raises_still_ends() -> None:
    log: list = []
    events = Events([_Log(log)])
    with pytest.raises(ZeroDivisionError), events.phase("step"):
        raise ZeroDivisionError
    assert log == [("begin", "step"), ("end", "step")]


def _observed(rank: int, world: int, fp16: bool) -> dict:
    import dslaunch
    from tests.runtime.models import batches, make_model

    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "steps_per_print": 1000,
           "gradient_clipping": 1.0, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
           "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": 1e-2, "warmup_num_steps": 4}},
           "zero_optimization": {"stage": 2}, **({"fp16": {"enabled": True, "initial_scale_power": 4}} if fp16 else {})}
    engine, *_ = dslaunch.initialize(model=make_model(), config=cfg)
    log: list = []
    engine.events.add(_Log(log))
    seen = []
    for i, (tokens, labels) in enumerate(batches(4, 2 * world)):
        mine = slice(2 * rank, 2 * rank + 2)
        loss = engine(tokens[mine], labels[mine])
        if fp16 and i == 1:
            loss = loss * float("inf")  # the first optimizer step overflows
        engine.backward(loss)
        engine.step()
        if engine.is_gradient_accumulation_boundary() is False and log and log[-1][0] == "step":
            r = log[-1][1]
            seen.append({"step": r.step, "samples": r.samples, "lr": r.lr, "scale": r.loss_scale,
                         "norm": r.grad_norm, "skipped": r.skipped, "skipped_steps": r.skipped_steps,
                         "loss": r.loss_value(), "engine": (engine.global_steps, engine.global_samples,
                                                            tuple(engine.get_lr()), engine.loss_scale(),
                                                            engine.get_global_grad_norm(), engine.skipped_steps,
                                                            loss.item())})
    phases = [(kind, name) for kind, name in log if kind != "step"]
    return {"phases": phases, "steps": seen, "n_steps": sum(1 for kind, _ in log if kind == "step")}


def _same(a: float | None, b: float | None) -> bool:
    return a == b or (a is not None and b is not None and a != a and b != b)


@pytest.mark.parametrize("fp16", [False, True])
def test_the_engine_sends_each_phase_and_one_record_per_optimizer_step(fp16: bool) -> None:
    for got in run_world(_observed, 2, fp16):
        micro = [("begin", "forward"), ("end", "forward"), ("begin", "backward"), ("end", "backward"),
                 ("begin", "allreduce"), ("end", "allreduce")]
        assert got["phases"] == (micro * 2 + [("begin", "step"), ("end", "step")]) * 2
        assert got["n_steps"] == 2 and len(got["steps"]) == 2
        for k, s in enumerate(got["steps"], start=1):
            steps, samples, lr, scale, norm, skipped_steps, loss = s["engine"]
            assert (s["step"], s["samples"], s["lr"], s["scale"], s["skipped_steps"]) == (
                steps, samples, lr, scale, skipped_steps)
            assert s["step"] == k and s["samples"] == 8 * k
            assert _same(s["norm"], norm) and _same(s["loss"], loss)  # nan after the overflow
        assert [s["skipped"] for s in got["steps"]] == ([True, False] if fp16 else [False, False])
