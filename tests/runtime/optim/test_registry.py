"""Optimizers by ds_config name: validation messages, DeepSpeed semantics, Lion/Lamb vs references."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from dslaunch.errors import ConfigError
from dslaunch.runtime.optim.lamb import Lamb
from dslaunch.runtime.optim.lion import Lion
from dslaunch.runtime.optim.registry import OPTIMIZER_TYPES, build_optimizer, validate_optimizer

pytestmark = pytest.mark.timeout(60)


def _build(opt_type, params, groups, **kwargs):
    """The engine's path: the section validated once (as when the config is parsed), then built."""
    return build_optimizer(validate_optimizer(opt_type, params), groups, **kwargs)


def _params(seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(7, 5, generator=gen).requires_grad_(), torch.randn(5, generator=gen).requires_grad_(),
            torch.zeros(3).requires_grad_()]


def _grads(params: list[torch.Tensor], step: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + step)
    return [torch.randn(p.shape, generator=gen) for p in params]


def _run(opt: torch.optim.Optimizer, params: list[torch.Tensor], steps: int) -> list[torch.Tensor]:
    for step in range(steps):
        for p, g in zip(params, _grads(params, step), strict=True):
            p.grad = g.clone()
        opt.step()
    return [p.detach().clone() for p in params]


# ---------------------------------------------------------------- names and validation


@pytest.mark.parametrize("spelling", ["adam", "ADAM", "Adam", "adamw", "AdamW", "sgd", "Adagrad", "lion", "LAMB"])
def test_type_is_case_insensitive(spelling: str) -> None:
    spec = validate_optimizer(spelling, {"lr": 0.01})
    assert spec.name in OPTIMIZER_TYPES and spec.name.lower() == spelling.lower()
    assert spec.params["lr"] == 0.01


def test_unknown_type_lists_valid_ones_with_did_you_mean() -> None:
    with pytest.raises(ConfigError) as err:
        validate_optimizer("AdamX", {})
    msg = str(err.value)
    assert "optimizer.type" in msg and "did you mean 'adam" in msg.lower()
    for name in OPTIMIZER_TYPES:
        assert name in msg


def test_unknown_param_names_key_path_and_suggests() -> None:
    with pytest.raises(ConfigError) as err:
        validate_optimizer("AdamW", {"lr": 1e-3, "weight_decy": 0.1})
    msg = str(err.value)
    assert "optimizer.params.weight_decy" in msg and "did you mean 'weight_decay'" in msg


@pytest.mark.parametrize("params, key", [
    ({"lr": "0.1"}, "optimizer.params.lr"),
    ({"lr": -1.0}, "optimizer.params.lr"),
    ({"betas": [0.9]}, "optimizer.params.betas"),
    ({"betas": [0.9, 1.5]}, "optimizer.params.betas[1]"),
    ({"amsgrad": "false"}, "optimizer.params.amsgrad"),
    ({"weight_decay": True}, "optimizer.params.weight_decay"),
    ({"lr": "auto"}, "optimizer.params.lr"),
    ({"max_grad_norm": 1.0}, "optimizer.params.max_grad_norm"),
    ({"bias_correction": False, "amsgrad": True}, "optimizer.params.amsgrad"),
])
def test_wrong_values_name_the_key(params: dict, key: str) -> None:
    with pytest.raises(ConfigError) as err:
        validate_optimizer("Adam", params)
    assert f"'{key}'" in str(err.value)


def test_auto_placeholder_is_explained() -> None:
    with pytest.raises(ConfigError, match="Hugging Face"):
        validate_optimizer("AdamW", {"lr": "auto"})


def test_cross_checks() -> None:
    with pytest.raises(ConfigError, match="nesterov"):
        validate_optimizer("SGD", {"nesterov": True})
    with pytest.raises(ConfigError, match="min_coeff"):
        validate_optimizer("Lamb", {"min_coeff": 5.0, "max_coeff": 1.0})
    with pytest.raises(ConfigError, match="amsgrad"):
        validate_optimizer("Lamb", {"amsgrad": True})


