"""``engine.optimizer`` as DeepSpeed's optimizer wrapper (``runtime/zero/optimizer_view.py``): the
class DeepSpeed 0.19.8's ``_configure_optimizer`` builds for each config, the torch optimizer
inside, the loss scale and overflow of real fp16 steps, its own ``backward``/``step``, torch's LR
schedulers on it."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

import dslaunch
from dslaunch.errors import NotInDslaunchError
from dslaunch.runtime.base_optimizer import DeepSpeedOptimizer, ZeROOptimizer
from tests.distributed import one_rank, run_world


def _engine(stage: int, precision: str = "fp32", optimizer: str = "config", extra: dict | None = None):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    config = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 1000,
              "zero_optimization": {"stage": stage}, **(extra or {})}
    if precision == "fp16":
        config["fp16"] = {**{"enabled": True, "initial_scale_power": 8, "loss_scale_window": 2},
                          **config.get("fp16", {})}
    elif precision.startswith("bf16"):
        config["bf16"] = {"enabled": True}
        if precision == "bf16+fp32sums":
            config["data_types"] = {"grad_accum_dtype": "fp32"}
    client = None
    if optimizer == "config":
        config["optimizer"] = {"type": "Adam", "params": {"lr": 1e-2}}
    elif optimizer == "torch_adam":
        config["optimizer"] = {"type": "Adam", "params": {"lr": 1e-2, "torch_adam": True}}
    else:
        client = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
    return dslaunch.initialize(model=model, config=config, optimizer=client)


def _batch(engine, seed: int) -> torch.Tensor:
    dtype = next(engine.module.parameters()).dtype
    return torch.randn(2, 6, generator=torch.Generator().manual_seed(seed)).to(dtype)


# (stage, precision, optimizer) -> DeepSpeed's class, read from its engine._configure_optimizer
CASES = [
    (0, "fp32", "config", None),
    (0, "fp16", "config", "FP16_Optimizer"),  # config Adam is DeepSpeed's FusedAdam
    (0, "fp16", "torch_adam", "FP16_UnfusedOptimizer"),
    (0, "fp16", "client", "FP16_UnfusedOptimizer"),
    (0, "bf16", "client", "FP16_UnfusedOptimizer"),  # bf16 summed in bf16: DeepSpeed's DDP_BFLOAT16
    (0, "bf16+fp32sums", "config", "BF16_Optimizer"),  # DeepSpeed refuses it; dslaunch trains it
    (1, "fp16", "config", "DeepSpeedZeroOptimizer"),
    (1, "bf16+fp32sums", "config", "BF16_Optimizer"),
    (2, "fp32", "client", "DeepSpeedZeroOptimizer"),
    (3, "bf16", "config", "DeepSpeedZeroOptimizer_Stage3"),
]


@pytest.mark.timeout(120)
@one_rank
def test_engine_optimizer_is_deepspeeds_wrapper_class_over_the_torch_optimizer() -> None:
    from dslaunch.runtime.bf16_optimizer import BF16_Optimizer
    from dslaunch.runtime.fp16.fused_optimizer import FP16_Optimizer
    from dslaunch.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
    from dslaunch.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    for stage, precision, optimizer, expected in CASES:
        engine, opt, _, _ = _engine(stage, precision, optimizer)
        assert opt is engine.optimizer
        inner = engine.basic_optimizer
        assert isinstance(inner, torch.optim.Optimizer) and inner is engine.zero.optimizer
        if expected is None:  # fp32 stage 0: the torch optimizer itself, as DeepSpeed's
            assert opt is inner
            continue
        case = (stage, precision, optimizer)
        assert type(opt).__name__ == expected, case
        assert opt.optimizer is inner and not hasattr(inner, "optimizer")  # an unwrap loop ends here
        assert opt.param_groups is inner.param_groups and opt.state is inner.state
        assert opt.defaults is inner.defaults
        assert isinstance(opt, DeepSpeedOptimizer) and isinstance(opt, torch.optim.Optimizer)
        zero_class = (DeepSpeedZeroOptimizer, DeepSpeedZeroOptimizer_Stage3, BF16_Optimizer)
        assert isinstance(opt, ZeROOptimizer) == isinstance(opt, zero_class), case
        masters = [g.master for g in engine.zero.groups]
        if isinstance(opt, DeepSpeedZeroOptimizer):
            assert opt.single_partition_of_fp32_groups == masters
            assert [list(g) for g in opt.bit16_groups] == [list(g.params) for g in engine.zero.groups]
        if isinstance(opt, FP16_Optimizer):
            assert opt.fp32_groups_flat == masters
        if expected.startswith("FP16"):  # DeepSpeed 0.19.8's: the scale state in loss_scale_config
            assert opt.loss_scale_config is engine.loss_scaler
            assert opt.loss_scale_config.dynamic_loss_scale is (precision == "fp16")
        if expected == "FP16_UnfusedOptimizer":  # one fp32 view per parameter, shaped like it
            assert [t.shape for t in opt.fp32_groups[0]] == [p.shape for p in engine.module.parameters()]
            assert opt.fp32_groups[0][0].data_ptr() == masters[0].data_ptr()
        if expected == "BF16_Optimizer":  # DeepSpeed's has no loss scaler
            assert opt.fp32_groups_flat_partition == masters and not hasattr(opt, "loss_scaler")
        else:
            assert opt.loss_scaler is engine.loss_scaler and opt.cur_scale == engine.loss_scaler.loss_scale
            assert opt.dynamic_loss_scale is (precision == "fp16")
        assert opt.needs_scaler() is (precision == "fp16") and opt.overflow is False
        with pytest.raises(AttributeError, match=f"'{expected}' object has no attribute 'averaged_grads'"):
            opt.averaged_grads  # noqa: B018
        with pytest.raises(NotInDslaunchError, match=f"{expected}: a stand-alone"):
            type(opt)(inner)
        engine.destroy()


def _overflow_run(rank: int, world: int, stage: int) -> dict:
    """fp16 at scale 2**8 (window 2, hysteresis 1): step 3's loss is inf, so its gradients overflow."""
    engine, opt, _, _ = _engine(stage, "fp16", "config", {"fp16": {"hysteresis": 1}})
    out = {"overflow": [], "cur_scale": [], "scaler": [], "cur_iter": [], "skipped": []}
    for step in range(7):
        loss = engine(_batch(engine, 10 * step + rank)).float().mean()
        engine.backward(loss * float("inf") if step == 3 else loss)
        engine.step()
        out["overflow"].append(opt.overflow)
        out["cur_scale"].append(opt.cur_scale)
        out["scaler"].append(engine.loss_scaler.loss_scale)
        out["cur_iter"].append(opt.loss_scaler.cur_iter)
        out["skipped"].append(engine.skipped_steps)
    opt.loss_scale = 64.0  # DeepSpeed's setter: the scale the next step uses
    out["set"] = engine.loss_scaler.loss_scale
    engine.destroy()
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("stage", [1, 2])
def test_fp16_overflow_and_loss_scale_read_through_the_wrapper(stage: int) -> None:
    for got in run_world(_overflow_run, 2, stage):
        assert got["overflow"] == [False, False, False, True, False, False, False]
        assert got["skipped"] == [0, 0, 0, 1, 1, 1, 1]
        # DeepSpeed's rules (its DynamicLossScaler.update_scale): doubled at the window's second
        # stable step, halved at the overflow, doubled again a window after it
        assert got["cur_scale"] == got["scaler"] == [256.0, 256.0, 512.0, 256.0, 256.0, 256.0, 512.0]
        assert got["cur_iter"] == [1, 2, 3, 4, 5, 6, 7] and got["set"] == 64.0


