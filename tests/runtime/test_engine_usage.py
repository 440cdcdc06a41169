"""What client code may call around the training loop, and when: DeepSpeed's rules or a clear error.

optimizer.zero_grad() / engine.zero_grad() anywhere. At 2 gloo ranks, where a rank-local mistake
would show.
"""

from __future__ import annotations

import pytest
import torch

from dslaunch.errors import UsageError
from tests.distributed import run_world
from tests.runtime.models import batches, make_model

MICRO, LR = 2, 1e-2


def _cfg(stage: int, gas: int = 2, **extra) -> dict:
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": gas,
            "steps_per_print": 1000, "optimizer": {"type": "AdamW", "params": {"lr": LR}},
            "zero_optimization": {"stage": stage, "reduce_bucket_size": 300,
                                  "allgather_bucket_size": 200, "overlap_comm": True},
            **extra}


def _mine(rank: int, world: int, i: int, step: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Micro batch i of this rank from global batch ``step``."""
    tokens, labels = batches(step + 1, MICRO * world * 2)[step]
    lo = (i * world + rank) * MICRO
    return tokens[lo:lo + MICRO], labels[lo:lo + MICRO]


def _weights(engine) -> list[float]:
    engine.zero.synchronize()
    return torch.cat([p.detach().float().flatten() for p in engine.module.parameters()]).tolist()


def _error(fn) -> str:
    try:
        fn()
    except UsageError as err:
        return str(err)
    return "no error"


# ----- zero_grad anywhere ----------------------------------------------------------------------
def _train(rank: int, world: int, stage: int, client_zero_grad: bool) -> list[list[float]]:
    import dslaunch

    engine, optimizer, _, _ = dslaunch.initialize(model=make_model(), config=_cfg(stage))
    seen = [_weights(engine)]
    for step in range(3):
        for i in range(2):
            if client_zero_grad:
                optimizer.zero_grad()  # torch's default: .grad = None
            engine.backward(engine(*_mine(rank, world, i, step)))
            if client_zero_grad:
                optimizer.zero_grad(set_to_none=False)  # in place, between backward and step
            engine.step()
        if client_zero_grad:  # after the optimizer step, as torch loops do
            engine.zero_grad()
            optimizer.zero_grad()
        seen.append(_weights(engine))
    return seen


def _zero_grad_runs(rank: int, world: int) -> dict[int, tuple]:
    return {stage: (_train(rank, world, stage, False), _train(rank, world, stage, True))
            for stage in (0, 1, 2)}


@pytest.mark.timeout(90)
def test_client_zero_grad_anywhere_trains_identically() -> None:
    """optimizer.zero_grad() (None or in place) before forward and between backward and step, and
    engine.zero_grad() after the boundary step, change nothing at stages 0, 1 and 2."""
    for by_stage in run_world(_zero_grad_runs, 2):
        for stage, (plain, with_calls) in by_stage.items():
            assert with_calls == plain, f"stage {stage}"
            assert all(a != b for a, b in zip(plain, plain[1:], strict=False)), f"stage {stage} trains"
