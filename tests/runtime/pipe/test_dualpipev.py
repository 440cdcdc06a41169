"""DualPipeV on real gloo ranks (``DualPipeVModule``, ``DualPipeVEngine``) against the same layers
trained in one process: 2 ranks (4 stages), 2 ranks x 2 replicas with ZeRO-1, 4 ranks (8 stages),
ZeRO-2 with activation checkpointing, fp16 and bf16 (loosely);
the first and last layers tied on rank 0; ``eval_batch``; a checkpoint's round trip and its load
into a plain ``PipelineModule``; the refusals, one line each."""

from __future__ import annotations

import pytest
import torch

from tests.distributed import run_world
from tests.runtime.pipe import helpers
from tests.runtime.pipe.test_tied import SEED as TIED_SEED
from tests.runtime.pipe.test_tied import _reference, _specs

pytestmark = pytest.mark.timeout(180)

STEPS, LR = 8, 0.1


def _module(stages: int, blocks: int = 2, seed: int = helpers.BASE_SEED, layers: list | None = None):
    from dslaunch.pipe import DualPipeVModule

    return DualPipeVModule(layers or helpers.layers(blocks), num_stages=stages, loss_fn=helpers.loss_fn,
                           seed_layers=True, base_seed=seed, partition_method="type:linear")


def _weights(engine) -> dict[int, list]:
    out: dict[int, list] = {}
    for name, p in engine.module_state_dict().items():
        out.setdefault(name.split(".")[0] if name.startswith("tied") else int(name.split(".")[0]), []).append(
            p.float().tolist())
    return out


