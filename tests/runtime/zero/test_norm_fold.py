"""The gradient norm folded into the gradients' last write (one rank: ZeRO-2/3 write each gradient
straight into the shard) and the offloaded step's first bucket read ahead at the end of backward.

Each configuration trains twice in one process: as it is, and with the fold refused
(``folded_sumsq`` returning None, so the step's pass takes the norm over the shard): losses,
global norms and final weights must be the same bits, with clipping active and without, and the
same across the three configurations (ZeRO-0's equality with ZeRO-3 on one rank, whose norm is a
pass over its gradient: ``test_stage3_resident.py``). The offloaded step's phases say no pass read the
gradients (``norm_bytes`` 0) where the fold ran, and the shard's size where it did not.
"""

from __future__ import annotations

import pytest

from tests.distributed import run_world

STEPS = 3
ZEROS = {
    "zero2+offload": {"stage": 2, "offload_optimizer": {"device": "cpu"}, "sub_group_size": 300},
    "zero3": {"stage": 3, "stage3_param_persistence_threshold": 0},
    "zero3+offload": {"stage": 3, "stage3_param_persistence_threshold": 0, "offload_optimizer": {"device": "cpu"}},
}


def _run(zero: dict, clip: float, fold: bool) -> dict:
    import torch

    import dslaunch
    from dslaunch.runtime.zero.sharded_gradients import ShardedGradients

    folded_sumsq = ShardedGradients.folded_sumsq
    if not fold:
        ShardedGradients.folded_sumsq = lambda self, gi: None
    try:
        class Net(torch.nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.a, self.b = torch.nn.Linear(16, 32), torch.nn.Linear(32, 8)
                self.unused = torch.nn.Linear(8, 8)  # gets no gradient: zeros, folded too

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                return self.b(torch.tanh(self.a(x)))

        torch.manual_seed(0)
        model = Net()
        cfg = {"train_batch_size": 4, "gradient_accumulation_steps": 2, "gradient_clipping": clip,
               "steps_per_print": 100, "bf16": {"enabled": True}, "zero_optimization": zero,
               "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}}}
        engine, *_ = dslaunch.initialize(model=model, config=cfg)
        g = torch.Generator().manual_seed(1)
        out: dict = {"losses": [], "norms": [], "norm_bytes": [], "prefetched": []}
        offload = engine.zero.offload
        for i in range(2 * STEPS):
            x, y = torch.randn(2, 16, generator=g), torch.randn(2, 8, generator=g)
            loss = torch.nn.functional.mse_loss(engine(x.bfloat16()).float(), y)
            engine.backward(loss)
            boundary = offload is not None and i % 2 == 1
            if boundary:
                out["prefetched"].append(offload.prefetched)
            engine.step()
            out["losses"].append(loss.item())
            if boundary:
                out["norm_bytes"].append(offload.phases.norm_bytes)
                out["prefetched"].append(offload.prefetched)  # consumed by the step
            if i % 2 == 1:
                out["norms"].append(engine.get_global_grad_norm())
        out["weights"] = [p.detach().float().tolist() for p in model.parameters()]
        return out
    finally:
        ShardedGradients.folded_sumsq = folded_sumsq


def _all(rank: int, world: int) -> dict:
    return {(name, clip, fold): _run(zero, clip, fold) for name, zero in ZEROS.items() for clip in (0.05, 0.0)
            for fold in (True, False)}


@pytest.mark.timeout(90)
def test_folded_norm_trains_bit_for_bit_as_the_pass() -> None:
    (runs,) = run_world(_all, 1)
    for clip in (0.05, 0.0):
        first = runs["zero3", clip, False]
        assert min(first["norms"]) > 0.05  # the clip is active
        for name in ZEROS:
            folded, passed = runs[name, clip, True], runs[name, clip, False]
            for key in ("losses", "norms", "weights"):
                assert folded[key] == passed[key] == first[key], (name, clip, key)
        for name in ("zero2+offload", "zero3+offload"):
            folded, passed = runs[name, clip, True], runs[name, clip, False]
            assert folded["norm_bytes"] == [0] * STEPS  # no pass read the gradients
            assert passed["norm_bytes"] == [(16 * 32 + 32 + 32 * 8 + 8 + 8 * 8 + 8) * 4] * STEPS
            assert folded["prefetched"] == [True, False] * STEPS
    assert runs["zero3", 0.05, True]["weights"] != runs["zero3", 0.0, True]["weights"]


def _two_ranks(rank: int, world: int) -> dict:
    zero = {"stage": 2, "offload_optimizer": {"device": "cpu"}, "reduce_bucket_size": 600}  # several buckets
    return {(clip, fold): _run(zero, clip, fold) for clip in (0.05, 0.0) for fold in (True, False)}


@pytest.mark.timeout(90)
def test_two_ranks_fold_each_reduced_bucket_bit_for_bit() -> None:
    """ZeRO-2 at two ranks: the norm's sums taken as each reduced bucket is added into the shard."""
    for runs in run_world(_two_ranks, 2):
        for clip in (0.05, 0.0):
            folded, passed = runs[clip, True], runs[clip, False]
            for key in ("losses", "norms", "weights"):
                assert folded[key] == passed[key], (clip, key)
            assert folded["norm_bytes"] == [0] * STEPS and min(passed["norm_bytes"]) > 0


def _shard_access_drops_the_fold(rank: int, world: int) -> tuple[bool, bool, bool]:
    import torch

    import dslaunch

    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    cfg = {"train_batch_size": 2, "steps_per_print": 100, "gradient_clipping": 1.0,
           "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}}
    engine, *_ = dslaunch.initialize(model=model, config=cfg)
    engine.backward(model(torch.ones(2, 8)).sum())
    before = engine.zero.gradients.folded_sumsq(0) is not None and engine.zero.offload.prefetched
    engine.zero.grad_shard(0).mul_(2.0)  # safe_set_full_grad's way in: the folded sums no longer hold
    after = engine.zero.gradients.folded_sumsq(0) is None and not engine.zero.offload.prefetched
    engine.step()
    return before, after, engine.zero.offload.phases.norm_bytes == (8 * 4 + 4) * 4


def test_a_gradient_write_after_backward_falls_back_to_the_pass() -> None:
    assert run_world(_shard_access_drops_the_fold, 1) == [(True, True, True)]
