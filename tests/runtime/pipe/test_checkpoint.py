"""Pipeline checkpoints on real gloo ranks: each rank saves its part, named by its coordinates (one
file per layer); a restart at the same shape continues bit for bit; a tag loads at another
pipeline depth and data-parallel width with the same weights and optimizer state; ``zero_to_fp32``
makes one state dict of it; broken tags are one line naming the file."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from dslaunch.errors import CheckpointError
from tests.distributed import run_world
from tests.runtime.pipe import helpers

pytestmark = pytest.mark.timeout(180)

HALF, MICRO_PER_STEP = 4, 4  # steps before and after the save; micro batches per step (all replicas)
SEED, OTHER_SEED = helpers.BASE_SEED, 99


def _engine(stages: int, world: int, zero: int, seed: int = SEED):
    import dslaunch
    from dslaunch.pipe import PipelineModule

    dslaunch.init_distributed(verbose=False)
    module = PipelineModule(helpers.layers(), num_stages=stages, loss_fn=helpers.loss_fn, seed_layers=True,
                            base_seed=seed)
    gas = MICRO_PER_STEP // (world // stages)  # the same global batch at every shape
    cfg = helpers.config(gas, 0.01, optimizer={"type": "AdamW", "params": {"lr": 0.01}},
                         scheduler={"type": "WarmupLR", "params": {"warmup_num_steps": 6}},
                         zero_optimization={"stage": zero})
    engine, *_ = dslaunch.initialize(model=module, config=cfg)
    return engine


def _data(engine, first: int, steps: int):
    """This replica's micro batches of steps ``first`` .. ``first + steps - 1``."""
    dp, gas = engine.dp_world_size, engine.micro_batches
    replica = engine.grid.get_data_parallel_rank()
    for step in range(first, first + steps):
        yield from helpers.micro_batches(step, gas * dp)[replica * gas:(replica + 1) * gas]


def _train(engine, first: int, steps: int) -> list[float]:
    data = _data(engine, first, steps)
    return [engine.train_batch(data).item() for _ in range(steps)]


def _state(engine) -> dict:
    """Weights by name, and the ZeRO state by parameter (numpy: tensors die with the rank)."""
    zero = engine.zero.state_dict()
    return {"module": {k: v.float().numpy().copy() for k, v in engine.module_state_dict().items()},
            "zero": [{"master": g["master"].numpy().copy(), "range": (g["start"], g["end"]),
                      "optim": {k: v.numpy().copy() for k, v in g["optim_state"].items()},
                      "step": float(g["optim_scalars"].get("step", -1))} for g in zero["groups"]],
            "counters": {k: engine.engine_state_dict()[k] for k in ("global_steps", "micro_steps")},
            "lr": engine.get_lr()}


def _save_runs(rank: int, world: int, root: str, shapes: list[tuple[int, int]]) -> dict:
    """The uninterrupted run of the first shape, then each shape's first half, saved."""
    stages, zero = shapes[0]
    engine = _engine(stages, world, zero)
    out = {"straight": _train(engine, 0, 2 * HALF), "saved": {}}
    for stages, zero in shapes:
        engine = _engine(stages, world, zero)
        _train(engine, 0, HALF)
        engine.save_checkpoint(f"{root}/p{stages}z{zero}")
        out["saved"][(stages, zero)] = _state(engine)
    return out


def _resume(rank: int, world: int, root: str, stages: int, zero: int, saved: str) -> dict:
    engine = _engine(stages, world, zero, seed=OTHER_SEED)  # other weights: the load must replace them
    path, _ = engine.load_checkpoint(f"{root}/{saved}")
    assert path is not None and path.endswith(f"global_step{HALF}")
    loaded = _state(engine)
    return {"loaded": loaded, "losses": _train(engine, HALF, HALF), "stage": engine.stage_id}


def _files(root: Path) -> set[str]:
    return {p.name for p in (root / f"global_step{HALF}").iterdir()}


@pytest.mark.parametrize("world, zero", [(2, 0), (4, 1)])
def test_resume_at_the_same_shape_is_bitwise(tmp_path: Path, world: int, zero: int) -> None:
    saved = run_world(_save_runs, world, str(tmp_path), [(2, zero)], timeout=150)
    resumed = run_world(_resume, world, str(tmp_path), 2, zero, f"p2z{zero}", timeout=150)
    for s, r in zip(saved, resumed, strict=True):
        assert r["losses"] == s["straight"][HALF:]  # bit for bit
        before, after = s["saved"][(2, zero)], r["loaded"]
        assert before["counters"] == after["counters"] and before["lr"] == after["lr"]
        for k, v in before["module"].items():
            assert np.array_equal(after["module"][k], v), k
        for g, h in zip(before["zero"], after["zero"], strict=True):
            assert np.array_equal(g["master"], h["master"]) and g["step"] == h["step"] > 0
            assert g["optim"].keys() == h["optim"].keys() == {"exp_avg", "exp_avg_sq"}
            assert all(np.array_equal(g["optim"][k], h["optim"][k]) for k in g["optim"])
    dp = world // 2
    zero_files = {f"zero_pipe_{p:02d}-data_{d:02d}.dsl" for p in range(2) for d in range(dp if zero else 1)}
    layer_files = {f"layer_{i:02d}-model_states.dsl" for i in range(8)}  # every module layer, Tanh too
    assert _files(tmp_path / "p2z0" if zero == 0 else tmp_path / "p2z1") == \
        zero_files | layer_files | {f"rank_{r:05d}.dsl" for r in range(world)} | {"manifest.json"}
