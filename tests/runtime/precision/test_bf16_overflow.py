"""``bf16.check_grad_overflow`` (DeepSpeed's switch, default true) and ``gradient_clipping``: which
steps with inf/NaN gradients are skipped, and which are applied (and what that does to the weights)."""

from __future__ import annotations

import pytest
import torch

from tests.distributed import run_world


def _steps(rank: int, world: int, check: bool, clip: float) -> tuple[int, bool]:
    import dslaunch
    from dslaunch.utils import safe_set_full_grad

    torch.manual_seed(0)
    engine, *_ = dslaunch.initialize(model=torch.nn.Linear(4, 4), config={
        "train_micro_batch_size_per_gpu": 1, "steps_per_print": 1000, "gradient_clipping": clip,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
        "bf16": {"enabled": True, "check_grad_overflow": check}, "zero_optimization": {"stage": 1}})
    for value in (float("inf"), float("nan")):
        engine.backward(engine(torch.ones(1, 4, dtype=torch.bfloat16)).float().sum())
        for p in engine.module.parameters():
            safe_set_full_grad(p, torch.full_like(p, value, dtype=torch.float32))
        engine.step()
    finite = all(bool(p.float().isfinite().all()) for p in engine.module.parameters())
    engine.destroy()
    return engine.skipped_steps, finite


@pytest.mark.timeout(120)
@pytest.mark.parametrize("check, clip, want", [
    (True, 0.0, (2, True)),  # DeepSpeed's default: skipped
    (False, 0.0, (0, False)),  # off, no clipping: applied, as asked (the weights become inf/NaN)
    (False, 1.0, (2, True)),  # off, but clipping cannot scale by a non-finite norm: skipped (DeepSpeed applies it)
])
def test_non_finite_gradients_under_bf16(check: bool, clip: float, want: tuple[int, bool]) -> None:
    assert run_world(_steps, 1, check, clip) == [want]
