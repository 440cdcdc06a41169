"""DeepSpeed's pipeline checkpoints (``layer_XX-model_states.pt``, ``mp_rank_SS_...``) both ways.

Real DeepSpeed 0.19.8 (the venv of ``test_deepspeed_interop``) runs ``deepspeed_pipe_job.py``: a
2-stage ``PipelineModule`` at ZeRO-1 on 2 gloo ranks, 3 steps, a save, 4 more steps (its own
continuation). dslaunch loads that tag at the same shape and at another data-parallel degree
(world 4: 2 stages x 2 replicas) and into one stage: right after the load every parameter's fp32
master and Adam moments equal DeepSpeed's at the save bit for bit, and each step's loss equals
DeepSpeed's within 1e-6. The other way, dslaunch saves the same job in DeepSpeed's format and real
DeepSpeed's ``load_checkpoint`` continues it with dslaunch's losses.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from dslaunch.errors import CheckpointError
from tests.distributed import run_world
from tests.runtime.checkpoint import deepspeed_pipe_job as job
from tests.runtime.checkpoint.test_deepspeed_interop import _deepspeed_job

pytestmark = pytest.mark.timeout(600)

SAVE_AT, STEPS = 3, 4
SCRIPT = Path(job.__file__)


def _joined(results: list[dict]) -> dict:
    """Every stage's parameters' state (each rank probes its own stage's)."""
    out: dict = {}
    for r in results:
        out.update(r.get("state", {}))
    return out


@pytest.fixture(scope="module")
def deepspeed_saved(deepspeed_python: Path, tmp_path_factory: pytest.TempPathFactory
                    ) -> tuple[Path, list[dict]]:
    """DeepSpeed's pipeline tag (2 stages, world 2, ZeRO-1) and its per-rank results."""
    base = tmp_path_factory.mktemp("deepspeed-pipe")
    folder = base / "ck"
    results = _deepspeed_job(deepspeed_python, base / "pp2.json", base / "ext", 2,
                             {"stages": 2, "first": 0, "steps": SAVE_AT + STEPS, "save": str(folder),
                              "save_at": SAVE_AT}, script=SCRIPT)
    return folder, results


def _continue(rank: int, world: int, stages: int, load: str, kwargs: dict) -> dict:
    import dslaunch

    dslaunch.init_distributed(dist_backend="gloo")
    return job.run(dslaunch, rank, world, stages, first=SAVE_AT, steps=STEPS, load=load, **kwargs)


@pytest.mark.parametrize(("stages", "world"), [(2, 2), (2, 4), (1, 2)])
def test_dslaunch_continues_deepspeeds_pipeline(deepspeed_saved: tuple[Path, list[dict]], stages: int,
                                                world: int) -> None:
    folder, ds = deepspeed_saved
    got = run_world(_continue, world, stages, str(folder), {}, timeout=240)
    want = ds[0]["losses"][SAVE_AT:]
    assert max(abs(a - b) for a, b in zip(want, got[0]["losses"], strict=True)) < 1e-6, (want, got[0]["losses"])
    assert _joined(got) == _joined(ds)  # masters and moments as DeepSpeed had them at the save, bit for bit
    assert (got[0]["global_steps"], got[0]["global_samples"]) == (SAVE_AT, SAVE_AT * job.MICRO * job.MICRO_PER_STEP)
    assert (got[0]["client"]["note"], got[0]["client"]["step"]) == ("from the job", SAVE_AT)
    # DeepSpeed's load names the model states of the rank's stage
    assert {Path(r["path"]).name for r in got} == {f"mp_rank_{s:02d}_model_states.pt" for s in range(stages)}


def _load_once(rank: int, world: int, load: str) -> str:
    import dslaunch

    dslaunch.init_distributed(dist_backend="gloo")
    try:
        job.run(dslaunch, rank, world, 2, first=SAVE_AT, steps=0, load=load, probe=False)
    except CheckpointError as exc:
        return str(exc)
    return "loaded"


def test_broken_pipeline_tags_name_the_file(deepspeed_saved: tuple[Path, list[dict]], tmp_path: Path) -> None:
    folder, _ = deepspeed_saved
    broken = tmp_path / "ck"
    shutil.copytree(folder, broken)
    tag = broken / "global_step3"
    (tag / "layer_04-model_states.pt").unlink()
    msgs = run_world(_load_once, 2, str(broken))
    assert "layer_04-model_states.pt" in msgs[0] and str(tag) in msgs[0] and "\n" not in msgs[0], msgs
    (tag / "mp_rank_01_model_states.pt").unlink()
    msgs = run_world(_load_once, 2, str(broken))
    assert "2 stages" in msgs[0] and "mp_rank_01_model_states.pt" in msgs[0], msgs


# ---- dslaunch writes DeepSpeed's pipeline format ------------------------------------------------
def _save(rank: int, world: int, save: str) -> dict:
    import dslaunch

    dslaunch.init_distributed(dist_backend="gloo")
    return job.run(dslaunch, rank, world, 2, first=0, steps=SAVE_AT + STEPS, save=save, save_at=SAVE_AT,
                   checkpoint={"format": "deepspeed"})


def test_deepspeed_continues_dslaunchs_pipeline(deepspeed_python: Path, deepspeed_saved: tuple[Path, list[dict]],
                                                tmp_path: Path) -> None:
    folder = tmp_path / "ck"
    ours = run_world(_save, 2, str(folder), timeout=240)
    tag = folder / "global_step3"
    assert json.loads((tag / "manifest.json").read_text())["body"]["meta"]["format"] == "deepspeed"
    # the files DeepSpeed's own save of this job wrote (one per layer, per stage, per stage's rank)
    assert {f.name for f in tag.glob("*.pt")} == {f.name for f in (deepspeed_saved[0] / "global_step3").glob("*.pt")}
    for f in tag.glob("*.pt"):  # DeepSpeed unpickles these without dslaunch: no class of ours in them
        assert not [g for g in torch.serialization.get_unsafe_globals_in_checkpoint(str(f))
                    if not g.startswith(("deepspeed.", "torch.", "collections.", "builtins."))], f
    theirs = _deepspeed_job(deepspeed_python, tmp_path / "load.json", tmp_path / "ext", 2,
                            {"stages": 2, "first": SAVE_AT, "steps": STEPS, "load": str(folder), "probe": False},
                            script=SCRIPT)
    want = ours[0]["losses"][SAVE_AT:]
    assert max(abs(a - b) for a, b in zip(want, theirs[0]["losses"], strict=True)) < 1e-6, (want, theirs[0]["losses"])
    assert (theirs[0]["global_steps"], theirs[0]["client"]["note"], theirs[0]["client"]["step"]) == (
        SAVE_AT, "from the job", SAVE_AT)
