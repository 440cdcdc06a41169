"""``nn.Embedding(sparse=True)`` trains at every ZeRO stage as its dense twin in one process.

DeepSpeed 0.19.8 reduces such gradients sparsely at stage 0 and needs no config key for it
(``sparse_gradients`` was removed); dslaunch scatters them into its dense gradient storage, so
every stage and every element-wise optimizer takes them. A crash in the gradient hook before.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed import one_rank, run_world

ROWS, WIDTH, MICRO, ACCUM, STEPS = 40, 4, 3, 2, 3


def _model(sparse: bool) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Embedding(ROWS, WIDTH, sparse=sparse), torch.nn.Flatten(),
                               torch.nn.Linear(2 * WIDTH, 1))


def _batch(step: int, micro: int, rank: int) -> torch.Tensor:
    # each rank's own rows, some shared: the reduction sums sparse rows that overlap and ones that do not
    g = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
    return torch.randint(0, ROWS // 2, (MICRO, 2), generator=g) + rank * (ROWS // 4)


def _train(rank: int, world: int, stage: int) -> dict[str, torch.Tensor]:
    import dslaunch

    model = _model(sparse=True)
    engine, *_ = dslaunch.initialize(model=model, config={
        "train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": ACCUM,
        "steps_per_print": 10_000, "gradient_clipping": 0.0, "zero_optimization": {"stage": stage},
        "optimizer": {"type": "SGD", "params": {"lr": 0.5, "momentum": 0.9}}})
    for step in range(STEPS):
        for micro in range(ACCUM):
            engine.backward(engine(_batch(step, micro, rank)).pow(2).mean())
            engine.step()
    from dslaunch.utils import safe_get_full_fp32_param

    return {n: safe_get_full_fp32_param(p).clone() for n, p in model.named_parameters()}


def _reference(world: int) -> dict[str, torch.Tensor]:
    """A dense embedding, one process: each step the mean gradient of every rank's micro batches."""
    model = _model(sparse=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    for step in range(STEPS):
        for micro in range(ACCUM):
            for rank in range(world):
                (model(_batch(step, micro, rank)).pow(2).mean() / (ACCUM * world)).backward()
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.timeout(90)
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_a_sparse_embedding_trains_as_its_dense_twin(stage: int) -> None:
    got = run_world(_train, 2, stage)
    want = _reference(2)
    for rank_state in got:
        for name, tensor in want.items():
            torch.testing.assert_close(rank_state[name], tensor, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.timeout(30)
@one_rank
def test_sparse_adam_is_refused_in_one_line() -> None:
    import dslaunch
    from dslaunch.errors import NotInDslaunchError

    model = _model(sparse=True)
    with pytest.raises(NotInDslaunchError, match=r"SparseAdam steps only on sparse gradients.*use torch\.optim\.Adam"):
        dslaunch.initialize(model=model, optimizer=torch.optim.SparseAdam(model[0].parameters()),
                            config={"train_micro_batch_size_per_gpu": 1, "zero_allow_untested_optimizer": True})
