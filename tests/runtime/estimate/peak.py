"""The peak bytes of the tensors an engine holds across training steps: what the estimator is
checked against (the tests here, ``scripts/bench/estimate_bench.py``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def engine_peak(model: Any, config: dict, batch: Callable[[Any], Any], steps: int = 2) -> int:
    """Build an engine over ``model`` with ``config``, train ``steps`` steps on ``batch(dtype)``
    (loss: the mean square of the output) and return the most bytes it held: sampled before each
    Linear's forward, at each Linear weight's gradient and after each step.

    collective: call on all ranks.
    """
    import torch

    import dslaunch
    from tests.runtime.zero.held import held_bytes

    engine, *_ = dslaunch.initialize(model=model, config=config)
    samples: list[int] = []

    def sample(*_: object) -> None:
        samples.append(held_bytes(engine))
    for m in model.modules():
        if isinstance(m, torch.nn.Linear):
            m.register_forward_pre_hook(sample)
            m.weight.register_hook(sample)
    dtype = next(p.dtype for p in model.parameters())
    for _ in range(steps):
        engine.backward(engine(batch(dtype)).float().square().mean())
        engine.step()
        sample()
    engine.destroy()
    return max(samples)
