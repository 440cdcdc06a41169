"""Partial optimizer offload (``offload_optimizer.ratio``, stage 3): ZeRO-Offload++'s twin flow.

The last ``ratio`` of each rank's master shard has its optimizer state in host memory and is
updated by the offloaded step's buckets; the first part stays with the shard and is updated by
the device kernel. On this CPU-only machine both sides are host memory, so the split is checked
on the step's own bookkeeping (the elements its buckets update, the size of each state part);
the numerics (fp32 weights within 2e-5 of single-process torch, with accumulation and active
clipping) and checkpoints (same format: a ratio-0.5 checkpoint resumes at ratio 1 and without
offload) are checked for real.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed import run_world
from tests.runtime.models import batches, make_model
from tests.runtime.zero.equivalence import (
    GLOBAL,
    assert_close,
    config,
    config_16bit,
    engine_losses,
    reference_losses,
)
from tests.runtime.zero.test_nvme import _errors
from tests.runtime.zero.test_nvme_param import _weights_close, reference_weights  # noqa: F401 (fixture)
from tests.runtime.zero.test_stage3_checkpoint import _bytes, _full_params, _load, _steps

RATIOS = (0.0, 0.3, 0.5, 1.0)


def _ratio(cfg: dict, ratio: float) -> dict:
    # sub_group_size 50: the host part is updated in several buckets
    cfg["zero_optimization"].update(offload_optimizer={"device": "cpu", "ratio": ratio}, sub_group_size=50)
    return cfg


def _split(rank: int, world: int, ratio: float) -> tuple[int, int, int]:
    """(host elements the step updates, all master elements, host state elements) after a step."""
    import dslaunch

    engine, *_ = dslaunch.initialize(model=make_model(), config=_ratio(config(3), ratio))
    tokens, labels = batches(1, GLOBAL)[0]
    for _ in range(engine.gradient_accumulation_steps()):
        engine.backward(engine(tokens[rank:rank + 1], labels[rank:rank + 1]))
        engine.step()
    total = sum(g.master.numel() for g in engine.zero.groups)
    from dslaunch.utils import safe_get_full_optimizer_state

    assert engine.zero.held_bytes()["optimizer_state"] == 8 * total  # Adam's two fp32 tensors, both parts
    for p in engine.module.parameters():  # both parts joined (collective)
        sq = safe_get_full_optimizer_state(p, "exp_avg_sq")
        assert sq is not None and sq.shape == p.ds_shape and bool(torch.all(sq >= 0))
    off = engine.zero.offload
    if off is None:  # ratio 0: no offloaded step at all
        assert all(engine.optimizer.state[g.master]["exp_avg"].numel() == g.master.numel()
                   for g in engine.zero.groups)
        return 0, total, 0
    host_state = 0
    if off.split is not None:
        for gi, g in enumerate(engine.zero.groups):
            head = off.split.heads[gi]
            assert set(engine.optimizer.state[g.master]) == {"step"}  # the parts hold the rest
            sq = off.split.host_state[gi]["exp_avg_sq"]
            # updated there (a few elements have no gradient: padding, attention's key bias)
            assert sq.numel() == g.master.numel() - head and int((sq > 0).sum()) > sq.numel() // 2
            assert off.split.device_state[gi]["exp_avg_sq"].numel() == head
            host_state += sq.numel()
    return off.host_numel, total, host_state


def _runs(rank: int, world: int, cfgs: list[dict], ratios: tuple[float, ...]) -> list[bytes]:
    out = []
    for cfg in cfgs:
        weights: dict = {}
        out.append(_bytes((engine_losses(rank, world, cfg, weights=weights), weights)))
    return out + [_bytes([_split(rank, world, r) for r in ratios])]


def _check(world: int, ratios: tuple[float, ...], reference) -> None:
    losses, weights = reference
    for per_rank in run_world(_runs, world, [_ratio(config(3), r) for r in ratios], ratios):
        *runs, splits = map(_load, per_rank)
        for got_losses, got_weights in runs:
            assert_close(got_losses, losses, 1e-5)
            _weights_close(got_weights, weights)
        for r, (host, total, host_state) in zip(ratios, splits, strict=True):
            if 0 < r < 1:  # each group (at most 2 here) cut at an element: within one element each
                assert abs(host - r * total) <= 2 and host == host_state and 0 < host < total, (r, host, total)
            else:
                assert host == r * total


@pytest.mark.timeout(150)
def test_ratio_matches_single_process_two_ranks(reference_weights) -> None:  # noqa: F811
    _check(2, RATIOS, reference_weights)


@pytest.mark.timeout(120)
def test_ratio_one_rank_bf16_and_adagrad(reference_weights) -> None:  # noqa: F811
    _check(1, (0.3, 0.5), reference_weights)
    losses, _ = reference_weights
    for bf16, adagrad in run_world(_bf16_and_adagrad, 2, 0.5):
        assert_close(bf16, losses, 3e-2)
        assert_close(adagrad, reference_losses(make_optimizer=_adagrad), 1e-5)


def _adagrad(params) -> torch.optim.Optimizer:
    return torch.optim.Adagrad(params, lr=1e-2, initial_accumulator_value=0.1)


def _bf16_and_adagrad(rank: int, world: int, ratio: float) -> tuple[list[float], list[float]]:
    """bf16 (Adam); fp32 Adagrad, whose state exists before the first step (split at construction)."""
    adagrad = config(3, optimizer={"type": "Adagrad", "params": {"lr": 1e-2, "initial_accumulator_value": 0.1}})
    return (engine_losses(rank, world, _ratio(config_16bit("bf16", 3), ratio)),
            engine_losses(rank, world, _ratio(adagrad, ratio)))


@pytest.mark.timeout(60)
def test_bad_ratios_are_one_line_errors(tmp_path) -> None:
    from dslaunch.errors import ConfigError
    from dslaunch.runtime.config.ds_config import load_config

    key = "'zero_optimization.offload_optimizer.ratio'"
    nvme = {"device": "nvme", "nvme_path": str(tmp_path), "ratio": 0.5}
    for zero, why in (({"stage": 3, "offload_optimizer": {"device": "cpu", "ratio": -0.1}}, "[0, 1]"),
                      ({"stage": 3, "offload_optimizer": {"device": "cpu", "ratio": 1.5}}, "[0, 1]"),
                      ({"stage": 2, "offload_optimizer": {"device": "cpu", "ratio": 0.5}}, "stage 3"),
                      ({"stage": 3, "offload_optimizer": nvme}, "cpu")):
        with pytest.raises(ConfigError) as err:
            load_config({"train_batch_size": 2, "zero_optimization": zero}, 1)
        assert key in str(err.value) and why in str(err.value) and "\n" not in str(err.value), str(err.value)
    sgd = _ratio(config(3, optimizer={"type": "SGD", "params": {"lr": 0.1}}), 0.5)
    [[error]] = run_world(_errors, 1, [sgd])
    assert key in error and "SGD" in error and "\n" not in error, error


def _save(rank: int, world: int, ckpt: str) -> bytes:
    import dslaunch

    data = batches(5, GLOBAL)
    engine, *_ = dslaunch.initialize(model=make_model(), config=_ratio(_ckpt_cfg(), 0.5))
    _steps(engine, rank, world, data[:3])
    engine.save_checkpoint(ckpt, tag="t")
    return _bytes((_full_params(engine), _steps(engine, rank, world, data[3:])))


def _ckpt_cfg() -> dict:
    from tests.runtime.zero.test_stage3_checkpoint import _cfg

    return _cfg(3)


def _resume(rank: int, world: int, ckpt: str, ratio: float | None) -> bytes:
    import dslaunch

    cfg = _ckpt_cfg() if ratio is None else _ratio(_ckpt_cfg(), ratio)
    engine, *_ = dslaunch.initialize(model=make_model(seed=9), config=cfg)
    engine.load_checkpoint(ckpt, tag="t")
    return _bytes((_full_params(engine), _steps(engine, rank, world, batches(5, GLOBAL)[3:])))


@pytest.mark.timeout(150)
def test_ratio_checkpoint_resumes_at_full_and_no_offload(tmp_path) -> None:
    """Saved at ratio 0.5 on 2 ranks; resumed at ratio 1 on 1 rank and without offload on 2:
    same weights, same next losses (the optimizer state came back whole)."""
    ckpt = str(tmp_path)
    full, later = _load(run_world(_save, 2, ckpt)[0])
    for world, ratio in ((1, 1.0), (2, None)):
        for got, losses in map(_load, run_world(_resume, world, ckpt, ratio)):
            for n, t in full.items():
                torch.testing.assert_close(got[n], t, rtol=0, atol=0, msg=n)
            torch.testing.assert_close(losses, later, rtol=1e-5, atol=0)
