"""``fp16.auto_cast``: the forward's floating-point positional inputs arrive in fp16 (through
lists, tuples and dicts; integers and keyword arguments as given), as DeepSpeed's engine casts them."""

from __future__ import annotations

import pytest
import torch

from tests.distributed import run_world


class _Seen(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 1)
        self.seen: list = []

    def forward(self, x, ids, nested, scale=None):
        self.seen.append([x.dtype, ids.dtype, [t.dtype for t in nested["pair"]], scale.dtype])
        return self.lin(x.to(self.lin.weight.dtype)).float().square().mean()


def _forward(rank: int, world: int) -> list:
    import dslaunch

    out = []
    for auto_cast in (True, False):
        model = _Seen()
        engine, *_ = dslaunch.initialize(model=model, config={
            "train_batch_size": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
            "fp16": {"enabled": True, "auto_cast": auto_cast}})
        loss = engine(torch.randn(2, 4), torch.arange(2), {"pair": (torch.ones(2), torch.zeros(2, dtype=torch.int8))},
                      scale=torch.ones(1))
        engine.backward(loss)
        engine.step()
        out.append((engine.fp16_auto_cast(), model.seen[0]))
    return out


@pytest.mark.timeout(90)
def test_auto_cast_halves_the_positional_floating_inputs() -> None:
    ((on, seen_on), (off, seen_off)), = run_world(_forward, 1, timeout=80)
    assert on and not off
    assert seen_on == [torch.float16, torch.int64, [torch.float16, torch.int8], torch.float32]
    assert seen_off == [torch.float32, torch.int64, [torch.float32, torch.int8], torch.float32]
