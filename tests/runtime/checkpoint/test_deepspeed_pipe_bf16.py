"""A bf16 pipeline at ZeRO stage 0: ``engine.optimizer`` is ``BF16_Optimizer``, as in DeepSpeed.

Real DeepSpeed 0.19.8 (the venv of ``test_deepspeed_interop``) and dslaunch run
``deepspeed_pipe_job.py`` with ``bf16`` on: 2 stages on 2 gloo ranks, torch's AdamW as the client
optimizer, 3 steps, a save, 3 more. Both engines' ``engine.optimizer`` answer alike (the class,
the torch optimizer inside, ``needs_scaler()`` False, no loss scaler, no overflow), the losses are
equal (within 1e-6; measured: bit for bit, as dslaunch's were before the wrapper existed) and so
are the masters and Adam moments at the save; dslaunch's own tag resumes bit for bit.

DeepSpeed 0.19.8 saves a stage-0 bf16 pipeline's optimizer state (``BF16_Optimizer``'s, in the
model states and in ``bf16_zero_pp_rank_*`` files, without ``param_shapes``) but cannot load it
(``KeyError: 0``): only ``load_optimizer_states=False`` works there, and with it the two engines'
tags of the same run continue alike. dslaunch loads such a tag with its optimizer state too
(``test_deepspeed_bf16``).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.distributed import run_world
from tests.runtime.checkpoint import deepspeed_pipe_job as job
from tests.runtime.checkpoint.test_deepspeed_interop import _deepspeed_job
from tests.runtime.checkpoint.test_deepspeed_pipe import SCRIPT, _joined

pytestmark = pytest.mark.timeout(600)

SAVE_AT, STEPS = 3, 3


def _worst(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


@pytest.fixture(scope="module")
def deepspeed_bf16(deepspeed_python: Path, tmp_path_factory: pytest.TempPathFactory
                   ) -> tuple[Path, list[dict]]:
    """DeepSpeed's bf16 pipeline tag (2 stages, world 2, ZeRO-0) and its per-rank results."""
    base = tmp_path_factory.mktemp("deepspeed-pipe-bf16")
    results = _deepspeed_job(deepspeed_python, base / "bf16.json", base / "ext", 2,
                             {"stages": 2, "stage": 0, "bf16": True, "first": 0, "steps": SAVE_AT + STEPS,
                              "save": str(base / "ck"), "save_at": SAVE_AT}, script=SCRIPT)
    return base / "ck", results


def _run(rank: int, world: int, stages: int, kwargs: dict) -> dict:
    import dslaunch

    dslaunch.init_distributed(dist_backend="gloo")
    return job.run(dslaunch, rank, world, stages, stage=0, bf16=True, **kwargs)


def test_bf16_pipeline_answers_and_trains_as_deepspeeds_bf16_optimizer(
        deepspeed_bf16: tuple[Path, list[dict]], tmp_path: Path) -> None:
    _, ds = deepspeed_bf16
    ours = run_world(_run, 2, 2, {"first": 0, "steps": SAVE_AT + STEPS, "save": str(tmp_path / "ck"),
                                  "save_at": SAVE_AT}, timeout=240)
    for mine, theirs in zip(ours, ds, strict=True):
        assert mine["wrapper"] == theirs["wrapper"]
    assert ours[0]["wrapper"]["class"] == "BF16_Optimizer" and ours[0]["wrapper"]["loss_scaler"] == "absent"
    assert _worst(ours[0]["losses"], ds[0]["losses"]) <= 1e-6, (ours[0]["losses"], ds[0]["losses"])
    assert _joined(ours) == _joined(ds)  # masters and moments at the save
    resumed = run_world(_run, 2, 2, {"first": SAVE_AT, "steps": STEPS, "load": str(tmp_path / "ck")}, timeout=240)
    assert resumed[0]["losses"] == ours[0]["losses"][SAVE_AT:]
    assert _joined(resumed) == _joined(ours)
    assert ours[0]["losses"][0] != ours[0]["losses"][-1]  # it trains


def test_deepspeeds_bf16_pipeline_tag_loads_its_weights_only(deepspeed_bf16: tuple[Path, list[dict]],
                                                              tmp_path: Path) -> None:
    """``load_optimizer_states=False`` (the one way DeepSpeed 0.19.8 loads its own stage-0 bf16
    tag: ``KeyError: 0`` in ``_load_legacy_checkpoint`` otherwise): the weights and counters load, the
    first loss is DeepSpeed's continuation's, and dslaunch's DeepSpeed-format tag of the same run
    continues alike."""
    folder, ds = deepspeed_bf16
    weights_only = {"first": SAVE_AT, "steps": STEPS, "probe": False,
                    "load_kwargs": {"load_optimizer_states": False}}
    theirs = run_world(_run, 2, 2, {**weights_only, "load": str(folder)}, timeout=240)
    assert theirs[0]["losses"][0] == ds[0]["losses"][SAVE_AT] and theirs[0]["global_steps"] == SAVE_AT
    run_world(_run, 2, 2, {"first": 0, "steps": SAVE_AT, "save": str(tmp_path / "ck"),
                           "checkpoint": {"format": "deepspeed"}, "probe": False}, timeout=240)
    ours = run_world(_run, 2, 2, {**weights_only, "load": str(tmp_path / "ck")}, timeout=240)
    assert ours[0]["losses"] == theirs[0]["losses"]


def test_deepspeed_loads_dslaunchs_bf16_pipeline_as_its_own(deepspeed_bf16: tuple[Path, list[dict]],
                                                            deepspeed_python: Path, tmp_path: Path) -> None:
    """dslaunch's DeepSpeed-format tag of the same run, loaded by DeepSpeed with
    ``load_optimizer_states=False`` (the one way DeepSpeed 0.19.8 loads a stage-0 bf16 pipeline),
    continues exactly as DeepSpeed's own tag does."""
    folder = tmp_path / "ck"
    run_world(_run, 2, 2, {"first": 0, "steps": SAVE_AT, "save": str(folder), "checkpoint": {"format": "deepspeed"},
                           "probe": False}, timeout=240)
    weights_only = {"stages": 2, "stage": 0, "bf16": True, "first": SAVE_AT, "steps": STEPS, "probe": False,
                    "load_kwargs": {"load_optimizer_states": False}}
    ours = _deepspeed_job(deepspeed_python, tmp_path / "ours.json", tmp_path / "ext", 2,
                          {**weights_only, "load": str(folder)}, script=SCRIPT)
    theirs = _deepspeed_job(deepspeed_python, tmp_path / "theirs.json", tmp_path / "ext", 2,
                            {**weights_only, "load": str(deepspeed_bf16[0])}, script=SCRIPT)
    assert ours[0]["losses"] == theirs[0]["losses"] and ours[0]["global_steps"] == SAVE_AT
