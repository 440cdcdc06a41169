"""A 3-stage job whose stages pass (float with grad, float with grad, float without grad, int):
two tensors carry gradients back, the others none; trained against the same layers in one process.
The same on DualPipeV's 2 ranks (4 stages), where the last rank hands the tuple to its own second
stage without a message."""

from __future__ import annotations

import pytest
import torch

from tests.distributed import run_world

pytestmark = pytest.mark.timeout(120)

STEPS, GAS, LR = 20, 3, 0.05


class Split(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(6, 8)

    def forward(self, x: torch.Tensor) -> tuple:
        h = torch.tanh(self.lin(x))
        return h, h * 2, x.abs(), (x > 0).long().sum(1)  # the third needs no gradient, the fourth is int


class Mix(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, t: tuple) -> tuple:
        h, g, mask, count = t
        return torch.tanh(self.lin(h)) + g.mean(1, keepdim=True), g * 0.5, mask, count


class Head(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 1)

    def forward(self, t: tuple) -> torch.Tensor:
        h, g, mask, count = t
        return self.lin(h + g) * (1 + count.float().unsqueeze(1) / 8) + mask.mean(1, keepdim=True) * 0.01


def _specs(mixes: int = 1) -> list:
    from dslaunch.pipe import LayerSpec

    return [LayerSpec(Split), *[LayerSpec(Mix) for _ in range(mixes)], LayerSpec(Head)]


def _batches(gas: int = GAS) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(5)
    xs = [torch.randn(2, 6, generator=g) for _ in range(STEPS * gas)]
    return [(x, x.cos().mean(1, keepdim=True) * 0.5) for x in xs]


def _loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(out, y)


def _reference(gas: int = GAS, mixes: int = 1) -> tuple[list[float], list[list]]:
    mods = []
    for idx, spec in enumerate(_specs(mixes)):
        torch.manual_seed(11 + idx)
        mods.append(spec.build())
    model = torch.nn.Sequential(*mods)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    data, losses = _batches(gas), []
    for step in range(STEPS):
        opt.zero_grad()
        loss = torch.stack([_loss(model(x), y) for x, y in data[step * gas:(step + 1) * gas]]).mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, [[p.detach().tolist() for p in m.parameters()] for m in mods]


def _train(rank: int, world: int, gas: int, dualpipev: bool) -> dict:
    import dslaunch
    from dslaunch.pipe import DualPipeVModule, PipelineModule

    dslaunch.init_distributed(verbose=False)
    kind = DualPipeVModule if dualpipev else PipelineModule
    module = kind(_specs(3 if dualpipev else 1), num_stages=world, loss_fn=_loss, seed_layers=True, base_seed=11,
                  partition_method="uniform")
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": gas, "steps_per_print": 1e9,
           "optimizer": {"type": "SGD", "params": {"lr": LR}}, "gradient_clipping": 0.0}  # the reference does not clip
    engine, *_ = dslaunch.initialize(model=module, config=cfg)
    data = iter(_batches(gas))
    losses = [engine.train_batch(data).item() for _ in range(STEPS)]
    return {"losses": losses, "params": {name: p.detach().tolist() for name, p in module.named_parameters()}}


@pytest.mark.parametrize("world, gas, dualpipev", [(3, GAS, False), (2, 4, True)])
def test_stages_pass_tuples_of_mixed_tensors(world: int, gas: int, dualpipev: bool) -> None:
    want_losses, want_params = _reference(gas, 3 if dualpipev else 1)
    got = run_world(_train, world, gas, dualpipev, timeout=100)
    held = set()
    for r in got:
        assert r["losses"] == pytest.approx(want_losses, rel=0, abs=1e-6)
        for name, value in r["params"].items():  # "<layer>.lin.weight"
            layer, which = int(name.split(".")[0]), name.endswith("bias")
            held.add(layer)
            torch.testing.assert_close(torch.tensor(value), torch.tensor(want_params[layer][which]), rtol=0, atol=2e-5)
    assert held == set(range(len(want_params)))
