"""ZeRO stage 3 on one rank: nothing to gather, so nothing is gathered or released.

The parameters are views of the group's shard (``partitioned.py``'s resident groups) and the
module is not hooked; training gives stage 0's losses and weights, ``GatheredParameters`` with a
modifier still writes through to the fp32 master, and a checkpoint round trip resumes alike. The
gradients go straight into the shard (no reduction buffer is ever taken).
"""

from __future__ import annotations

import pytest

from tests.distributed import run_world

STEPS = 4


def _train(rank: int, world: int, stage: int, tmp: str) -> dict:
    import torch

    import dslaunch
    from dslaunch.runtime.zero import params as zp
    from dslaunch.runtime.zero.partition_parameters import GatheredParameters

    calls = {"gather": 0, "release": 0}
    gather_range, placeholder = zp.gather_range, zp._placeholder

    def counted_gather(*a, **k):
        calls["gather"] += 1
        return gather_range(*a, **k)

    def counted_placeholder(p):
        calls["release"] += 1
        return placeholder(p)

    zp.gather_range, zp._placeholder = counted_gather, counted_placeholder
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 8))
    cfg = {"train_batch_size": 4, "gradient_clipping": 0.5, "steps_per_print": 100, "bf16": {"enabled": True},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
           "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}
    engine, *_ = dslaunch.initialize(model=model, config=cfg)
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(4, 16, generator=g), torch.randn(4, 8, generator=g)) for _ in range(2 * STEPS)]

    def step(x: torch.Tensor, y: torch.Tensor) -> float:
        loss = torch.nn.functional.mse_loss(engine(x.bfloat16()).float(), y)
        engine.backward(loss)
        engine.step()
        return loss.item()

    losses = [step(*d) for d in data[:STEPS]]
    out: dict = {"losses": losses, "weights": [p.detach().float().tolist() for p in model.parameters()]}
    if stage == 3:
        shard = engine.zero.groups[0].shard
        lo, hi = shard.data_ptr(), shard.data_ptr() + shard.numel() * shard.element_size()
        out["views"] = all(lo <= p.data_ptr() < hi and p.ds_status is zp.ZeroParamStatus.AVAILABLE
                           for p in model.parameters())
        out["hooked"] = engine.zero.fetcher is not None
        out["comm_buffers"] = engine.zero.held_bytes()["comm_buffers"]  # gradients went straight to the shard
        with GatheredParameters([model[0].weight], modifier_rank=0):
            model[0].weight.data.mul_(0.5)
        # the master took the modified weight: the next step's update starts from it
        out["master_halved"] = torch.equal(engine.zero.groups[0].master.data[:512].bfloat16(),
                                           model[0].weight.data.reshape(-1))
        engine.save_checkpoint(tmp, tag="t")
        after = [step(*d) for d in data[STEPS:]]
        engine.load_checkpoint(tmp, tag="t")
        out["resumed_alike"] = after == [step(*d) for d in data[STEPS:]]
    out["calls"] = calls
    return out


@pytest.mark.timeout(90)
def test_world_one_gathers_nothing_and_trains_as_stage0(tmp_path) -> None:
    (z0,) = run_world(_train, 1, 0, str(tmp_path / "z0"))
    (z3,) = run_world(_train, 1, 3, str(tmp_path / "z3"))
    assert z3["losses"] == z0["losses"]
    assert z3["weights"] == z0["weights"]
    assert z3["views"] and not z3["hooked"] and z3["comm_buffers"] == 0
    assert z3["calls"] == {"gather": 0, "release": 0}
    assert z3["master_halved"] and z3["resumed_alike"]
