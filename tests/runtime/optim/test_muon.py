"""Muon (``optimizer.type: "Muon"``): Newton-Schulz against a plain-torch reference, the update rule
step by step, the Muon/AdamW split, config errors, and the engine at ZeRO 0-3 on 2 gloo ranks
against one process running the same optimizer over the model's own parameters."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from dslaunch.errors import ConfigError
from dslaunch.runtime.optim.muon import MuonWithAuxAdam, is_muon_param, newton_schulz, orthogonalized_update
from dslaunch.runtime.optim.registry import validate_optimizer
from tests.distributed import run_world
from tests.runtime.models import make_model
from tests.runtime.zero.equivalence import CLIP, GLOBAL, WD, batches, config, train_steps

A, B, C = 3.4445, -4.7750, 2.0315  # the quintic's coefficients (Keller Jordan's Muon)


def reference_orthogonalize(g: torch.Tensor, steps: int) -> torch.Tensor:
    """The quintic iteration written out as a polynomial in X X^T, on the wide orientation."""
    wide = g if g.shape[-2] <= g.shape[-1] else g.transpose(-2, -1)
    x = wide / (torch.linalg.matrix_norm(wide, keepdim=True) + 1e-7)
    for _ in range(steps):
        gram = torch.matmul(x, x.transpose(-2, -1))
        x = A * x + B * torch.matmul(gram, x) + C * torch.matmul(torch.matmul(gram, gram), x)
    return x if g.shape[-2] <= g.shape[-1] else x.transpose(-2, -1)


@pytest.mark.parametrize("shape", [(8, 24), (24, 8), (12, 12), (3, 6, 10)])
@pytest.mark.parametrize("method", ["standard", "gram"])
def test_newton_schulz_matches_the_reference(shape, method) -> None:
    g = torch.randn(*shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    for steps in (1, 2, 3, 5, 7):
        got = newton_schulz(g, steps, method)
        want = reference_orthogonalize(g, steps)
        assert got.dtype == torch.float64 and got.shape == g.shape
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    # and it orthogonalizes: after 5 steps every singular value is near 1 (0.5-1.5 by design)
    s = torch.linalg.svdvals(newton_schulz(g, 5, method))
    assert s.min() > 0.5 and s.max() < 1.5, s


def test_newton_schulz_fp32_on_cpu_keeps_float32_and_both_methods_agree() -> None:
    g = torch.randn(16, 48, generator=torch.Generator().manual_seed(2))
    standard, gram = newton_schulz(g, 5, "standard"), newton_schulz(g, 5, "gram")
    assert standard.dtype == gram.dtype == torch.float32
    torch.testing.assert_close(gram, standard, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(standard, reference_orthogonalize(g.double(), 5).float(), rtol=1e-4, atol=1e-4)


def _reference_muon_step(w, g, m, *, lr, beta, wd, steps):
    m.mul_(beta).add_(g, alpha=1 - beta)
    u = g * (1 - beta) + m * beta  # Nesterov
    view = u.reshape(u.shape[0], -1) if u.dim() == 4 else u
    o = reference_orthogonalize(view, steps).reshape(u.shape) * max(1.0, u.shape[-2] / u.shape[-1]) ** 0.5
    w.mul_(1 - lr * wd).sub_(lr * o)


def test_muon_steps_follow_the_rule_and_the_rest_is_adamw() -> None:
    gen = torch.Generator().manual_seed(3)
    shapes = [(6, 10), (10, 6), (4, 3, 2, 2), (7,)]
    params = [torch.nn.Parameter(torch.randn(*s, generator=gen, dtype=torch.float64)) for s in shapes]
    plain = [p.detach().clone() for p in params[:3]]
    adam_ref = torch.nn.Parameter(params[3].detach().clone())
    opt = MuonWithAuxAdam([{"params": params[:3], "use_muon": True, "lr": 0.05, "momentum": 0.9,
                            "weight_decay": 0.1},
                           {"params": params[3:], "use_muon": False, "lr": 0.01, "weight_decay": 0.1}])
    torch_adamw = torch.optim.AdamW([adam_ref], lr=0.01, betas=(0.9, 0.95), eps=1e-10, weight_decay=0.1)
    moms = [torch.zeros_like(w) for w in plain]
    for _ in range(4):
        grads = [torch.randn(*s, generator=gen, dtype=torch.float64) for s in shapes]
        for p, g in zip(params, grads, strict=True):
            p.grad = g.clone()
        adam_ref.grad = grads[3].clone()
        opt.step()
        torch_adamw.step()
        for w, g, m in zip(plain, grads, moms, strict=False):
            _reference_muon_step(w, g, m, lr=0.05, beta=0.9, wd=0.1, steps=5)
    for p, w in zip(params, plain, strict=False):
        torch.testing.assert_close(p.detach(), w, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(params[3].detach(), adam_ref.detach(), rtol=1e-10, atol=1e-12)
    assert set(opt.state[params[0]]) == {"momentum_buffer"}
    assert set(opt.state[params[3]]) == {"step", "exp_avg", "exp_avg_sq"}


def test_which_parameters_get_muon() -> None:
    model = torch.nn.ModuleDict({"embed_tokens": torch.nn.Embedding(5, 4), "lm_head": torch.nn.Linear(4, 5),
                                 "proj": torch.nn.Linear(4, 4), "norm": torch.nn.LayerNorm(4)})
    chosen = {n for n, p in model.named_parameters() if is_muon_param(n, p)}
    assert chosen == {"proj.weight"}
    model["proj"].weight.use_muon = False
    model["lm_head"].weight.use_muon = True  # the user's flag wins
    assert {n for n, p in model.named_parameters() if is_muon_param(n, p)} == {"lm_head.weight"}
    with pytest.raises(ValueError, match="1 or more|at least 2|2 or more"):
        orthogonalized_update(torch.zeros(3))


@pytest.mark.parametrize(("params", "key", "words"), [
    ({"nesterv": False}, "optimizer.params.nesterv", "did you mean 'nesterov'"),
    ({"lr": -0.1}, "optimizer.params.lr", ""),
    ({"muon_lr": "fast"}, "optimizer.params.muon_lr", ""),
    ({"adam_lr": 0}, "optimizer.params.adam_lr", ""),
    ({"momentum": 1.0}, "optimizer.params.momentum", ""),
    ({"ns_method": "svd"}, "optimizer.params.ns_method", "gram"),
    ({"ns_steps": 0}, "optimizer.params.ns_steps", ""),
])
def test_config_errors_name_the_key(params, key, words) -> None:
    with pytest.raises(ConfigError) as e:
        validate_optimizer("Muon", params)
    line = str(e.value)
    assert key in line and words in line and "\n" not in line


def test_config_defaults_and_offload_refused() -> None:
    from dslaunch.runtime.config.ds_config import load_config

    spec = validate_optimizer("muon", {"lr": 1e-3, "adam_lr": 1e-4})
    assert spec.name == "Muon" and spec.params["momentum"] == 0.95 and spec.params["ns_method"] == "gram"
    with pytest.raises(ConfigError, match="zero_optimization.offload_optimizer"):
        load_config({"train_batch_size": 1, "optimizer": {"type": "Muon"},
                     "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}, 1)


MUON_LR, ADAM_LR, MUON_STEPS = 0.02, 3e-3, 8
MUON = {"type": "Muon", "params": {"muon_lr": MUON_LR, "adam_lr": ADAM_LR, "weight_decay": WD,
                                   "ns_method": "standard"}}


def reference_weights(steps: int, split: int = 1) -> dict[str, torch.Tensor]:
    """One process, the model's own parameters, the whole global batch, the same clipping.
    ``split``: the batch's gradient summed over that many equal micro-batches (the same sum in
    another fp32 order, as ranks and accumulation make it)."""
    model = make_model()
    named = list(model.named_parameters())
    opt = MuonWithAuxAdam([
        {"params": [p for n, p in named if is_muon_param(n, p)], "use_muon": True, "lr": MUON_LR,
         "weight_decay": WD, "ns_method": "standard"},
        {"params": [p for n, p in named if not is_muon_param(n, p)], "use_muon": False, "lr": ADAM_LR,
         "weight_decay": WD}])
    micro = GLOBAL // split
    for tokens, labels in batches(steps, GLOBAL):
        for lo in range(0, GLOBAL, micro):
            (model(tokens[lo:lo + micro], labels[lo:lo + micro]) / split).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _max_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max((_comparable(n, a[n]) - _comparable(n, b[n])).abs().max().item() for n in a)


def _engine_weights(rank: int, world: int, stages: list[int]) -> list[dict[str, Any]]:
    import dslaunch
    from dslaunch.utils import safe_get_full_fp32_param

    out = []
    for stage in stages:
        engine, _, _, _ = dslaunch.initialize(model=make_model(), config=config(stage, optimizer=MUON))
        train_steps(engine, rank, world, batches(MUON_STEPS, GLOBAL))
        # numpy: tensors do not survive the rank's exit
        out.append({n: safe_get_full_fp32_param(p).numpy().copy() for n, p in engine.module.named_parameters()})
    return out


def _comparable(name: str, t: torch.Tensor) -> torch.Tensor:
    # Attention's key bias gets a zero gradient (softmax ignores a shift): AdamW turns the ~1e-9
    # rounding noise there into lr-sized steps, different for any other summation order.
    return torch.cat([t[:16], t[32:]]) if name == "block.self_attn.in_proj_bias" else t


@pytest.mark.timeout(180)
def test_engine_zero_stages_match_one_process_muon() -> None:
    want = reference_weights(MUON_STEPS)
    start = {n: p.detach() for n, p in make_model().named_parameters()}
    assert min((want[n] - start[n]).abs().max().item() for n in want) > 1e-3  # every parameter moved
    # The bound is measured, not guessed: the same global gradient summed in another fp32 order (2
    # and 4 micro-batches, as 2 ranks x 2 accumulation steps make it) already moves weights ~1e-6
    # after 8 steps, since Newton-Schulz amplifies rounding. A wrong step moves them by ~lr (2e-2).
    floor = max(_max_difference(want, reference_weights(MUON_STEPS, split)) for split in (2, 4))
    assert 0 < floor < 1e-4, floor
    bound = 4 * floor
    stages = [0, 1, 2, 3]
    for rank_weights in run_world(_engine_weights, 2, stages, timeout=170):
        for stage, got in zip(stages, rank_weights, strict=True):
            assert got.keys() == want.keys()
            for name in want:
                torch.testing.assert_close(_comparable(name, torch.from_numpy(got[name])), _comparable(name, want[name]),
                                           rtol=0, atol=bound, msg=lambda m, s=stage, n=name: f"stage {s}, {n}: {m}")


def test_deepspeed_import_paths() -> None:
    from dslaunch.runtime.zero.muon.muon_optimizer import MuonWithAuxAdam as FromOptimizer
    from dslaunch.runtime.zero.muon.original_muon import muon_update, zeropower_via_gram_newtonschulz

    assert FromOptimizer is MuonWithAuxAdam
    gen = torch.Generator().manual_seed(4)
    g, m = torch.randn(6, 9, generator=gen, dtype=torch.float64), torch.randn(6, 9, generator=gen, dtype=torch.float64)
    grad, momentum = g.clone(), m.clone()
    update = muon_update(grad, momentum, beta=0.9)
    want_m = 0.9 * m + 0.1 * g
    torch.testing.assert_close(momentum, want_m)
    torch.testing.assert_close(update, reference_orthogonalize(0.1 * g + 0.9 * want_m, 5), rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(zeropower_via_gram_newtonschulz(g, 5), reference_orthogonalize(g, 5))


def _resume(rank: int, world: int, save_dir: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """3 steps, a checkpoint, 3 more; a new engine loads it and trains the same 3."""
    import dslaunch
    from dslaunch.utils import safe_get_full_fp32_param

    def whole(engine) -> dict[str, Any]:
        return {n: safe_get_full_fp32_param(p).numpy().copy() for n, p in engine.module.named_parameters()}

    data = batches(6, GLOBAL)
    cfg = config(2, optimizer=MUON)
    first, _, _, _ = dslaunch.initialize(model=make_model(), config=cfg)
    assert [n for n, p in first.module.named_parameters() if p.use_muon] == [
        "block.self_attn.in_proj_weight", "block.self_attn.out_proj.weight", "block.linear1.weight",
        "block.linear2.weight", "head.weight"]  # set by initialize, as DeepSpeed's
    train_steps(first, rank, world, data[:3])
    first.save_checkpoint(save_dir)
    train_steps(first, rank, world, data[3:])
    second, _, _, _ = dslaunch.initialize(model=make_model(seed=1), config=cfg)
    second.load_checkpoint(save_dir)
    train_steps(second, rank, world, data[3:])
    return whole(first), whole(second)


@pytest.mark.timeout(120)
def test_zero2_checkpoint_resumes_muon_bitwise(tmp_path) -> None:
    for straight, resumed in run_world(_resume, 2, str(tmp_path)):
        for name in straight:
            assert (straight[name] == resumed[name]).all(), name
