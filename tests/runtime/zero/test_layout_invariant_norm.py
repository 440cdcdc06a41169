"""``layout_invariant``: ZeRO-1/2's global gradient norm at 1, 2 and 4 data ranks.

The same gradient (rank 0's sample; the other ranks' zero samples add exact zeros to the
``"sum"`` reduction) is cut by each world's partition into other pieces. Under the mode the
pieces are normed in float64, so the norm and the clipped SGD step come out the same fp32 bits at
every world.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed import run_world

WORLDS = (1, 2, 4)


def _model() -> torch.nn.Module:
    """Odd widths: the partitions of 2 and 4 ranks cut the weights at different places."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(37, 61, bias=False), torch.nn.Tanh(),
                               torch.nn.Linear(61, 29, bias=False), torch.nn.Tanh(),
                               torch.nn.Linear(29, 7, bias=False))


def _clipped_steps(rank: int, world: int, invariant: bool) -> dict[int, tuple[float, list[list]]]:
    """Each stage's norm and weights after one clipped step (both stages in one job: suite time)."""
    return {stage: _clipped_step(rank, stage, invariant) for stage in (1, 2)}


def _clipped_step(rank: int, stage: int, invariant: bool) -> tuple[float, list[list]]:
    import dslaunch

    config = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
              "gradient_clipping": 0.01, "gradient_allreduce_op": "sum", "zero_optimization": {"stage": stage},
              "layout_invariant": {"enabled": invariant}}
    engine = dslaunch.initialize(model=_model(), config=config)[0]
    g = torch.Generator().manual_seed(5)
    x, y = torch.randn(1, 37, generator=g), torch.randn(1, 7, generator=g)
    if rank:  # no gradient at all: the reduction adds zeros, exactly
        x, y = torch.zeros_like(x), torch.zeros_like(y)
    engine.backward(((engine(x) - y) ** 2).sum())
    engine.step()
    return engine.get_global_grad_norm(), [p.detach().tolist() for p in engine.module.parameters()]  # exact


@pytest.mark.timeout(180)
def test_the_norm_and_the_clipped_step_are_the_same_bits_at_every_world() -> None:
    # measured with the mode off: the 4-rank norm is 18.2889595, the others 18.2889576
    jobs = {world: run_world(_clipped_steps, world, True)[0] for world in WORLDS}
    for stage in (1, 2):
        got = {world: job[stage] for world, job in jobs.items()}
        norms = {world: torch.tensor(norm, dtype=torch.float32) for world, (norm, _) in got.items()}
        assert all(torch.equal(norms[1], n) for n in norms.values()), (stage, {w: n.item() for w, n in norms.items()})
        for world in WORLDS[1:]:
            assert got[1][1] == got[world][1], (stage, world)
