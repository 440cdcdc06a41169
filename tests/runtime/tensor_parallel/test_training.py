"""AutoTP training (``"tensor_parallel": {"autotp_size": N}``) on 4 gloo ranks, fp32.

The tiny GQA language model (``models.py``) is trained 20 steps with Adam and gradient clipping
at tp 2 x dp 2 and at tp 4 (ZeRO-1 and ZeRO-2), every run on the same global batch per step.
Each step's loss (averaged over the data-parallel ranks) must equal the single-process run's
within 1e-6, and rank 0 must hold at most 1/tp + 10% of the parameter and optimizer-state bytes.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed import run_world
from tests.runtime.tensor_parallel.models import TinyConfig, TinyLM

pytestmark = pytest.mark.timeout(240)

STEPS, GLOBAL_BATCH, SEQ = 20, 8, 12


def _config(tp: int, stage: int, dp: int) -> dict:
    return {"train_batch_size": GLOBAL_BATCH, "train_micro_batch_size_per_gpu": GLOBAL_BATCH // dp,
            "optimizer": {"type": "Adam", "params": {"lr": 3e-3}}, "gradient_clipping": 0.5,
            "zero_optimization": {"stage": stage}, "tensor_parallel": {"autotp_size": tp},
            "steps_per_print": 1000}


def _batch(step: int, cfg: TinyConfig) -> torch.Tensor:
    """Sequences that follow one rule (next = 5 * token + 3 mod vocab) from random starts: learnable."""
    g = torch.Generator().manual_seed(1000 + step)
    ids = [torch.randint(0, cfg.vocab_size, (GLOBAL_BATCH,), generator=g)]
    for _ in range(SEQ - 1):
        ids.append((5 * ids[-1] + 3) % cfg.vocab_size)
    return torch.stack(ids, dim=1)


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _train(rank: int, world: int, tp: int, stage: int, tied: bool) -> dict:
    import torch.distributed as dist

    import dslaunch

    cfg = TinyConfig(tie_word_embeddings=tied)
    torch.manual_seed(0)
    model = TinyLM(cfg)
    whole = _nbytes({id(p): p for p in model.parameters()}.values())
    dp = world // tp
    engine, optimizer, *_ = dslaunch.initialize(model=model, config=_config(tp, stage, dp))
    data_rank, micro = engine.grid.get_data_parallel_rank(), GLOBAL_BATCH // dp
    losses = []
    for step in range(STEPS):
        ids = _batch(step, cfg)[data_rank * micro:(data_rank + 1) * micro]
        loss = engine(input_ids=ids, labels=ids)
        engine.backward(loss)
        engine.step()
        mean = loss.detach().clone()
        if dist.is_initialized():
            dist.all_reduce(mean)
            mean /= world  # every slice of a replica holds its replica's loss
        losses.append(mean.item())
    state = [t for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t) and t.dim() > 0]
    return {"losses": losses, "params": _nbytes({id(p): p for p in engine.module.parameters()}.values()),
            "whole": whole, "state": _nbytes(state)}


@pytest.fixture(scope="module")
def reference() -> dict:
    return {tied: run_world(_train, 1, 1, 1, tied)[0] for tied in (False, True)}


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("stage", [1, 2])
def test_losses_equal_the_unsharded_run(reference: dict, tp: int, stage: int) -> None:
    ref = reference[False]
    got = run_world(_train, 4, tp, stage, False, timeout=200)
    worst = max(abs(a - b) for a, b in zip(got[0]["losses"], ref["losses"], strict=True))
    assert worst <= 1e-6, (worst, got[0]["losses"][:3], ref["losses"][:3])
    assert ref["losses"][-1] < ref["losses"][0] - 0.05  # it trains
    dp = 4 // tp
    bound = 1 / tp + 0.1
    assert got[0]["params"] <= bound * ref["params"], (got[0]["params"], ref["params"])
    # ZeRO splits the optimizer state over the dp data ranks: rank 0 holds its 1/dp of its slice's
    assert got[0]["state"] * dp <= bound * ref["state"], (got[0]["state"], ref["state"])