def test_defaults_follow_deepspeed() -> None:
    adam = validate_optimizer("Adam", None).params
    assert adam["lr"] == 1e-3 and adam["betas"] == (0.9, 0.999) and adam["eps"] == 1e-8
    assert adam["weight_decay"] == 0.0 and adam["adam_w_mode"] is True
    lamb = validate_optimizer("Lamb", {}).params
    assert lamb["max_coeff"] == 10.0 and lamb["min_coeff"] == 0.01


# ---------------------------------------------------------------- build: DeepSpeed semantics


def test_adam_is_decoupled_unless_adam_w_mode_false() -> None:
    cfg = {"lr": 0.01, "weight_decay": 0.1}
    adam_p = _params()
    adam = _run(_build("Adam", cfg, adam_p), adam_p, 4)
    ref_p = _params()
    ref = _run(torch.optim.AdamW(ref_p, lr=0.01, weight_decay=0.1), ref_p, 4)
    for a, r in zip(adam, ref, strict=True):
        torch.testing.assert_close(a, r)

    l2_p = _params()
    l2 = _run(_build("adam", {**cfg, "adam_w_mode": False}, l2_p), l2_p, 4)
    ref_p = _params()
    ref_l2 = _run(torch.optim.Adam(ref_p, lr=0.01, weight_decay=0.1), ref_p, 4)
    for a, r in zip(l2, ref_l2, strict=True):
        torch.testing.assert_close(a, r)
    assert not torch.allclose(adam[0], l2[0])  # the two modes really differ


def test_adamw_type_ignores_adam_w_mode_false() -> None:
    opt = _build("AdamW", {"adam_w_mode": False, "weight_decay": 0.1}, _params())
    assert isinstance(opt, torch.optim.AdamW)
    assert opt.param_groups[0]["weight_decay"] == 0.1


def test_fused_is_used_on_cpu_when_available() -> None:
    opt = _build("AdamW", {}, _params())
    assert opt.defaults.get("fused") is True


def test_param_groups_keep_their_own_overrides_and_generators_work() -> None:
    params = _params()
    groups = [{"params": params[:2]}, {"params": params[2:], "weight_decay": 0.0}]
    opt = _build("AdamW", {"weight_decay": 0.05}, iter(groups))
    assert [g["weight_decay"] for g in opt.param_groups] == [0.05, 0.0]
    opt2 = _build("SGD", {"lr": 0.1, "momentum": 0.9}, (p for p in _params()))
    assert len(opt2.param_groups[0]["params"]) == 3