def _manual_run(rank: int, world: int, through_wrapper: bool) -> list[torch.Tensor]:
    """Three steps, by engine.backward/step or by the wrapper's own backward/step (DeepSpeed's
    optimizer.backward(loss), optimizer.step(), then the engine's counters untouched)."""
    engine, opt, _, _ = _engine(2, "fp16", "config")
    before = [p.detach().float().clone() for p in engine.module.parameters()]
    for step in range(3):
        loss = engine(_batch(engine, 10 * step + rank)).float().mean()
        if through_wrapper:
            opt.backward(loss)
            opt.step()
            opt.zero_grad()
        else:
            engine.backward(loss)
            engine.step()
    assert engine.global_steps == (0 if through_wrapper else 3)
    weights = [p.detach().float().clone() for p in engine.module.parameters()]
    assert not any(torch.equal(a, b) for a, b in zip(before, weights, strict=True))  # it trained
    engine.destroy()
    return weights


@pytest.mark.timeout(120)
def test_the_wrappers_backward_and_step_train_as_the_engines() -> None:
    by_engine = run_world(_manual_run, 2, False)
    by_wrapper = run_world(_manual_run, 2, True)
    for a, b in zip(by_engine[0], by_wrapper[0], strict=True):
        assert torch.equal(a, b)


