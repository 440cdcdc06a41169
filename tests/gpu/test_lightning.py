"""Lightning's DeepSpeed strategy on dslaunch's ``deepspeed`` distribution, on one CUDA GPU.

Lightning 2.6 refuses its DeepSpeed strategy on CPU ("only supported on CUDA GPUs") before it
reaches DeepSpeed, for the real DeepSpeed too, so this case runs only where a GPU is lent
(``scripts/gpu/check.sh``, which installs ``compat/deepspeed`` there). Marked ``gpu``.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util

import pytest
import torch

from tests.gpu.marks import NEEDS_CUDA

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.timeout(240),
    NEEDS_CUDA,
    pytest.mark.skipif(importlib.util.find_spec("lightning") is None, reason="lightning is not installed"),
]


def _dslaunch_deepspeed() -> bool:
    try:
        return "dslaunch" in importlib.metadata.version("deepspeed")
    except importlib.metadata.PackageNotFoundError:
        return False


@pytest.mark.parametrize("stage", [2, 3])
def test_lightning_deepspeed_strategy_trains_on_dslaunch(stage: int, tmp_path) -> None:
    if not _dslaunch_deepspeed():
        pytest.skip("the `deepspeed` distribution here is not dslaunch's (pip install --no-deps -e compat/deepspeed)")
    import lightning as L
    from torch.utils.data import DataLoader, TensorDataset

    class Regression(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
            self.losses: list[float] = []

        def training_step(self, batch, _):
            x, y = batch
            loss = torch.nn.functional.mse_loss(self.net(x), y)
            self.losses.append(loss.item())
            return loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    torch.manual_seed(0)
    x = torch.randn(256, 8)
    data = DataLoader(TensorDataset(x, x[:, :1] * 2 - x[:, 1:2]), batch_size=16)
    model = Regression()
    trainer = L.Trainer(accelerator="gpu", devices=1, strategy=f"deepspeed_stage_{stage}", max_steps=12,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        default_root_dir=tmp_path)
    trainer.fit(model, data)
    assert type(trainer.strategy.model).__module__.startswith("dslaunch.")
    assert len(model.losses) == 12 and all(map(torch.isfinite, torch.tensor(model.losses)))
    assert sum(model.losses[-3:]) < sum(model.losses[:3])
