"""What client code may call around the training loop, and when: DeepSpeed's rules or a clear error.

optimizer.zero_grad() / engine.zero_grad() anywhere, no_sync() misuse, the engine's nn.Module state
dict (module weights under ``module.``, as DeepSpeed's), and get_global_grad_norm() wherever
DeepSpeed computes it. All at 2 gloo ranks, where a rank-local mistake would show.
"""

from __future__ import annotations

import contextlib
import io

import pytest
import torch

from dslaunch.errors import ConfigError, UsageError
from tests.distributed import run_world
from tests.runtime.models import batches, make_model

MICRO, LR = 2, 1e-2


def _cfg(stage: int, gas: int = 2, **extra) -> dict:
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": gas,
            "steps_per_print": 1000, "optimizer": {"type": "AdamW", "params": {"lr": LR}},
            "zero_optimization": {"stage": stage, "reduce_bucket_size": 300,
                                  "allgather_bucket_size": 200, "overlap_comm": True},
            **extra}


def _mine(rank: int, world: int, i: int, step: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Micro batch i of this rank from global batch ``step``."""
    tokens, labels = batches(step + 1, MICRO * world * 2)[step]
    lo = (i * world + rank) * MICRO
    return tokens[lo:lo + MICRO], labels[lo:lo + MICRO]


def _weights(engine) -> list[float]:
    engine.zero.synchronize()
    return torch.cat([p.detach().float().flatten() for p in engine.module.parameters()]).tolist()


def _error(fn) -> str:
    try:
        fn()
    except UsageError as err:
        return str(err)
    return "no error"


# ----- zero_grad anywhere ----------------------------------------------------------------------
def _train(rank: int, world: int, stage: int, client_zero_grad: bool) -> list[list[float]]:
    import dslaunch

    engine, optimizer, _, _ = dslaunch.initialize(model=make_model(), config=_cfg(stage))
    seen = [_weights(engine)]
    for step in range(3):
        for i in range(2):
            if client_zero_grad:
                optimizer.zero_grad()  # torch's default: .grad = None
            engine.backward(engine(*_mine(rank, world, i, step)))
            if client_zero_grad:
                optimizer.zero_grad(set_to_none=False)  # in place, between backward and step
            engine.step()
        if client_zero_grad:  # after the optimizer step, as torch loops do
            engine.zero_grad()
            optimizer.zero_grad()
        seen.append(_weights(engine))
    return seen


def _zero_grad_runs(rank: int, world: int) -> dict[int, tuple]:
    return {stage: (_train(rank, world, stage, False), _train(rank, world, stage, True))
            for stage in (0, 1, 2)}


@pytest.mark.timeout(90)
def test_client_zero_grad_anywhere_trains_identically() -> None:
    """optimizer.zero_grad() (None or in place) before forward and between backward and step, and
    engine.zero_grad() after the boundary step, change nothing at stages 0, 1 and 2."""
    for by_stage in run_world(_zero_grad_runs, 2):
        for stage, (plain, with_calls) in by_stage.items():
            assert with_calls == plain, f"stage {stage}"
            assert all(a != b for a, b in zip(plain, plain[1:], strict=False)), f"stage {stage} trains"


# ----- no_sync -----------------------------------------------------------------------------------
def _no_sync_rules(rank: int, world: int, stage: int) -> dict:
    import dslaunch

    out = {}
    engine, _, _, _ = dslaunch.initialize(model=make_model(), config=_cfg(stage))
    before = _weights(engine)
    with engine.no_sync():
        engine.backward(engine(*_mine(rank, world, 0)))
        engine.step()  # not a boundary: only counts the micro step
        engine.backward(engine(*_mine(rank, world, 1)))
        out["step_inside"] = _error(engine.step)
        try:
            with engine.no_sync():
                pass
            out["nested"] = "no error"
        except UsageError as err:
            out["nested"] = str(err)
            out["asserts"] = isinstance(err, AssertionError)
    out["step_after"] = _error(engine.step)  # the boundary backward ran inside: still unreduced
    out["untouched"] = _weights(engine) == before and engine.global_steps == 0

    single, _, _, _ = dslaunch.initialize(model=make_model(), config=_cfg(stage, gas=1))
    with single.no_sync():  # DeepSpeed's own test: every step is a boundary at gas 1
        single.backward(single(*_mine(rank, world, 0)))
        out["gas1"] = _error(single.step)

    # The DDP pattern: accumulate locally inside no_sync, reduce with the boundary backward.
    runs = []
    for use_no_sync in (True, False):
        e, _, _, _ = dslaunch.initialize(model=make_model(), config=_cfg(stage))
        with e.no_sync() if use_no_sync else contextlib.nullcontext():
            e.backward(e(*_mine(rank, world, 0)))
            e.step()
        e.backward(e(*_mine(rank, world, 1)))
        e.step()
        runs.append((_weights(e), e.global_steps))
    out["ddp_pattern"] = runs
    return out


def _no_sync_refused(rank: int, world: int, stage: int) -> tuple[str, bool]:
    import dslaunch

    engine, _, _, _ = dslaunch.initialize(model=make_model(), config=_cfg(stage))
    try:
        with engine.no_sync():
            pass
    except UsageError as err:
        return str(err), isinstance(err, AssertionError)
    return "no error", False


def _no_sync_all(rank: int, world: int) -> list[dict]:
    out = [_no_sync_rules(rank, world, stage) for stage in (0, 1)]
    out[0]["refused"] = [_no_sync_refused(rank, world, stage) for stage in (2, 3)]
    return out


@pytest.mark.timeout(90)
def test_boundary_step_inside_no_sync_raises() -> None:
    for per_stage in run_world(_no_sync_all, 2):
        for out in per_stage:
            assert "inside no_sync context manager" in out["step_inside"] and "diverge" in out["step_inside"]
            assert "reentry is unsupported" in out["nested"]
            assert "never reduced" in out["step_after"]
            assert out["untouched"]  # the refused steps changed nothing
            assert "inside no_sync context manager" in out["gas1"]
            assert out["asserts"]  # also an AssertionError, as DeepSpeed asserts
            (with_ctx, steps_a), (plain, steps_b) = out["ddp_pattern"]
            assert with_ctx == plain and steps_a == steps_b == 1
        for msg, asserts in per_stage[0]["refused"]:  # stages 2 and 3
            assert msg.startswith("no_sync context manager is incompatible with ZeRO stages 2 and 3") and asserts


# ----- state_dict like DeepSpeed's nn.Module engine ----------------------------------------------
def _state_dicts(rank: int, world: int, stage: int, precision: dict, export: str) -> dict:
    import dslaunch

    cfg = _cfg(stage, gas=1, **precision)
    model = make_model()
    model.head.bias.requires_grad_(False)  # a frozen parameter, for exclude_frozen_parameters
    engine, _, _, _ = dslaunch.initialize(model=model, config=cfg)
    for step in range(2):
        engine.backward(engine(*_mine(rank, world, 0, step)))
        engine.step()
    out = {}
    sd = engine.state_dict()
    module_sd = engine.module.state_dict()
    out["prefixed"] = sorted(sd) == sorted(f"module.{k}" for k in module_sd)
    plain = engine.module_state_dict()
    out["module_sd"] = (list(plain) == list(module_sd)
                        and all(torch.equal(plain[k], module_sd[k]) for k in plain))
    out["without_frozen"] = sorted(set(module_sd) - set(engine.module_state_dict(exclude_frozen_parameters=True)))
    engine.save_16bit_model(export, exclude_frozen_parameters=True)  # DeepSpeed's engine signature
    out["exported"] = sorted(torch.load(f"{export}/pytorch_model.bin", weights_only=True))
    saved = io.BytesIO()
    torch.save(engine.state_dict(), saved)
    trained = {k: v.clone() for k, v in module_sd.items()}

    # A different model loads the file; a twin built from the same weights before initialize()
    # takes the same next step. Equal only if the load reached the fp32 masters (16-bit).
    other, _, _, _ = dslaunch.initialize(model=make_model(seed=3), config=cfg)
    keys = other.load_state_dict(torch.load(io.BytesIO(saved.getvalue()), weights_only=True))
    out["keys"] = (keys.missing_keys, keys.unexpected_keys)
    out["loaded"] = all(torch.equal(p, trained[n]) for n, p in other.module.named_parameters())
    twin_model = make_model(seed=3)
    twin_model.load_state_dict({k: v.float() for k, v in trained.items()})
    twin, _, _, _ = dslaunch.initialize(model=twin_model, config=cfg)
    for e in (other, twin):
        e.backward(e(*_mine(rank, world, 0, 2)))
        e.step()
    out["next_step_equal"] = _weights(other) == _weights(twin)
    out["assign"] = _error(lambda: other.load_state_dict(sd, assign=True))
    return out


def _state_dict_all(rank: int, world: int, root: str) -> list[dict]:
    return [_state_dicts(rank, world, stage, precision, f"{root}/{i}")
            for i, (stage, precision) in enumerate(((0, {}), (2, {"bf16": {"enabled": True}}),
                                                    (1, {"fp16": {"enabled": True, "initial_scale_power": 8}})))]


@pytest.mark.timeout(90)
def test_state_dict_is_the_module_under_a_prefix(tmp_path) -> None:
    """torch.save(engine.state_dict()) / engine.load_state_dict(...) round-trip the weights, as in
    DeepSpeed; at 16 bits the loaded weights also survive the next step."""
    for per_case in run_world(_state_dict_all, 2, str(tmp_path)):
        for out in per_case:
            assert out["prefixed"] and out["module_sd"] and out["loaded"]
            assert out["without_frozen"] == ["head.bias"]
            assert "head.bias" not in out["exported"] and "head.weight" in out["exported"]
            assert out["keys"] == ([], [])
            assert out["next_step_equal"]
            assert "assign=True" in out["assign"]


# ----- get_global_grad_norm ----------------------------------------------------------------------
_NORM_CASES = {  # name -> (stage, config extras); DeepSpeed computes the norm for all but the first
    "stage0-fp32": (0, {"gradient_clipping": 0.0}),  # (the default, 1.0, clips as DeepSpeed 0.19.8's)
    "stage0-fp32-clip": (0, {"gradient_clipping": 100.0}),
    "stage0-bf16": (0, {"bf16": {"enabled": True}}),
    "stage0-fp16": (0, {"fp16": {"enabled": True, "initial_scale_power": 8}}),
    "stage1-fp32": (1, {}),
    "stage2-fp32": (2, {}),
    "stage2-bf16": (2, {"bf16": {"enabled": True}}),
}


def _norms(rank: int, world: int) -> dict:
    import dslaunch

    out = {}
    for name, (stage, extra) in _NORM_CASES.items():
        engine, _, _, _ = dslaunch.initialize(model=make_model(), config=_cfg(stage, gas=1, **extra))
        out[f"{name}-before"] = engine.get_global_grad_norm()
        engine.backward(engine(*_mine(rank, world, 0)))
        engine.step()
        out[name] = engine.get_global_grad_norm()
    return out


def _reference_norm(world: int) -> float:
    """Single process, the whole global batch: the norm of the gradient the ranks average."""
    model = make_model()
    tokens, labels = batches(1, MICRO * world * 2)[0]
    model(tokens[:MICRO * world], labels[:MICRO * world]).backward()
    return torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in model.parameters()])).item()


@pytest.mark.timeout(90)
def test_global_grad_norm_where_deepspeed_computes_it() -> None:
    want = _reference_norm(2)
    for out in run_world(_norms, 2):
        assert out["stage0-fp32"] is None  # DeepSpeed: plain fp32 data parallel has no norm
        for name in _NORM_CASES:
            assert out[f"{name}-before"] is None
            if name != "stage0-fp32":
                rtol = 1e-5 if "16" not in name else 5e-2  # 16-bit forward and gradients
                assert abs(out[name] - want) <= rtol * want, (name, out[name], want)


def _client_optimizer_outcome(client, allow: bool) -> str:
    import dslaunch

    model = make_model(0)
    cfg = {"train_micro_batch_size_per_gpu": MICRO, "zero_optimization": {"stage": 0},
           "zero_allow_untested_optimizer": allow}
    opt = client(model.parameters()) if isinstance(client, type) else client
    try:
        engine, optimizer, *_ = dslaunch.initialize(model=model, optimizer=opt, config=cfg,
                                                    dist_init_required=False)
    except Exception as exc:  # the message is the assertion's subject
        kind = "ConfigError" if isinstance(exc, ConfigError) and isinstance(exc, AssertionError) else type(exc).__name__
        return f"{kind}: {exc}"  # (also an AssertionError, as DeepSpeed asserts)
    return type(optimizer).__name__


@pytest.mark.timeout(60)
def test_untested_client_optimizers_need_the_config_switch_at_every_stage() -> None:
    refused = _client_optimizer_outcome(torch.optim.Adafactor, allow=False)
    assert refused.startswith("ConfigError: 'zero_allow_untested_optimizer': client optimizer "
                              "torch.optim.Adafactor is untested"), refused
    assert "element-wise" in refused and "SGD" in refused
    from_callable = _client_optimizer_outcome(lambda groups: torch.optim.Adafactor(groups), allow=False)
    assert from_callable.startswith("ConfigError: 'zero_allow_untested_optimizer'"), from_callable
    assert _client_optimizer_outcome(torch.optim.Adafactor, allow=True) == "Adafactor"
    assert _client_optimizer_outcome(torch.optim.SGD, allow=False) == "SGD"
    from dslaunch.ops.adagrad import DeepSpeedCPUAdagrad
    from dslaunch.ops.adam import DeepSpeedCPUAdam, FusedAdam
    from dslaunch.ops.lion import DeepSpeedCPULion

    for deepspeeds in (FusedAdam, DeepSpeedCPUAdam, DeepSpeedCPUAdagrad, DeepSpeedCPULion):  # element-wise too
        assert _client_optimizer_outcome(deepspeeds, allow=False) == deepspeeds.__name__


# ----- loss.backward() instead of engine.backward(loss) --------------------------------------------
def _plain_backward(rank: int, world: int) -> dict:
    import dslaunch
    from dslaunch.utils import safe_get_full_grad

    out: dict = {}
    for stage in (0, 1, 2, 3):
        runs = []
        for how in ("engine", "plain", "scaled"):
            engine, *_ = dslaunch.initialize(model=make_model(), config=_cfg(stage))
            grads = []
            for i in range(2):  # one optimizer step of two micro steps
                loss = engine(*_mine(rank, world, i))
                if how == "engine":
                    engine.backward(loss)
                else:  # divided by the accumulation steps by the forward's hooks, as DeepSpeed 0.19
                    (engine.scale(loss) if how == "scaled" else loss).backward()
                # read right after backward: already reduced across ranks
                grads.append([safe_get_full_grad(p).sum().item() for p in engine.module.parameters()])
                engine.step()
            runs.append((_weights(engine), grads))
        out[stage] = runs
    fp16 = {**_cfg(0), "fp16": {"enabled": True, "initial_scale_power": 4}}
    engine, *_ = dslaunch.initialize(model=make_model(), config=fp16)
    out["fp16"] = _error(lambda: engine(*_mine(rank, world, 0)).backward())
    scaled_runs = []
    for scaled in (False, True):
        engine, *_ = dslaunch.initialize(model=make_model(), config=fp16)
        for i in range(2):
            loss = engine(*_mine(rank, world, i))
            engine.scale(loss).backward() if scaled else engine.backward(loss)
            engine.step()
        scaled_runs.append(_weights(engine))
    out["fp16 scaled"] = scaled_runs
    return out


@pytest.mark.timeout(180)
def test_plain_loss_backward_trains_as_engine_backward_at_every_stage() -> None:
    """DeepSpeed 0.19's torch-style backward: loss.backward() (or engine.scale(loss).backward()) on
    the forward's output, then engine.step(), trains bit for bit as engine.backward(loss) at ZeRO
    0-3 with gradient accumulation: the gradient is divided by the accumulation steps and reduced
    across ranks when autograd finishes (safe_get_full_grad reads the reduced one at once). With
    fp16 an unscaled loss.backward() is refused in one line naming engine.scale."""
    results = run_world(_plain_backward, 2)
    for out in results:
        for stage in (0, 1, 2, 3):
            with_engine, plain, scaled = out[stage]
            assert plain == with_engine and scaled == with_engine, f"stage {stage}"
        assert "Loss scaling is required" in out["fp16"] and "engine.scale(loss).backward()" in out["fp16"], out["fp16"]
        unscaled, scaled = out["fp16 scaled"]
        torch.testing.assert_close(torch.tensor(scaled), torch.tensor(unscaled), rtol=0, atol=2e-3)
    for stage in (0, 1, 2, 3):  # the ranks agree (each saw different data): weights, reduced gradients
        (weights0, grads0), (weights1, grads1) = results[0][stage][1], results[1][stage][1]
        assert weights0 == weights1 and grads0[1] == grads1[1], f"stage {stage}"
        if stage < 2:  # before the boundary each rank keeps its own (stages 2-3 reduce every micro step)
            assert grads0[0] != grads1[0], f"stage {stage}"


# ----- default gradient clipping ---------------------------------------------------------------------
def _sgd_step_norms(rank: int, world: int) -> dict:
    import dslaunch

    out = {}
    for stage in (0, 2):
        for extra in ({}, {"gradient_clipping": 0.0}):
            torch.manual_seed(0)
            model = torch.nn.Linear(8, 1)
            cfg = {"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "SGD", "params": {"lr": 1.0}},
                   "zero_optimization": {"stage": stage}, **extra}
            engine, *_ = dslaunch.initialize(model=model, config=cfg)
            before = torch.cat([p.detach().flatten().clone() for p in engine.module.parameters()])
            engine.backward(engine(torch.full((4, 8), 30.0)).pow(2).mean() * 100)
            engine.step()
            after = torch.cat([p.detach().flatten() for p in engine.module.parameters()])
            out[(stage, bool(extra))] = torch.linalg.vector_norm(after - before).item()
    return out


@pytest.mark.timeout(60)
def test_gradients_are_clipped_at_1_by_default_as_deepspeed_0_19_8() -> None:
    """No gradient_clipping key: an SGD step (lr 1) of a huge gradient moves the weights by 1, as
    DeepSpeed 0.19.8 (GRADIENT_CLIPPING_DEFAULT = 1.0); gradient_clipping 0 switches it off."""
    norms = run_world(_sgd_step_norms, 2)[0]
    for stage in (0, 2):
        assert norms[(stage, False)] == pytest.approx(1.0, rel=1e-5)
        assert norms[(stage, True)] > 100