@pytest.mark.timeout(120)
@one_rank
def test_torch_lr_schedulers_accept_the_wrapper_and_its_state_dict_round_trips() -> None:
    engine, opt, _, _ = _engine(1, "fp16", "config")
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5 ** step)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch warns when the scheduler steps before the optimizer
        for step in range(2):
            engine.backward(engine(_batch(engine, step)).float().mean())
            engine.step()
            sched.step()
    assert engine.get_lr() == [pytest.approx(1e-2 * 0.25)]
    saved = copy.deepcopy(opt.state_dict())
    master = saved["groups"][0]["master"]
    assert torch.equal(master, engine.zero.groups[0].master)
    engine.backward(engine(_batch(engine, 9)).float().mean())
    engine.step()
    assert not torch.equal(master, engine.zero.groups[0].master)
    opt.load_state_dict(saved)
    assert torch.equal(master, engine.zero.groups[0].master)
    engine.destroy()


def _overflow_scales(stage: int, by_hand: bool, extra: dict) -> list[float]:
    """The loss scale after each of four overflowing steps (inf gradients), from 2**2."""
    engine, opt, _, _ = _engine(stage, "fp16", "config", {"fp16": {"initial_scale_power": 2, **extra}})
    scales = []
    for step in range(4):
        if by_hand:  # DeepSpeed's test_dynamic_loss_scale: .grad written, step() without backward
            for p in engine.module.parameters():
                p.grad = torch.full_like(p, float("inf"))
        else:
            engine.backward(engine(_batch(engine, step)).float().mean() * float("inf"))
        try:
            engine.step()
        except FloatingPointError as err:  # LossScaleAtMinimumError
            scales.append(type(err).__name__)
            break
        assert opt.overflow and opt.loss_scaler.cur_iter == step + 1
        scales.append(opt.cur_scale)
    engine.destroy()
    return scales


@pytest.mark.timeout(120)
@one_rank
def test_fp16_overflow_halves_the_scale_without_hysteresis_at_stage_0_only() -> None:
    # DeepSpeed 0.19.8's stage-0 wrappers (FP16_Optimizer, FP16_UnfusedOptimizer: _update_scale)
    # halve at every overflow, hysteresis unread, and stop at min_loss_scale without raising; its
    # ZeRO optimizers' DynamicLossScaler absorbs `hysteresis - 1` overflows and raises at the floor
    for by_hand in (True, False):
        assert _overflow_scales(0, by_hand, {}) == [2.0, 1.0, 1.0, 1.0]
        assert _overflow_scales(0, by_hand, {"hysteresis": 3, "consecutive_hysteresis": True}) == [2.0, 1.0, 1.0, 1.0]
    assert _overflow_scales(1, False, {}) == [4.0, 2.0, 1.0, "LossScaleAtMinimumError"]
    assert _overflow_scales(2, False, {"hysteresis": 3}) == [4.0, 4.0, 2.0, 1.0]
