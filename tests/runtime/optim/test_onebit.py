"""OneBitAdam (and OneBitLamb against Lamb) through the engine: bitwise Adam during warm-up, within
1% of Adam after it, at ZeRO stages 0-2 and world sizes 2 and 4; a resume that is bitwise; a one-line
refusal at another world size; the config's one-line errors. The task is ``onebit_task`` (a tiny
language model).

"Within 1%": the mean over 3 seeds (model and data) of the held-out loss's relative gap, on 4096
held-out sequences. One seed's gap on 64 sequences moved by up to 1.3% with the seed or the
held-out set (``scripts/bench/onebit_convergence.py``): a 1% bound on it decided on noise."""

from __future__ import annotations

import numpy as np
import pytest

from dslaunch.errors import ConfigError
from tests.distributed import run_world
from tests.runtime.optim.onebit_task import build, config, linear_decay, run_steps, train, weights

LR, FREEZE, STEPS = 1e-2, 10, 40
SEEDS, HELD_OUT = (0, 1, 2), 4096
ADAM = {"type": "Adam", "params": {"lr": LR}}
ONEBIT = {"type": "OneBitAdam", "params": {"lr": LR, "freeze_step": FREEZE}}
ZERO_ONE = {"type": "ZeroOneAdam", "params": {"lr": LR, "var_freeze_step": 20, "var_update_scaler": 4,
                                             "local_step_scaler": 8, "local_step_clipper": 4}}
# LAMB run to the task's floor: 160 steps, 40 of warm-up, its best lr here (0.1; 0.05 and 0.2 end higher)
# decaying linearly to 0, as LAMB is run (its steps are lr * |w| whatever the gradient: at a constant lr
# it stalls above the floor, while 1-bit LAMB's steps shrink with the momentum once its factor is capped)
LAMB_STEPS, LAMB_FREEZE, LAMB_LR = 160, 40, 0.1


def _train_all(rank: int, world: int, cfgs: list[dict], steps: int = STEPS,
               snapshots: tuple[int, ...] = (FREEZE, 36, 38, STEPS)) -> list[dict]:
    """Each config trained from each of ``SEEDS``: seed 0's result (weights, losses) and every seed's
    held-out loss (``held_outs``)."""
    out = []
    for cfg in cfgs:
        first = train(rank, world, cfg, steps, snapshots=snapshots, seed=SEEDS[0], held_out=HELD_OUT)
        others = [train(rank, world, cfg, steps, seed=seed, held_out=HELD_OUT)["held_out"] for seed in SEEDS[1:]]
        out.append({**first, "held_outs": [first["held_out"], *others]})
    return out


def _mean_gap(plain: dict, compressed: dict) -> float:
    return float(np.mean([c / p - 1.0 for p, c in zip(plain["held_outs"], compressed["held_outs"], strict=True)]))


def _assert_warmup_bitwise(adam: dict, onebit: dict, what: str, freeze: int = FREEZE, steps: int = STEPS) -> None:
    np.testing.assert_array_equal(onebit["weights"][freeze], adam["weights"][freeze], err_msg=f"{what}: warm-up")
    assert not np.array_equal(onebit["weights"][steps], adam["weights"][steps]), f"{what}: never compressed"


def _assert_tracks(adam: dict, onebit: dict, what: str) -> None:
    _assert_warmup_bitwise(adam, onebit, what)
    assert abs(_mean_gap(adam, onebit)) <= 0.01, (what, adam["held_outs"], onebit["held_outs"])


