"""An engine without an optimizer (evaluation, RLHF reference models) at every stage, on gloo.

Stage 3 keeps its parameters partitioned (built under ``zero.Init`` or partitioned at
``initialize``) and gathers them per module for forward; every stage saves and loads its weights.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed import run_world
from tests.runtime.models import batches, make_model

MICRO = 4
THRESHOLD = 16  # the LayerNorm weights/biases (16) and the head bias (4) stay whole


def _config(stage: int) -> dict:
    return {"train_micro_batch_size_per_gpu": MICRO,
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": THRESHOLD}}


def _reference_model(rank: int, world: int, under_init: bool) -> dict:
    import dslaunch

    tokens, labels = batches(1, MICRO, seed=rank + 3)[0]  # each rank its own batch
    expected = make_model()(tokens, labels).item()  # plain torch
    config = _config(3)
    if under_init:  # as TRL/OpenRLHF through HfDeepSpeedConfig
        dslaunch.init_distributed()
        with dslaunch.zero.Init(config_dict_or_path=config):
            model = make_model()
    else:
        model = make_model()
    total = sum(p.numel() for p in make_model().parameters())
    engine, optimizer, _, _ = dslaunch.initialize(model=model, config=config)
    engine.eval()
    with torch.no_grad():
        outs = [engine(tokens, labels).item(), engine.module(tokens, labels).item()]
    params = list(engine.module.parameters())
    whole = [p for p in params if p.ds_persist]
    return {"expected": expected, "outs": outs, "optimizer": optimizer, "total": total,
            "shard": sum(p.ds_tensor.numel() for p in params if not p.ds_persist),
            "live": sum(p.data.numel() for p in params if not p.ds_persist),
            "whole": sum(p.numel() for p in whole), "whole_max": max(p.numel() for p in whole)}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("under_init", [True, False], ids=["zero_init", "partitioned_at_initialize"])
def test_stage3_reference_model_matches_torch_with_partitioned_params(under_init: bool) -> None:
    results = run_world(_reference_model, 2, under_init)
    for r in results:
        assert r["optimizer"] is None
        assert r["outs"] == pytest.approx([r["expected"]] * 2, abs=1e-6)
        assert r["live"] == 0  # nothing stays gathered after forward
        assert 0 < r["whole_max"] <= THRESHOLD
    partitioned = results[0]["total"] - results[0]["whole"]
    assert sum(r["shard"] for r in results) == partitioned  # each element on exactly one rank
    assert all(r["shard"] <= partitioned // 2 + 1 for r in results)


def _outputs(engine, tokens, labels) -> float:
    with torch.no_grad():
        return engine(tokens, labels).item()


def _save_load(rank: int, world: int, root: str) -> dict:
    import dslaunch

    tokens, labels = batches(1, MICRO, seed=rank + 3)[0]
    got = {}
    for stage in (0, 1, 2, 3):
        saver, *_ = dslaunch.initialize(model=make_model(seed=0), config=_config(stage))
        saver.save_checkpoint(f"{root}/s{stage}", tag="ref")
        for load_stage in {stage, 3 - stage}:  # the same stage, and another one
            loader, *_ = dslaunch.initialize(model=make_model(seed=7), config=_config(load_stage))
            before = _outputs(loader, tokens, labels)
            path, client = loader.load_checkpoint(f"{root}/s{stage}")
            got[(stage, load_stage)] = (_outputs(saver, tokens, labels), before,
                                        _outputs(loader, tokens, labels), path.endswith("ref"), client)
    return got


@pytest.mark.timeout(120)
def test_engine_without_optimizer_saves_and_loads_its_weights(tmp_path) -> None:
    for got in run_world(_save_load, 2, str(tmp_path)):
        assert len(got) == 8
        for (stage, load_stage), (saved, before, loaded, tagged, client) in got.items():
            assert before != saved  # another model before loading
            assert loaded == pytest.approx(saved, abs=1e-6), (stage, load_stage)
            assert tagged and client == {}
