"""The training loop the monitor tests share: each rank its slice of the same global batches."""

from __future__ import annotations

from typing import Any


def train(engine: Any, micro_steps: int, rank: int, world: int, seed: int = 1) -> list[dict]:
    """``micro_steps`` forward/backward/step calls of 2 samples per rank; what the engine said after each."""
    from tests.runtime.models import batches

    seen = []
    for tokens, labels in batches(micro_steps, 2 * world, seed=seed):
        mine = slice(2 * rank, 2 * rank + 2)
        loss = engine(tokens[mine], labels[mine])
        engine.backward(loss)
        engine.step()
        seen.append({"samples": engine.global_samples, "loss": loss.item(), "lr": engine.get_lr()[0],
                     "scale": engine.loss_scale()})
    return seen