@pytest.mark.timeout(150)
def test_onebit_adam_warmup_bitwise_then_adam_within_1pct_at_stages_0_1_2() -> None:
    cfgs = [config(ADAM)] + [config(ONEBIT, stage) for stage in (0, 1, 2)] + [config(ZERO_ONE)]
    results = run_world(_train_all, 2, cfgs)
    adam, *onebit, zero_one = results[0]
    assert adam["held_out"] < 0.6 * adam["losses"][0]  # the task trains
    for stage, run in enumerate(onebit):
        _assert_tracks(adam, run, f"stage {stage}")
    for i in range(1, len(cfgs)):  # the ranks agree
        np.testing.assert_array_equal(results[0][i]["weights"][STEPS], results[1][i]["weights"][STEPS])
    # ZeroOneAdam: its first 4 steps are variance steps (fp32 all-reduce, torch's AdamW: bitwise);
    # then 1-bit steps, local steps from step 21 with a synchronisation at local steps 1-8, then
    # every 2nd (to 36), then every 4th (40: the ranks agree, checked above; at 38 they do not)
    assert zero_one["losses"][:5] == adam["losses"][:5]
    np.testing.assert_array_equal(results[0][-1]["weights"][36], results[1][-1]["weights"][36])
    assert not np.array_equal(results[0][-1]["weights"][38], results[1][-1]["weights"][38])
    assert abs(_mean_gap(adam, zero_one)) <= 0.01, (adam["held_outs"], zero_one["held_outs"])


@pytest.mark.timeout(240)
@pytest.mark.parametrize("world", [2])  # world 4 measured the same (+0.16% vs +0.12%) in 66 s instead of 28 s
def test_onebit_lamb_warmup_bitwise_then_lamb_within_1pct(world: int) -> None:
    cfgs = [config({"type": name, "params": {"lr": LAMB_LR, "weight_decay": 0.01, **extra}}, 1,
                   **linear_decay(LAMB_LR, LAMB_STEPS))
            for name, extra in (("Lamb", {}), ("OneBitLamb", {"freeze_step": LAMB_FREEZE}))]
    results = run_world(_train_all, world, cfgs, LAMB_STEPS, (LAMB_FREEZE, LAMB_STEPS), timeout=200.0)
    np.testing.assert_array_equal(results[0][1]["weights"][LAMB_STEPS], results[-1][1]["weights"][LAMB_STEPS])
    lamb, onebit_lamb = results[0]
    _assert_warmup_bitwise(lamb, onebit_lamb, f"OneBitLamb, world {world}", LAMB_FREEZE, LAMB_STEPS)
    assert abs(_mean_gap(lamb, onebit_lamb)) <= 0.01, (lamb["held_outs"], onebit_lamb["held_outs"])


RESUMED = {  # compressed (or local) steps from step 4 or 6, a checkpoint at 8
    "OneBitAdam": config({"type": "OneBitAdam", "params": {"lr": LR, "freeze_step": 4}}, 2),
    "OneBitLamb": config({"type": "OneBitLamb", "params": {"lr": 5e-2, "weight_decay": 0.01, "freeze_step": 4}}, 1),
    "ZeroOneAdam": config({"type": "ZeroOneAdam", "params": {"lr": LR, "var_freeze_step": 6, "var_update_scaler": 2,
                                                             "local_step_scaler": 2, "local_step_clipper": 4}}),
}


def _resume(rank: int, world: int, save_dir: str, name: str = "OneBitAdam") -> tuple:
    """Train 12 steps saving at 8; a new engine resumes at 8 and trains to 12."""
    cfg = RESUMED[name]
    first = build(cfg)
    run_steps(first, rank, world, 0, 8)
    first.save_checkpoint(save_dir)
    run_steps(first, rank, world, 8, 12)
    straight = weights(first).numpy().copy()
    first.destroy()
    second = build(cfg)
    second.load_checkpoint(save_dir)
    run_steps(second, rank, world, 8, 12)
    return straight, weights(second).numpy().copy()


def _load_elsewhere_then_track(rank: int, world: int, save_dir: str) -> tuple[str, list[dict]]:
    from dslaunch.errors import CheckpointError

    engine = build(config(ONEBIT, 1))
    try:
        engine.load_checkpoint(save_dir)
        message = "loaded"
    except CheckpointError as exc:
        message = str(exc)
    engine.destroy()
    cfgs = [config(ADAM), config(ONEBIT, 1), config(ZERO_ONE)]
    return message, _train_all(rank, world, cfgs)


