"""Strategy state in the contract's format: shards saved at one stage/world load at another."""

from __future__ import annotations

import io

import pytest
import torch

from tests.distributed import run_world
from tests.runtime.models import batches, make_model


def _cfg(stage: int) -> dict:
    return {"train_batch_size": 4, "steps_per_print": 1000,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
            "zero_optimization": {"stage": stage, "reduce_bucket_size": 150}}


def _train(rank: int, world: int, stage: int) -> bytes:
    import dslaunch

    engine, _, _, _ = dslaunch.initialize(model=make_model(), config=_cfg(stage))
    micro = 4 // world
    for tokens, labels in batches(3, 4):
        engine.backward(engine(tokens[rank * micro:(rank + 1) * micro], labels[rank * micro:(rank + 1) * micro]))
        engine.step()
    out = io.BytesIO()  # tensors do not survive the result queue once the rank exits: serialise
    torch.save((engine.zero.state_dict(), dict(engine.module.named_parameters())), out)
    return out.getvalue()


def _consolidate(shards: list[dict]) -> dict:
    groups = []
    for parts in zip(*(s["groups"] for s in shards), strict=True):
        first = parts[0]
        assert [p["start"] for p in parts[1:]] == [p["end"] for p in parts[:-1]]  # contiguous shards
        groups.append({**first, "start": 0, "end": first["numel"],
                       "master": torch.cat([p["master"] for p in parts]),
                       "optim_state": {k: torch.cat([p["optim_state"][k] for p in parts])
                                       for k in first["optim_state"]}})
    return {"stage": shards[0]["stage"], "world_size": 1, "rank": 0, "groups": groups}


@pytest.mark.timeout(60)
def test_stage2_shards_reload_consolidated_at_stage1_world1() -> None:
    import dslaunch

    results = [torch.load(io.BytesIO(b), weights_only=False) for b in run_world(_train, 2, 2)]
    shards = [sd for sd, _ in results]
    trained = results[0][1]
    g = shards[0]["groups"][0]
    assert set(g) >= {"names", "shapes", "numel", "start", "end", "master", "optim_state",
                      "optim_scalars", "hparams"}
    assert set(g["optim_state"]) == {"exp_avg", "exp_avg_sq"} and g["hparams"]["lr"] == 1e-2
    assert g["master"].numel() == g["end"] - g["start"] and g["master"].dtype == torch.float32
    # world 1 (no process group): a fresh model gets the trained weights and optimizer state
    engine, _, _, _ = dslaunch.initialize(model=make_model(seed=5), config=_cfg(1), dist_init_required=False)
    engine.zero.load_state_dict(_consolidate(shards))
    for name, p in engine.module.named_parameters():
        assert torch.equal(p, trained[name]), name
    mine = engine.zero.state_dict()["groups"][0]
    want = _consolidate(shards)["groups"][0]
    assert torch.equal(mine["optim_state"]["exp_avg"], want["optim_state"]["exp_avg"])
    with pytest.raises(ValueError, match="does not cover"):
        engine.zero.load_state_dict(shards[1])  # a half shard cannot fill the whole group
