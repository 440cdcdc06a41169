"""Engine calls that accelerate and transformers make, as DeepSpeed answers them: the caller's own
accumulation boundary, an engine without an optimizer, ``compile``, ``engine.config``."""

from __future__ import annotations

import pytest
import torch

from dslaunch.errors import UsageError
from tests.distributed import run_world
from tests.runtime.models import batches, make_model

MICRO = 2


def _cfg(gas: int, stage: int = 2) -> dict:
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": gas,
            "steps_per_print": float("inf"), "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
            "zero_optimization": {"stage": stage, "reduce_bucket_size": 300, "overlap_comm": True}}


def _micro(rank: int, world: int, i: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens, labels = batches(1, MICRO * world * 8)[0]
    lo = (i * world + rank) * MICRO
    return tokens[lo:lo + MICRO], labels[lo:lo + MICRO]


def _weights(engine) -> list[float]:
    engine.zero.synchronize()
    return torch.cat([p.detach().flatten() for p in engine.module.parameters()]).tolist()


def _boundaries(rank: int, world: int) -> tuple[list, list, int, int]:
    import dslaunch

    counted, _, _, _ = dslaunch.initialize(model=make_model(), config=_cfg(3))
    caller, _, _, _ = dslaunch.initialize(model=make_model(), config=_cfg(3))
    for i in range(6):  # the engine's own count: a step every 3 micro steps
        counted.backward(counted(*_micro(rank, world, i)))
        counted.step()
    for i in range(6):  # accelerate's way: the caller marks the boundary and steps only there
        caller.set_gradient_accumulation_boundary(i % 3 == 2)
        caller.backward(caller(*_micro(rank, world, i)))
        if caller.is_gradient_accumulation_boundary():
            caller.step()
    return _weights(counted), _weights(caller), counted.global_steps, caller.global_steps


@pytest.mark.timeout(90)
def test_caller_set_boundaries_train_like_the_engines_count() -> None:
    for counted, caller, steps_a, steps_b in run_world(_boundaries, 2):
        assert steps_a == steps_b == 2
        assert caller == pytest.approx(counted, abs=1e-6)


def _no_optimizer(rank: int, world: int) -> dict:
    import dslaunch

    model = make_model()
    for p in model.block.parameters():
        p.requires_grad_(False)  # a reference model may be partly or wholly frozen
    expected = model(*_micro(rank, world, 0)).item()
    config = {"train_micro_batch_size_per_gpu": MICRO, "zero_optimization": {"stage": 2}}
    engine, optimizer, _, scheduler = dslaunch.initialize(model=model, config=config)
    with torch.no_grad():
        got = engine(*_micro(rank, world, 0)).item()
    loss = engine(*_micro(rank, world, 0))
    errors = []
    for call in (lambda: engine.backward(loss), engine.step):
        try:
            call()
        except UsageError as err:
            errors.append(str(err))
    return {"same": got == expected, "optimizer": optimizer, "scheduler": scheduler, "errors": errors,
            "config": engine.config, "stage": engine.zero_optimization_stage()}


@pytest.mark.timeout(90)
def test_engine_without_optimizer_runs_forward_only() -> None:
    for r in run_world(_no_optimizer, 2):
        assert r["same"] and r["optimizer"] is None and r["scheduler"] is None and r["stage"] == 2
        assert [e.split(":")[0] for e in r["errors"]] == ["engine.backward()", "engine.step()"]
        assert all("built without an optimizer" in e for e in r["errors"])
        assert r["config"] == {"train_micro_batch_size_per_gpu": MICRO, "zero_optimization": {"stage": 2}}


def _compiled(rank: int, world: int) -> tuple[list, list, bool]:
    import dslaunch

    runs = []
    for compile_it in (False, True):
        engine, _, _, _ = dslaunch.initialize(model=make_model(), config=_cfg(1))
        if compile_it:
            engine.compile(backend="eager", compile_kwargs={"backend": "ignored", "dynamic": False})
            engine.compile()  # a second call does nothing, as DeepSpeed's
        for i in range(2):
            engine.backward(engine(*_micro(rank, world, i)))
            engine.step()
        runs.append(_weights(engine))
    return runs[0], runs[1], engine.is_compiled


@pytest.mark.timeout(120)
def test_compile_trains_as_eager() -> None:
    for eager, compiled, is_compiled in run_world(_compiled, 2):
        assert is_compiled and compiled == pytest.approx(eager, abs=1e-6)


def _ramp(rank: int, world: int) -> dict:
    import dslaunch
    from dslaunch.errors import BatchSizeError

    engine, _, _, _ = dslaunch.initialize(model=make_model(), config=_cfg(2))
    boundaries = []

    def micro(i: int) -> None:
        boundaries.append(engine.is_gradient_accumulation_boundary())
        engine.backward(engine(*_micro(rank, world, i % 8)))
        engine.step()

    for i in range(4):  # 2 steps of 2 micro steps
        micro(i)
    # Megatron-DeepSpeed's ramp-up: 2 -> 3 accumulation steps; windows count from here, not from 0
    engine.set_train_batch_size(MICRO * world * 3)
    with pytest.raises(BatchSizeError, match="not divisible by train_micro_batch_size_per_gpu"):
        engine.set_train_batch_size(MICRO * world * 3 + 1)  # a ValueError, as DeepSpeed's
    for i in range(6):
        micro(i)
    engine.set_train_micro_batch_size(1)
    return {"boundaries": boundaries, "steps": engine.global_steps, "samples": engine.global_samples,
            "sizes": (engine.train_batch_size(), engine.train_micro_batch_size_per_gpu(),
                      engine.gradient_accumulation_steps())}


@pytest.mark.timeout(90)
def test_set_train_batch_size_changes_the_accumulation_window_from_the_next_step() -> None:
    for out in run_world(_ramp, 2):
        assert out["boundaries"] == [False, True, False, True, False, False, True, False, False, True]
        assert (out["steps"], out["samples"]) == (4, 2 * 8 + 2 * 12)
        assert out["sizes"] == (1 * 2 * 3, 1, 3)  # the micro batch changed, the accumulation steps stayed


class _WithMethods(torch.nn.Module):
    """A model with its own methods and attributes, as scripts call them on the engine."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)
        self.tag = "mine"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x).sum()

    def magic(self, x: int) -> int:
        return x + 41


def _pass_through(rank: int, world: int, stage: int) -> tuple[int, str, bool, str, bool]:
    import dslaunch

    model = _WithMethods()
    engine, *_ = dslaunch.initialize(model=model, config=_cfg(1, stage))
    try:
        message = f"found {engine.not_there!r}"
    except AttributeError as e:
        message = str(e)
    # the engine's own names win over the model's (both have ``forward``, ``parameters``)
    own = engine.forward.__self__ is engine and engine.optimizer is not None
    return engine.magic(1), engine.tag, engine.proj is model.proj, message, own


@pytest.mark.timeout(60)
@pytest.mark.parametrize("stage", [0, 3])
def test_engine_answers_the_models_attributes(stage: int) -> None:
    """``engine.magic()`` calls the model's method (DeepSpeed's engine passes unknown names on)."""
    for answer, tag, same, message, own in run_world(_pass_through, 2, stage):
        assert (answer, tag, same, own) == (42, "mine", True, True)
        assert "'DeepSpeedEngine' object has no attribute 'not_there'" in message