@pytest.mark.timeout(150)
def test_onebit_adam_resume_bitwise_other_world_size_refused_and_world_4_tracks_adam(tmp_path) -> None:
    for straight, resumed in run_world(_resume, 2, str(tmp_path)):
        np.testing.assert_array_equal(resumed, straight)
    # world 4: the world-2 checkpoint's error feedback is refused in one line; then 4 ranks train
    results = run_world(_load_elsewhere_then_track, 4, str(tmp_path))
    for message, _ in results:
        assert "error-feedback state was saved at data-parallel world size 2, this run has 4" in message
        assert "\n" not in message
    adam, onebit, zero_one = results[0][1]
    _assert_tracks(adam, onebit, "world 4, stage 1")
    assert abs(_mean_gap(adam, zero_one)) <= 0.01, (adam["held_outs"], zero_one["held_outs"])


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", ["OneBitLamb", "ZeroOneAdam"])
def test_onebit_lamb_and_zero_one_adam_resume_bitwise(tmp_path, name: str) -> None:
    # OneBitLamb's float64 trust-ratio averages came back as fp32 (torch's load casts floating state)
    for straight, resumed in run_world(_resume, 2, str(tmp_path), name):
        np.testing.assert_array_equal(resumed, straight)


@pytest.mark.parametrize(("change", "key", "text"), [
    ({"optimizer": {"type": "OneBitAdam", "params": {"comm_backend_name": "mpi"}}},
     "optimizer.params.comm_backend_name", "cannot run here"),
    ({"optimizer": {"type": "OneBitAdam", "params": {"freeze_step": 0}}}, "optimizer.params.freeze_step", ""),
    ({"optimizer": ONEBIT, "fp16": {"enabled": True}}, "fp16.enabled", "use bf16 or fp32"),
    ({"optimizer": ONEBIT, "zero_optimization": {"stage": 3}}, "zero_optimization.stage", "stages 0, 1 and 2"),
    ({"optimizer": ZERO_ONE, "zero_optimization": {"stage": 1}}, "zero_optimization.stage", "stage 0 (its ranks"),
    ({"optimizer": {"type": "OneBitAdam", "params": {"amsgrad": True}}}, "optimizer.params.amsgrad", "not supported"),
])
def test_onebit_config_errors_are_one_line(change: dict, key: str, text: str) -> None:
    from dslaunch.runtime.config import load_config

    with pytest.raises(ConfigError) as info:
        load_config({"train_batch_size": 4, **change}, 1)
    message = str(info.value)
    assert key in message and text in message and "\n" not in message


def test_onebit_adam_accepts_deepspeeds_keys() -> None:
    from dslaunch.runtime.optim.registry import validate_optimizer

    spec = validate_optimizer("onebitadam", {"lr": 1e-3, "freeze_step": 400, "cuda_aware": False,
                                             "comm_backend_name": "nccl", "betas": [0.9, 0.999]})
    assert spec.name == "OneBitAdam" and spec.params["freeze_step"] == 400


def _pipeline_runs(rank: int, world: int) -> list[list[float]]:
    from tests.runtime.pipe.test_engine import _train

    return [_train(rank, world, 2, 3, 1, {"optimizer": opt})["losses"] for opt in (
        {"type": "Adam", "params": {"lr": 0.01}}, {"type": "OneBitAdam", "params": {"lr": 0.01, "freeze_step": 5}})]


@pytest.mark.timeout(150)
def test_onebit_adam_in_the_pipeline_engine_2_stages_x_2_replicas_zero_1() -> None:
    adam, onebit = run_world(_pipeline_runs, 4, timeout=140)[0]
    assert onebit[:6] == adam[:6]  # 5 warm-up steps, and the 6th step's loss is computed before its update
    assert onebit[6:] != adam[6:]
    assert sum(onebit[-5:]) < 0.5 * sum(onebit[:5])  # it keeps training (20 steps, 3 micro batches each)


def _clipped_warmups(rank: int, world: int) -> list[list[float]]:
    cfgs = [config(opt, 1, gradient_clipping=0.05) for opt in (ADAM, ONEBIT)]
    return [train(rank, world, cfg, FREEZE, snapshots=(FREEZE,))["weights"][FREEZE] for cfg in cfgs]


@pytest.mark.timeout(90)
def test_onebit_adam_warmup_with_gradient_clipping_at_zero_1_is_bitwise_adam() -> None:
    # the clip factor reaches both through the same strategy step (OneBitAdam as torch's AMP
    # grad_scale, Adam as a multiply): the warm-up must stay bitwise
    adam, onebit = run_world(_clipped_warmups, 2)[0]
    np.testing.assert_array_equal(onebit, adam)
