"""DeepSpeed's several-engines pattern: two engines in a chain (``head(encoder(x))``), one loss,
``loss.backward()`` by the script, then ``step()`` on each (with or without the older explicit
``_backward_epilogue()`` first: the backward already completed it). Checked at every ZeRO stage on
2 gloo ranks, with gradient accumulation (the engines must know which micro step reduces without
having run the backward; the accumulation steps divide the gradient once, where the head's output
takes it), against the same two modules trained in one process on the whole batch."""

from __future__ import annotations

import pytest
import torch

from tests.distributed import run_world

pytestmark = pytest.mark.timeout(90)

LR, STEPS, MICRO, GAS = 0.05, 3, 2, 2


def _modules() -> tuple[torch.nn.Module, torch.nn.Module]:
    torch.manual_seed(3)
    encoder = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh())
    head = torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    return encoder, head


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2 * MICRO * GAS * STEPS, 6, generator=g)
    return x, x[:, :1] * 2 - x[:, 1:2]


def _reference() -> list[list[float]]:
    encoder, head = _modules()
    params = [*encoder.parameters(), *head.parameters()]
    opt = torch.optim.SGD(params, lr=LR, momentum=0.9)
    x, y = _data()
    for k in range(STEPS):
        rows = slice(2 * MICRO * GAS * k, 2 * MICRO * GAS * (k + 1))
        opt.zero_grad()
        torch.nn.functional.mse_loss(head(encoder(x[rows])), y[rows]).backward()
        opt.step()
    return [p.detach().flatten().tolist() for p in params]


def _two_engines(rank: int, world: int, stage: int, explicit: bool) -> list[list[float]]:
    import dslaunch

    # No clipping: each engine would clip its own part of the gradient (the reference clips none).
    cfg = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GAS, "optimizer": {"type": "SGD", "params": {"lr": LR, "momentum": 0.9}},
           "zero_optimization": {"stage": stage}, "gradient_clipping": 0.0}
    encoder, head = _modules()
    enc, *_ = dslaunch.initialize(model=encoder, config=cfg)
    hd, *_ = dslaunch.initialize(model=head, config=cfg)
    x, y = _data()
    for micro in range(STEPS * GAS):  # divided by the accumulation steps by the head's output hook
        rows = slice(2 * MICRO * micro + MICRO * rank, 2 * MICRO * micro + MICRO * (rank + 1))
        loss = torch.nn.functional.mse_loss(hd(enc(x[rows])), y[rows])
        loss.backward()
        for engine in (enc, hd):
            if explicit:
                engine._backward_epilogue()
            engine.step()
    return [p.detach().flatten().tolist() for e in (enc, hd) for p in e.module.parameters()]


@pytest.mark.parametrize("explicit", [True, False], ids=["explicit-epilogue", "plain"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_two_engines_under_one_loss_train_as_one_model(stage: int, explicit: bool) -> None:
    want = _reference()
    for got in run_world(_two_engines, 2, stage, explicit):
        assert len(got) == len(want)
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=0, atol=1e-6)