def _train(rank: int, world: int, stages: int, gas: int, zero: int, blocks: int, extra: dict | None = None) -> dict:
    import dslaunch

    dslaunch.init_distributed(verbose=False)
    cfg = helpers.config(gas, LR, **{"zero_optimization": {"stage": zero}, **(extra or {})})
    engine, *_ = dslaunch.initialize(model=_module(stages, blocks), config=cfg)
    data = helpers.replica_iter(STEPS, gas, world // stages, engine.grid.get_data_parallel_rank())
    losses = [engine.train_batch(data).item() for _ in range(STEPS)]
    module = engine.module
    parts = [module.placement.part(engine.stage_id, c) for c in (0, 1)]
    assert module.phase_bounds == [(module.parts[p], module.parts[p + 1]) for p in parts]  # DeepSpeed's names
    first = module.chunk_funcs[1][0]  # the second stage's first layer: a Linear
    x = torch.ones(1, first.in_features, dtype=first.weight.dtype)
    with torch.no_grad():
        module.activate_phase(1)
        assert torch.equal(module(x), module(x, chunk=1))
        module.activate_phase(0)
    return {"losses": losses, "layers": _weights(engine), "type": type(engine).__name__, "parts": parts,
            "first": engine.is_first_stage(), "last": engine.is_last_stage(), "steps": engine.global_steps,
            "micro": engine.micro_steps}


def _check_against_one_process(got: list[dict], stages: int, gas: int, dp: int, blocks: int) -> None:
    helpers.check_against_one_process(got, "DualPipeVEngine", STEPS, gas, dp, LR, blocks=blocks, weights_atol=1e-6)
    for r in got:  # the V: rank r holds stages r and 2 * stages - 1 - r; rank 0 reads and computes the loss
        stage = r["parts"][0]
        assert r["parts"] == [stage, 2 * stages - 1 - stage]
        assert r["first"] == r["last"] == (stage == 0)


@pytest.mark.parametrize("stages, world, gas, zero, blocks", [
    (2, 2, 4, 0, 2),   # 4 stages of 5 Linear layers on 2 ranks
    (2, 4, 5, 1, 2),   # 2 replicas, ZeRO-1 on the data axis, 5 micro batches
    (4, 4, 8, 0, 5),   # 8 stages, one Linear each
])
def test_train_batch_matches_one_process(stages: int, world: int, gas: int, zero: int, blocks: int) -> None:
    got = run_world(_train, world, stages, gas, zero, blocks, timeout=170)
    _check_against_one_process(got, stages, gas, world // stages, blocks)


def test_activation_checkpointing_and_zero2_change_nothing() -> None:
    extra = {"pipeline": {"activation_checkpoint_interval": 1}, "zero_optimization": {"stage": 2}}
    _check_against_one_process(run_world(_train, 2, 2, 4, 2, 2, extra, timeout=170), 2, 4, 1, 2)


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_16bit_training_follows_one_process_loosely(precision: str) -> None:
    extra = {precision: {"enabled": True, **({"initial_scale_power": 8} if precision == "fp16" else {})}}
    got = run_world(_train, 2, 2, 4, 1, 2, extra, timeout=170)
    want, _ = helpers.reference(STEPS, 4, 1, LR)
    for r in got:
        assert r["losses"] == pytest.approx(want, rel=3e-2)  # 16-bit activations and weights
        assert r["losses"] == got[0]["losses"]


def _tied(rank: int, world: int) -> dict:
    import dslaunch
    from dslaunch.pipe import DualPipeVModule

    dslaunch.init_distributed(verbose=False)
    module = DualPipeVModule(_specs(), num_stages=2, loss_fn=helpers.loss_fn, seed_layers=True, base_seed=TIED_SEED,
                             partition_method="uniform")
    engine, *_ = dslaunch.initialize(model=module, config=helpers.config(4, LR))
    data = helpers.replica_iter(STEPS, 4, 1, 0)
    losses = [engine.train_batch(data).item() for _ in range(STEPS)]
    return {"losses": losses, "ties": dict(module.tied_comms), "weights": _weights(engine)}


def test_layers_tied_between_the_first_and_last_stage_are_one_module_on_rank_0() -> None:
    """No tie group (both uses are on rank 0); the one module's two gradients add up as in one process."""
    got = run_world(_tied, 2, timeout=170)
    want, (tied, _), _ = _reference(STEPS)  # 4 micro batches a step, as here
    for r in got:
        assert r["ties"] == {}
        assert r["losses"] == pytest.approx(want, rel=0, abs=1e-6)
    torch.testing.assert_close(torch.tensor(got[0]["weights"]["tied_modules"][0]), torch.tensor(tied), rtol=0,
                               atol=1e-6)


def _eval(rank: int, world: int) -> dict:
    import dslaunch
    from dslaunch.errors import UsageError

    dslaunch.init_distributed(verbose=False)
    engine, *_ = dslaunch.initialize(model=_module(2), config=helpers.config(4, LR))
    loss = engine.eval_batch(iter(helpers.micro_batches(0, 4))).item()
    loss6, logits = engine.eval_batch(iter(helpers.micro_batches(1, 6)), return_logits=True, num_micro_batches=6)
    errors = helpers.error_lines([lambda: engine.eval_batch(iter(helpers.micro_batches(0, 3)), num_micro_batches=3)],
                                 UsageError)
    trained = engine.train_batch(iter(helpers.micro_batches(0, 4))).item()  # eval left nothing behind
    return {"loss": loss, "loss6": loss6.item(), "logits": None if logits is None else logits.tolist(),
            "errors": errors, "trained": trained}


def test_eval_batch_matches_one_process_and_returns_rank_0s_logits() -> None:
    got = run_world(_eval, 2, timeout=170)
    mods = []
    for idx, spec in enumerate(helpers.layers()):
        torch.manual_seed(helpers.BASE_SEED + idx)
        mods.append(spec.build())
    model = torch.nn.Sequential(*mods)
    with torch.no_grad():
        want = torch.stack([helpers.loss_fn(model(x), y) for x, y in helpers.micro_batches(0, 4)]).mean().item()
        batches = helpers.micro_batches(1, 6)
        want6 = torch.stack([helpers.loss_fn(model(x), y) for x, y in batches]).mean().item()
        logits = torch.cat([model(x) for x, _ in batches])
    for r in got:
        assert r["loss"] == pytest.approx(want, abs=1e-6) and r["loss6"] == pytest.approx(want6, abs=1e-6)
        assert r["trained"] == pytest.approx(want, abs=1e-6)  # the first training batch: the same weights
        assert r["errors"] == ["eval_batch(num_micro_batches=3): DualPipeV needs at least 2 * 2 micro batches "
                               "(twice the pipeline stages)"]
    torch.testing.assert_close(torch.tensor(got[0]["logits"]), logits, rtol=0, atol=1e-6)
    assert got[1]["logits"] is None


def _checkpoint(rank: int, world: int, root: str) -> dict:
    import dslaunch
    from dslaunch.pipe import PipelineModule

    dslaunch.init_distributed(verbose=False)
    cfg = helpers.config(4, 0.01, optimizer={"type": "AdamW", "params": {"lr": 0.01}})
    data = helpers.replica_iter(8, 4, 1, 0)
    engine, *_ = dslaunch.initialize(model=_module(2), config=cfg)
    [engine.train_batch(data) for _ in range(4)]
    engine.save_checkpoint(root)
    straight = [engine.train_batch(data).item() for _ in range(4)]
    resumed, *_ = dslaunch.initialize(model=_module(2, seed=99), config=cfg)  # other weights: the load replaces them
    resumed.load_checkpoint(root)
    again = helpers.replica_iter(8, 4, 1, 0)
    [next(again) for _ in range(16)]
    out = {"straight": straight, "resumed": [resumed.train_batch(again).item() for _ in range(4)],
           "weights": _weights(engine), "resumed_weights": _weights(resumed)}
    plain = PipelineModule(helpers.layers(), num_stages=2, loss_fn=helpers.loss_fn, seed_layers=True, base_seed=99)
    one, *_ = dslaunch.initialize(model=plain, config=cfg)  # 1F1B on the same 2 ranks
    one.load_checkpoint(root)
    again = helpers.replica_iter(8, 4, 1, 0)
    [next(again) for _ in range(16)]
    out["plain"] = [one.train_batch(again).item() for _ in range(4)]
    return out


def test_a_checkpoint_resumes_bit_for_bit_and_loads_into_a_plain_pipeline(tmp_path) -> None:
    got = run_world(_checkpoint, 2, str(tmp_path / "ckpt"), timeout=170)
    for r in got:
        assert r["resumed"] == r["straight"]
        assert r["resumed_weights"] == r["weights"]
        assert r["plain"] == pytest.approx(r["straight"], rel=0, abs=1e-6)


def _refusals(rank: int, world: int) -> list[str]:
    import dslaunch
    from dslaunch.errors import ConfigError, DslaunchError
    from dslaunch.pipe import DualPipeVModule, PipelineModule
    from dslaunch.runtime.config import load_config
    from dslaunch.runtime.pipe.dualpipev import DualPipeVEngine

    dslaunch.init_distributed(verbose=False)
    calls = [lambda: dslaunch.initialize(model=_module(2), config=helpers.config(3, LR)),
             lambda: dslaunch.initialize(model=_module(2), config=helpers.config(4, LR,
                                                                                 pipeline={"schedule": "interleaved"})),
             lambda: dslaunch.initialize(model=_module(2), config=helpers.config(4, LR, zero_optimization={"stage": 3})),
             lambda: DualPipeVModule(helpers.layers(), num_stages=2, virtual_stages=2),
             lambda: DualPipeVModule(helpers.layers()[:3], num_stages=2),
             lambda: DualPipeVEngine(PipelineModule(helpers.layers(), num_stages=2), load_config(helpers.config(4, LR), 1))]
    lines = helpers.error_lines(calls, (ConfigError, DslaunchError))
    engine, *_ = dslaunch.initialize(model=_module(2), config=helpers.config(4, LR))
    lines += helpers.error_lines([lambda: engine.set_train_batch_size(3 * helpers.MICRO)], ConfigError)
    return lines


def test_bad_configurations_are_refused_in_one_line() -> None:
    got = run_world(_refusals, 2, timeout=170)
    assert got[0] == got[1]
    assert got[0] == [
        "'gradient_accumulation_steps': 3 micro batches: DualPipeV needs at least 2 * 2 (twice the pipeline stages)",
        "'pipeline.schedule': \"interleaved\" does not apply to a DualPipeVModule, which runs the DualPipeV schedule; "
        "remove the key (or use a PipelineModule)",
        "'zero_optimization.stage': ZeRO stage 3 cannot be combined with pipeline parallelism (a PipelineModule); use "
        "zero_optimization.stage 0, 1 or 2",
        "DualPipeVModule: virtual_stages does not apply (each rank holds two stages placed in a V); remove it, or use "
        "PipelineModule(virtual_stages=...) for interleaved stages",
        "PipelineModule: 3 layers cannot fill 4 stages (each stage needs at least one layer)",
        "DualPipeVEngine runs a DualPipeVModule, not a PipelineModule; build the model with "
        "deepspeed.pipe.DualPipeVModule (or use PipelineEngine)",
        "'gradient_accumulation_steps': 3 micro batches: DualPipeV needs at least 2 * 2 (twice the pipeline stages)"]
    assert all("\n" not in line for line in got[0])