@pytest.mark.parametrize("name, cfg, ref", [
    ("SGD", {"lr": 0.1, "momentum": 0.9, "nesterov": True, "weight_decay": 0.01},
     lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01, foreach=False)),
    ("Adagrad", {"lr": 0.05, "lr_decay": 0.01}, lambda p: torch.optim.Adagrad(p, lr=0.05, lr_decay=0.01,
                                                                              foreach=False)),
    ("AdamW", {"lr": 0.01, "amsgrad": True},
     lambda p: torch.optim.AdamW(p, lr=0.01, amsgrad=True, weight_decay=0.0, foreach=False)),
])
def test_torch_types_match_the_plain_torch_loop(name: str, cfg: dict, ref) -> None:
    ours_p, ref_p = _params(), _params()
    ours = _run(_build(name, cfg, ours_p), ours_p, 5)
    expected = _run(ref(ref_p), ref_p, 5)
    for a, r in zip(ours, expected, strict=True):
        torch.testing.assert_close(a, r, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------- Lion and Lamb vs references


def _reference_lion(params, steps, lr, betas, wd):
    params = [p.detach().clone() for p in params]
    m = [torch.zeros_like(p) for p in params]
    for step in range(steps):
        for i, g in enumerate(_grads(params, step)):
            c = betas[0] * m[i] + (1 - betas[0]) * g
            params[i] = params[i] * (1 - lr * wd) - lr * torch.sign(c)
            m[i] = betas[1] * m[i] + (1 - betas[1]) * g
    return params


def _reference_lamb(params, steps, lr, betas, eps, wd, max_coeff, min_coeff, bias_correction=True):
    params = [p.detach().clone() for p in params]
    m = [torch.zeros_like(p) for p in params]
    v = [torch.zeros_like(p) for p in params]
    for step in range(steps):
        t = step + 1
        for i, g in enumerate(_grads(params, step)):
            m[i] = betas[0] * m[i] + (1 - betas[0]) * g
            v[i] = betas[1] * v[i] + (1 - betas[1]) * g * g
            update = m[i] / (v[i].sqrt() + eps) + wd * params[i]
            w_norm, u_norm = params[i].norm().item(), update.norm().item()
            coeff = min(max(w_norm / u_norm, min_coeff), max_coeff) if w_norm > 0 and u_norm > 0 else 1.0
            size = lr * math.sqrt(1 - betas[1] ** t) / (1 - betas[0] ** t) if bias_correction else lr
            params[i] = params[i] - size * coeff * update
    return params


@pytest.mark.parametrize("wd", [0.0, 0.1])
def test_lion_matches_reference(wd: float) -> None:
    params = _params()
    expected = _reference_lion(params, 6, 0.01, (0.9, 0.99), wd)
    opt = _build("Lion", {"lr": 0.01, "betas": [0.9, 0.99], "weight_decay": wd}, params)
    assert isinstance(opt, Lion)
    for a, r in zip(_run(opt, params, 6), expected, strict=True):
        torch.testing.assert_close(a, r, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("wd, bias_correction", [(0.0, True), (0.01, True), (0.01, False)])
def test_lamb_matches_reference(wd: float, bias_correction: bool) -> None:
    params = _params()
    expected = _reference_lamb(params, 6, 0.01, (0.9, 0.999), 1e-8, wd, 10.0, 0.01, bias_correction)
    opt = _build("Lamb", {"lr": 0.01, "weight_decay": wd, "bias_correction": bias_correction}, params)
    assert isinstance(opt, Lamb)
    for a, r in zip(_run(opt, params, 6), expected, strict=True):
        torch.testing.assert_close(a, r, rtol=1e-5, atol=1e-6)


def test_lamb_trust_ratio_is_clamped() -> None:
    # A huge weight with a tiny gradient: ||w||/||u|| is far above max_coeff, so the step is
    # exactly lr * max_coeff * update.
    p = torch.full((4,), 1000.0, requires_grad=True)
    opt = Lamb([p], lr=0.1, max_coeff=2.0, bias_correction=False)
    p.grad = torch.full((4,), 1.0)
    opt.step()
    # update = m / (sqrt(v) + eps) with m = 0.1, v = 0.001 -> 0.1 / 0.0316.. = 3.162..
    update = 0.1 / (math.sqrt(0.001) + 1e-8)
    torch.testing.assert_close(p.detach(), torch.full((4,), 1000.0 - 0.1 * 2.0 * update))


def _reference_adam(params, steps, lr, betas, eps, wd, decoupled, bias_correction):
    params = [p.detach().clone() for p in params]
    m = [torch.zeros_like(p) for p in params]
    v = [torch.zeros_like(p) for p in params]
    for step in range(steps):
        t = step + 1
        bc1, bc2 = (1 - betas[0] ** t, 1 - betas[1] ** t) if bias_correction else (1.0, 1.0)
        for i, g in enumerate(_grads(params, step)):
            if not decoupled:
                g = g + wd * params[i]
            m[i] = betas[0] * m[i] + (1 - betas[0]) * g
            v[i] = betas[1] * v[i] + (1 - betas[1]) * g * g
            if decoupled:
                params[i] = params[i] * (1 - lr * wd)
            params[i] = params[i] - (lr / bc1) * m[i] / ((v[i] / bc2).sqrt() + eps)
    return params


@pytest.mark.parametrize("adam_w_mode", [True, False])
def test_adam_without_bias_correction_matches_reference(adam_w_mode: bool) -> None:
    params = _params()
    expected = _reference_adam(params, 5, 0.01, (0.9, 0.999), 1e-8, 0.1, adam_w_mode, False)
    opt = _build("Adam", {"lr": 0.01, "weight_decay": 0.1, "bias_correction": False,
                                   "adam_w_mode": adam_w_mode}, params)
    for a, r in zip(_run(opt, params, 5), expected, strict=True):
        torch.testing.assert_close(a, r, rtol=1e-5, atol=1e-6)


def test_our_adam_with_bias_correction_equals_torch() -> None:
    from dslaunch.runtime.optim.adam import Adam

    ours_p, ref_p = _params(), _params()
    ours = _run(Adam(ours_p, lr=0.01, weight_decay=0.1), ours_p, 5)
    expected = _run(torch.optim.AdamW(ref_p, lr=0.01, weight_decay=0.1, foreach=False), ref_p, 5)
    for a, r in zip(ours, expected, strict=True):
        torch.testing.assert_close(a, r, rtol=1e-5, atol=1e-6)
    # a parameter that misses a step keeps its own step count (and bias correction)
    p, q = torch.ones(3, requires_grad=True), torch.ones(3, requires_grad=True)
    opt = Adam([p, q], lr=0.1)
    p.grad = torch.ones(3)
    opt.step()
    p.grad, q.grad = torch.ones(3), torch.ones(3)
    opt.step()
    assert (opt.state[p]["step"].item(), opt.state[q]["step"].item()) == (2.0, 1.0)
    torch.testing.assert_close(q.detach(), torch.full((3,), 0.9), rtol=0, atol=1e-6)


def test_lion_and_lamb_state_survive_state_dict_roundtrip() -> None:
    for cls in (Lion, Lamb):
        p1, p2 = _params(), _params()
        a = cls(p1, lr=0.01)
        _run(a, p1, 3)
        b = cls(p2, lr=0.01)
        _run(b, p2, 3)
        c_params = [p.detach().clone().requires_grad_() for p in p1]
        c = cls(c_params, lr=0.01)
        c.load_state_dict(copy.deepcopy(a.state_dict()))  # as if saved to disk
        # continue both a and c from the same state with the same grads
        for p, q, g in zip(p1, c_params, _grads(p1, 99), strict=True):
            p.grad, q.grad = g.clone(), g.clone()
        a.step()
        c.step()
        for p, q in zip(p1, c_params, strict=True):
            torch.testing.assert_close(p, q)


def test_other_torch_optimizers_by_exact_name_like_deepspeed() -> None:
    params = _params()
    opt = _build("RMSprop", {"lr": 0.01, "alpha": 0.9}, params)
    assert isinstance(opt, torch.optim.RMSprop) and opt.defaults["alpha"] == 0.9
    ref_p = _params()
    expected = _run(torch.optim.RMSprop(ref_p, lr=0.01, alpha=0.9), ref_p, 3)
    for a, r in zip(_run(opt, params, 3), expected, strict=True):
        torch.testing.assert_close(a, r)
    nadam = _build("NAdam", {"betas": [0.8, 0.99]}, _params())
    assert nadam.defaults["betas"] == (0.8, 0.99)
    with pytest.raises(ConfigError, match=r"'optimizer.params.alpah'.*did you mean 'alpha'"):
        validate_optimizer("RMSprop", {"alpah": 0.9})


def test_deepspeed_only_types_are_reported_as_not_implemented() -> None:
    with pytest.raises(ConfigError, match="accepted by DeepSpeed but not implemented"):
        validate_optimizer("MuAdam", {})
    with pytest.raises(ConfigError, match="must be a string"):
        validate_optimizer(3, {})


# ---------------------------------------------------------------- Lamb over flat (ZeRO) tensors


def _flat_lamb_run(rank: int, world: int, steps: int) -> list[float]:
    """One rank's shard of the flattened params, updated by Lamb with per-parameter segments."""
    import torch.distributed as dist

    from dslaunch.runtime.zero.partition import FlatLayout

    if world > 1:
        dist.init_process_group("gloo", rank=rank, world_size=world)
    params = _params()
    numels = [p.numel() for p in params]
    total = sum(numels)
    k = -(-total // world)  # the contract's partition rule
    start = min(rank * k, total)
    end = min(start + k, total)
    shard = torch.cat([p.detach().reshape(-1) for p in params])[start:end].clone().requires_grad_()
    reduce = (lambda t: dist.all_reduce(t)) if world > 1 else None
    opt = _build("Lamb", {"lr": 0.01, "weight_decay": 0.01}, [shard],
                          flat_layouts=[FlatLayout.of(numels, start, end)], norm_all_reduce=reduce)
    for step in range(steps):
        shard.grad = torch.cat([g.reshape(-1) for g in _grads(params, step)])[start:end].clone()
        opt.step()
    return shard.detach().tolist()


@pytest.mark.parametrize("world", [1, 2])
def test_lamb_on_flat_shards_matches_per_parameter_lamb(world: int) -> None:
    from tests.distributed import run_world

    expected = _reference_lamb(_params(), 4, 0.01, (0.9, 0.999), 1e-8, 0.01, 10.0, 0.01)
    shards = [_flat_lamb_run(0, 1, 4)] if world == 1 else run_world(_flat_lamb_run, world, 4)
    got = torch.tensor([x for shard in shards for x in shard])
    torch.testing.assert_close(got, torch.cat([p.reshape(-1) for p in expected]), rtol=1e-5, atol=1e-6)


def test_flat_lamb_without_segments_is_one_layer() -> None:
    # Guard that the segments matter: a flat tensor without them gets a different update.
    params = _params()
    flat = torch.cat([p.detach().reshape(-1) for p in params]).requires_grad_()
    opt = Lamb([flat], lr=0.01, weight_decay=0.01)
    for step in range(4):
        flat.grad = torch.cat([g.reshape(-1) for g in _grads(params, step)])
        opt.step()
    expected = _reference_lamb(_params(), 4, 0.01, (0.9, 0.999), 1e-8, 0.01, 10.0, 0.01)
    assert not torch.allclose(flat.detach(), torch.cat([p.reshape(-1) for p in expected]), rtol=1e-5, atol=1e-6)


def test_flat_layout_is_not_saved_in_the_optimizer_state() -> None:
    from dslaunch.runtime.zero.partition import FlatLayout

    flat = torch.zeros(12, requires_grad=True)
    opt = _build("Lamb", {}, [flat], flat_layouts=[FlatLayout.of([4, 3, 5], 0, 12)])
    flat.grad = torch.ones(12)
    opt.step()
    assert "segments" not in str(opt.state_dict()["param_groups"])
    # other optimizers accept (and ignore) the layout: their updates are elementwise
    _build("AdamW", {}, [torch.zeros(3, requires_grad=True)], flat_layouts=[None])


def test_lamb_empty_shard_still_joins_the_norm_reduction() -> None:
    from dslaunch.runtime.zero.partition import FlatLayout

    empty = torch.zeros(0, requires_grad=True)
    empty.grad = torch.zeros(0)
    reduced = []
    opt = Lamb([empty], flat_layouts=[FlatLayout.of([3, 4], 7, 7)], norm_all_reduce=reduced.append)
    opt.step()  # a rank holding nothing must not skip the collective, or its peers hang
    assert [tuple(t.shape) for t in reduced] == [(2, 2)]
