"""The global gradient norm counts every distinct parameter once over the tensor slices: a shard
marked ``tensor_model_parallel`` on every slice (the shards sum to the whole), a parameter each
slice holds whole only on tensor rank 0 (as DeepSpeed's ZeRO norm does). The tied pipeline case is
``tests/runtime/pipe/test_tied.py``."""

from __future__ import annotations

import pytest
import torch

from tests.distributed import run_world

pytestmark = pytest.mark.timeout(90)


class _Slice(torch.nn.Module):
    """Rank r's slice of a column-parallel weight, and a scale every slice holds whole."""

    def __init__(self, rank: int):
        super().__init__()
        torch.manual_seed(100 + rank)
        self.shard = torch.nn.Parameter(torch.randn(3, 4))
        self.shard.tensor_model_parallel = True
        torch.manual_seed(7)
        self.scale = torch.nn.Parameter(torch.randn(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x @ self.shard.T).square().mean() + (x * self.scale).sum().square()


def _x() -> torch.Tensor:
    return torch.arange(8.0).reshape(2, 4) / 8


def _norm(rank: int, world: int, zero_stage: int) -> float:
    import dslaunch
    from dslaunch.runtime.pipe.topology import PipelineParallelGrid, PipeModelDataParallelTopology

    dslaunch.init_distributed(verbose=False)
    grid = PipelineParallelGrid(PipeModelDataParallelTopology(num_pp=1, num_mp=2, num_dp=1))
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 1e-3, "zero_optimization": {"stage": zero_stage},
           "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    engine, *_ = dslaunch.initialize(model=_Slice(rank), mpu=grid, config=cfg)
    engine.backward(engine(_x()))
    engine.step()
    return engine.get_global_grad_norm()


@pytest.mark.parametrize("zero_stage", [0, 1])
def test_a_whole_parameter_counts_once_over_the_tensor_slices(zero_stage: int) -> None:
    squares = 0.0
    for rank in range(2):
        piece = _Slice(rank)
        piece(_x()).backward()
        squares += piece.shard.grad.square().sum().item() + (piece.scale.grad.square().sum().item() if rank == 0 else 0)
    got = run_world(_norm, 2, zero_stage, timeout=80)
    assert got == pytest.approx([squares ** 0.5] * 2, rel=1e-6)
