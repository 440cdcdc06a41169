"""ZeRO stage 3 at world sizes 1, 2, 4 trains to the losses of plain single-process torch.

See ``equivalence.py`` for the setup (2 accumulation micro steps, active clipping, tiny buckets).
``stage3_param_persistence_threshold: 0`` partitions every parameter; the default keeps the tiny
model whole (persistent) and must train alike. 16-bit models at 2 and 4 ranks.
"""

from __future__ import annotations

import pytest

from tests.distributed import run_world
from tests.runtime.zero.equivalence import check, config, config_16bit

STAGE = 3


def config3(**zero) -> dict:
    cfg = config(STAGE)
    cfg["zero_optimization"].update({"stage3_param_persistence_threshold": 0, **zero})
    return cfg


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [1, 2, 4])
def test_fp32_matches_single_process(world: int, reference: list[float]) -> None:
    extra = [config(STAGE), config3(overlap_comm=False)] if world == 2 else []
    check(world, [config3(), *extra], reference, 1e-5, every_rank=True)


@pytest.mark.timeout(90)
def test_16bit_tracks_fp32(reference: list[float]) -> None:
    """bf16 and fp16 (dynamic scale from 2**8) on 2 ranks, fp16 on 4."""
    configs = [config_16bit(p, STAGE) for p in ("bf16", "fp16")]
    for c in configs:
        c["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    check(2, configs, reference, 3e-2)
    check(4, configs[1:], reference, 3e-2)


def _memory(rank: int, world: int) -> tuple[int, int, int, int]:
    import torch

    import dslaunch

    torch.manual_seed(0)
    layers = [torch.nn.Linear(16, 16) for _ in range(6)]
    model = torch.nn.Sequential(*[m for lin in layers for m in (lin, torch.nn.Tanh())])
    total = sum(p.numel() for p in model.parameters())
    cfg = {"train_batch_size": 4, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    engine, *_ = dslaunch.initialize(model=model, config=cfg)
    whole: list[int] = []
    for m in layers:  # runs after the gather hook: what is whole while each layer runs
        m.register_forward_pre_hook(lambda m, a: whole.append(sum(p.numel() for p in model.parameters())))
    x = torch.randn(4 // world, 16)
    engine.backward(engine(x).square().mean())
    engine.step()
    held = sum(g.shard.numel() for g in engine.zero.groups)
    optim = engine.zero.held_bytes()["optimizer_state"] // 4
    after = sum(p.numel() for p in model.parameters())
    return total, held, max(whole), optim + after


@pytest.mark.timeout(60)
def test_memory_is_a_shard_plus_the_running_module() -> None:
    """4 ranks: each holds 1/4 of the weights (and 2/4 in Adam state: two moments); while a layer
    runs only its own 272 parameters are whole; after the step none is."""
    for total, held, peak, rest in run_world(_memory, 4):
        assert held == -(-total // 4)
        assert peak == 16 * 16 + 16
        assert rest == 2 * held


def _checkpointed(rank: int, world: int, reentrant: bool) -> None:
    import copy

    import torch
    from torch.utils.checkpoint import checkpoint

    import dslaunch
    from dslaunch.utils import safe_get_full_grad

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.norm, self.b = torch.nn.Linear(8, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = checkpoint(lambda y: self.norm(torch.tanh(self.a(y))), x, use_reentrant=reentrant)
            return self.b(h).square().mean()

    torch.manual_seed(0)
    model = Net()
    ref = copy.deepcopy(model)
    x = torch.randn(4, 8, requires_grad=reentrant)  # the reentrant variant needs an input that does
    ref(x).backward()
    cfg = {"train_batch_size": 4, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    engine, *_ = dslaunch.initialize(model=model, config=cfg)
    micro = 4 // world
    engine.backward(engine(x[rank * micro:(rank + 1) * micro]))
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(safe_get_full_grad(p), q.grad, rtol=1e-5, atol=1e-6)
    assert all(p.numel() == 0 for p in model.parameters())


@pytest.mark.timeout(60)
@pytest.mark.parametrize("reentrant", [False, True])
def test_activation_checkpointing(reentrant: bool) -> None:
    """torch.utils.checkpoint recomputes forwards inside backward: gradients still match torch and
    every parameter is released after backward."""
    run_world(_checkpointed, 2, reentrant)


def _frozen_status(rank: int, world: int) -> list[tuple[str, bool, str, bool, int]]:
    import torch

    import dslaunch
    from dslaunch.runtime.zero.utils import is_zero_param

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.LayerNorm(8), torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 4))
    model[0].requires_grad_(False)
    cfg = {"train_batch_size": 4, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    trainable = [p for p in model.parameters() if p.requires_grad]
    engine, *_ = dslaunch.initialize(model=model, config=cfg, model_parameters=trainable)
    engine.backward(engine(torch.randn(2, 8)).square().mean())
    engine.step()
    # DeepSpeed's test helpers walk every parameter: persistent ones whole, the others released
    return [(name, p.ds_persist, p.ds_status.name, is_zero_param(p), p.numel()) for name, p in model.named_parameters()]


@pytest.mark.timeout(60)
def test_frozen_parameters_read_as_persistent() -> None:
    """Parameters not given to the optimizer stay whole at stage 3 (unless built under zero.Init):
    they carry DeepSpeed's ``ds_persist``/``ds_status`` of a persistent parameter, not ``ds_id``."""
    for status in run_world(_frozen_status, 2):
        assert status == [("0.weight", True, "AVAILABLE", False, 8), ("0.bias", True, "AVAILABLE", False, 8),
                          ("1.weight", False, "NOT_AVAILABLE", True, 0), ("1.bias", False, "NOT_AVAILABLE", True, 0),
                          ("3.weight", False, "NOT_AVAILABLE", True, 0), ("3.bias", False, "NOT_AVAILABLE", True, 0)]


def _empty_cache(rank: int, world: int, empty: bool, threshold: int = 0) -> tuple[int, list[float]]:
    import torch

    import dslaunch
    from dslaunch.utils import safe_get_full_fp32_param

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    cfg = {"train_batch_size": 4, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": threshold}}
    engine, *_ = dslaunch.initialize(model=model, config=cfg)
    x = torch.randn(2, 16, generator=torch.Generator().manual_seed(rank))
    whole = 0
    for _ in range(2):
        with torch.no_grad():
            engine(x)  # an evaluation between steps
        if empty:
            engine.empty_partition_cache()
            whole = max(whole, sum(p.numel() for p in model.parameters()))
        engine.backward(engine(x).square().mean())
        engine.step()
    return whole, safe_get_full_fp32_param(model[2].weight).reshape(-1).tolist()


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("world", "threshold"), [(2, 0), (2, 16), (1, 0)])
def test_empty_partition_cache_leaves_nothing_gathered_and_training_unchanged(world: int, threshold: int) -> None:
    """Persistent parameters (the biases at threshold 16; every one of a single rank's resident
    groups) are released too, as DeepSpeed's, and gathered again by the next forward."""
    plain = run_world(_empty_cache, world, False, threshold, timeout=80)
    emptied = run_world(_empty_cache, world, True, threshold, timeout=80)
    for (_, want), (whole, got) in zip(plain, emptied, strict=True):
        assert whole == 0 and got == want


def _empty_cache_forward_only(rank: int, world: int, threshold: int) -> tuple[int, list[float], list[float]]:
    import torch

    import dslaunch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    cfg = {"train_batch_size": 4, "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": threshold}}
    engine, *_ = dslaunch.initialize(model=model, config=cfg)  # no optimizer: an evaluation engine
    x = torch.randn(2, 16, generator=torch.Generator().manual_seed(rank))
    with torch.no_grad():
        before = engine(x).reshape(-1).tolist()
        engine.empty_partition_cache()
        whole = sum(p.numel() for p in model.parameters())
        after = engine.module(x).reshape(-1).tolist()  # a direct call gathers them too
    return whole, before, after


@pytest.mark.timeout(90)
@pytest.mark.parametrize("threshold", [0, 16])
def test_empty_partition_cache_of_a_forward_only_engine_releases_and_regathers(threshold: int) -> None:
    for whole, before, after in run_world(_empty_cache_forward_only, 2, threshold, timeout=80):
        assert whole == 0 and after == before


def _outside_read(rank: int, world: int, steps: int) -> list[float]:
    import torch

    import dslaunch

    class ReadsAnother(torch.nn.Module):
        """The root's forward reads linear1's weight itself (DeepSpeed's test_ext_param_getattr)."""

        def __init__(self) -> None:
            super().__init__()
            self.linear1, self.linear2 = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.linear2(self.linear1(x))
            return torch.nn.functional.linear(h, self.linear1.weight).square().mean()

    torch.manual_seed(0)
    model = ReadsAnother()
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    if world == 0:  # the plain torch reference, one process, the whole batch
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        losses = []
        for _ in range(steps):
            loss = model(x)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        return losses
    cfg = {"train_batch_size": 4, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    engine, *_ = dslaunch.initialize(model=model, config=cfg)
    share = x[rank * 2:(rank + 1) * 2]
    losses = []
    for _ in range(steps):
        loss = engine(share)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


@pytest.mark.timeout(90)
def test_a_parameter_read_outside_its_module_is_gathered_without_registration() -> None:
    want = _outside_read(0, 0, 4)
    got = run_world(_outside_read, 2, 4, timeout=80)
    mean = [(a + b) / 2 for a, b in zip(got[0], got[1], strict=True)]
    assert mean == pytest.approx(want, rel=1e-5)
