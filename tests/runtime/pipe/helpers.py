"""A small model described as layers, its data, and the same model trained in one process: the
reference every pipeline test compares against."""

from __future__ import annotations

from typing import Any

import pytest
import torch

BASE_SEED, WIDTH, MICRO = 7, 8, 2


def layers(blocks: int = 2) -> list[Any]:
    """Linear layers between activations (``blocks`` in the middle): 5 with parameters by
    default, enough to cut into 2, 3 or 4 stages."""
    from dslaunch.pipe import LayerSpec

    lin, tanh = torch.nn.Linear, torch.nn.Tanh
    middle = [spec for _ in range(blocks) for spec in (LayerSpec(lin, 16, 16), LayerSpec(tanh))]
    return [LayerSpec(lin, WIDTH, 16), LayerSpec(tanh), *middle, LayerSpec(lin, 16, 12), LayerSpec(lin, 12, 1)]


def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(out.float(), y)  # 16-bit outputs: the loss in fp32


def micro_batches(step: int, count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The ``count`` micro batches of optimizer step ``step`` (all replicas' together)."""
    g = torch.Generator().manual_seed(1000 + step)
    out = []
    for _ in range(count):
        x = torch.randn(MICRO, WIDTH, generator=g)
        out.append((x, x.sin().sum(1, keepdim=True)))
    return out


def replica_iter(steps: int, gas: int, dp: int, replica: int) -> Any:
    """What replica ``replica`` reads: its ``gas`` micro batches of every step."""
    for step in range(steps):
        yield from micro_batches(step, gas * dp)[replica * gas:(replica + 1) * gas]


def reference(steps: int, gas: int, dp: int, lr: float, clip: float = 0.0, blocks: int = 2
              ) -> tuple[list[float], list[list]]:
    """Losses per step and final weights per layer of the whole model trained in one process."""
    specs = layers(blocks)
    mods = []
    for idx, spec in enumerate(specs):
        torch.manual_seed(BASE_SEED + idx)
        mods.append(spec.build())
    model = torch.nn.Sequential(*mods)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for step in range(steps):
        batch = micro_batches(step, gas * dp)
        opt.zero_grad()
        per = [loss_fn(model(x), y) for x, y in batch]
        total = torch.stack(per).mean()
        total.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        losses.append(total.item())
    return losses, [[p.detach().tolist() for p in m.parameters()] for m in mods]


def check_against_one_process(got: list[dict], engine: str, steps: int, gas: int, dp: int, lr: float,
                               clip: float = 0.0, blocks: int = 2, weights_atol: float = 2e-5) -> None:
    """Every rank's result (``type``, ``steps``, ``micro``, ``losses``, ``layers``: its layers' weights
    by index) against ``reference``: losses within 1e-6 per step, weights within ``weights_atol``,
    every layer with weights held by some rank."""
    want_losses, want_layers = reference(steps, gas, dp, lr, clip, blocks)
    held = set()
    for r in got:
        assert r["type"] == engine and r["steps"] == steps and r["micro"] == steps * gas
        assert r["losses"] == pytest.approx(want_losses, rel=0, abs=1e-6)
        for idx, params in r["layers"].items():
            held.add(idx)
            for a, b in zip(params, want_layers[idx], strict=True):
                torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=0, atol=weights_atol)
    assert held == {i for i, w in enumerate(want_layers) if w}  # every layer with weights was checked


def config(gas: int, lr: float, **extra: Any) -> dict:
    # No clipping unless asked (DeepSpeed's default clips at 1.0): the one-process reference does not.
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": gas, "steps_per_print": 1e9,
            "optimizer": {"type": "SGD", "params": {"lr": lr}}, "gradient_clipping": 0.0, **extra}


def error_lines(calls: list, error: type) -> list[str]:
    """The message of each call that raised ``error``; then a barrier, so that no rank leaves while
    another still connects the process groups a call built (collective: every rank)."""
    out = []
    for call in calls:
        try:
            call()
        except error as err:
            out.append(str(err))
    torch.distributed.barrier()
    return out
