"""DeepSpeed's AutoTP training checkpoints (``mp_rank_TT_model_states.pt`` per tensor rank) into dslaunch.

Real DeepSpeed 0.19.8 (the venv of ``test_deepspeed_interop``) runs ``deepspeed_tp_job.py`` at
``tensor_parallel.autotp_size`` 2 on 2 gloo ranks, ZeRO-1: 3 steps, a save, 3 more (its own
continuation). dslaunch loads that tag at tensor-parallel degree 2 and at 1 (2 data-parallel
replicas): each step's loss equals DeepSpeed's within 1e-6, and right after the load every
parameter's fp32 master and Adam moments (whole at degree 1) equal DeepSpeed's at the save bit for
bit (DeepSpeed's per-rank slices joined by its own slice map, ``universal_checkpoint_info``).

DeepSpeed's AutoTP imports ``transformers``: these tests skip, saying so, when DeepSpeed's
interpreter cannot import it (``DSLAUNCH_DEEPSPEED_PYTHONPATH`` may name a folder holding it).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from dslaunch.runtime.checkpoint.deepspeed_read import read_file
from dslaunch.runtime.checkpoint.deepspeed_tp import joiner
from tests.deepspeed_reference import run_python
from tests.distributed import run_world
from tests.runtime.checkpoint import deepspeed_tp_job as job
from tests.runtime.checkpoint.test_deepspeed_interop import _deepspeed_job

pytestmark = pytest.mark.timeout(600)

SAVE_AT, STEPS = 3, 3


@pytest.fixture(scope="module")
def deepspeed_saved(deepspeed_python: Path, tmp_path_factory: pytest.TempPathFactory
                    ) -> tuple[Path, list[dict]]:
    """DeepSpeed's AutoTP tag (tp 2, world 2, ZeRO-1) and its per-rank results."""
    env = {**os.environ, "PYTHONPATH": os.environ.get("DSLAUNCH_DEEPSPEED_PYTHONPATH", "")}
    if run_python(deepspeed_python, ["-c", "import transformers"], env, timeout=300).returncode:
        pytest.skip(f"DeepSpeed's AutoTP needs transformers, which {deepspeed_python} cannot import (name a folder "
                    "holding it with DSLAUNCH_DEEPSPEED_PYTHONPATH)")
    base = tmp_path_factory.mktemp("deepspeed-tp")
    folder = base / "ck"
    results = _deepspeed_job(deepspeed_python, base / "tp2.json", base / "ext", 2,
                             {"tp": 2, "first": 0, "steps": SAVE_AT + STEPS, "save": str(folder), "save_at": SAVE_AT},
                             script=Path(job.__file__))
    return folder, results


def _continue(rank: int, world: int, tp: int, load: str) -> dict:
    import dslaunch

    dslaunch.init_distributed(dist_backend="gloo")
    return job.run(dslaunch, rank, world, tp, first=SAVE_AT, steps=STEPS, load=load)


def _whole(folder: Path, slices: list[dict]) -> dict[str, list[float]]:
    """Each parameter's whole state from every tensor rank's ``full_state`` (DeepSpeed's slice map)."""
    states = read_file(folder / "global_step3" / "mp_rank_00_model_states.pt")
    join = joiner(states["universal_checkpoint_info"]["affine_map"]["params"], folder)
    out = {}
    for key in slices[0]:
        name = key.split(":")[0]
        shapes = [s[name][0] for s in slices]
        values = [s[key][1] if ":" not in key else s[key] for s in slices]
        out[key] = join(name, [torch.tensor(v).view(shape) for v, shape in zip(values, shapes, strict=True)]
                        ).reshape(-1).tolist()
    return out


@pytest.mark.parametrize("tp", [2, 1])
def test_dslaunch_continues_deepspeeds_autotp(deepspeed_saved: tuple[Path, list[dict]], tp: int) -> None:
    folder, ds = deepspeed_saved
    got = run_world(_continue, 2, tp, str(folder), timeout=240)
    want = ds[0]["losses"][SAVE_AT:]
    assert max(abs(a - b) for a, b in zip(want, got[0]["losses"], strict=True)) < 1e-6, (want, got[0]["losses"])
    if tp == 1:  # whole parameters on each rank: masters and moments as DeepSpeed's at the save, bit for bit
        assert {k: v if ":" in k else v[1] for k, v in got[0]["state"].items()} == _whole(folder, [r["state"] for r in ds])
    assert got[0]["global_steps"] == SAVE_AT and got[0]["client"]["note"] == "from the job"
    assert Path(got[-1]["path"]).name == f"mp_rank_{tp - 1:02d}_model_states.pt"


def _continue_universal(rank: int, world: int, tp: int, load: str) -> dict:
    import dslaunch

    dslaunch.init_distributed(dist_backend="gloo")
    return job.run(dslaunch, rank, world, tp, first=SAVE_AT, steps=STEPS, load=load,
                   checkpoint={"load_universal": True})


@pytest.mark.parametrize("converter", ["dslaunch", "deepspeed"])
def test_a_universal_conversion_of_deepspeeds_autotp_tag_continues_at_tp2_and_tp1(
        deepspeed_saved: tuple[Path, list[dict]], deepspeed_python: Path, tmp_path: Path,
        converter: str) -> None:
    """DeepSpeed's AutoTP tag converted by ``dslaunch ds-to-universal`` or by DeepSpeed's own
    ``ds_to_universal`` (its AutoTP slice patterns and per-rank model states) loads with
    ``load_universal`` at tensor-parallel degree 2 and 1: the next losses equal DeepSpeed's own
    continuation within 1e-6, and at degree 1 the whole masters and moments equal DeepSpeed's at the
    save bit for bit. Real DeepSpeed loads dslaunch's conversion at tp 2 and continues alike."""
    from dslaunch.runtime.checkpoint.universal import convert

    folder, ds = deepspeed_saved
    out = tmp_path / "global_step3_universal"
    if converter == "dslaunch":
        convert(folder / "global_step3", out)
    else:
        env = {**os.environ, "DS_ACCELERATOR": "cpu",
               "PYTHONPATH": os.environ.get("DSLAUNCH_DEEPSPEED_PYTHONPATH", "")}
        run = run_python(deepspeed_python, ["-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder",
                                            str(folder / "global_step3"), "--output_folder", str(out)], env, timeout=300,
                         cwd=tmp_path)
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    want = ds[0]["losses"][SAVE_AT:]
    for tp in (2, 1):
        got = run_world(_continue_universal, 2, tp, str(tmp_path), timeout=240)
        assert max(abs(a - b) for a, b in zip(want, got[0]["losses"], strict=True)) < 1e-6, (tp, want, got[0]["losses"])
        assert got[0]["global_steps"] == SAVE_AT
        if tp == 1:
            whole = _whole(folder, [r["state"] for r in ds])
            assert {k: v if ":" in k else v[1] for k, v in got[0]["state"].items()} == whole
    if converter == "dslaunch":  # and real DeepSpeed loads dslaunch's conversion at its own degree
        again = _deepspeed_job(deepspeed_python, tmp_path / "again.json", tmp_path / "ext", 2,
                               {"tp": 2, "first": SAVE_AT, "steps": STEPS, "load": str(tmp_path),
                                "checkpoint": {"load_universal": True}, "probe": False}, script=Path(job.__file__))
        assert max(abs(a - b) for a, b in zip(want, again[0]["losses"], strict=True)) < 1e-6, (want, again[0])


@pytest.mark.parametrize("converter", ["dslaunch", "deepspeed"])
def test_deepspeeds_zero3_autotp_tag_converted_continues_at_tp2_and_tp1(
        deepspeed_python: Path, tmp_path: Path, converter: str) -> None:
    """The same at ZeRO-3 (DeepSpeed 0.19.4+'s AutoTP: ``zero_pp_rank_D_mp_rank_TT`` files, each
    data-parallel partition of one tensor rank's slices): the conversion joins the partitions,
    then the slices; the next losses equal DeepSpeed's continuation within 1e-6. The tag itself
    loads at tp 1 too."""
    from dslaunch.runtime.checkpoint.universal import convert

    env = {**os.environ, "PYTHONPATH": os.environ.get("DSLAUNCH_DEEPSPEED_PYTHONPATH", "")}
    if run_python(deepspeed_python, ["-c", "import transformers"], env, timeout=300).returncode:
        pytest.skip(f"DeepSpeed's AutoTP needs transformers, which {deepspeed_python} cannot import")
    folder = tmp_path / "ck"
    ds = _deepspeed_job(deepspeed_python, tmp_path / "tp2z3.json", tmp_path / "ext", 2,
                        {"tp": 2, "stage": 3, "first": 0, "steps": SAVE_AT + STEPS, "save": str(folder),
                         "save_at": SAVE_AT}, script=Path(job.__file__))
    out = tmp_path / "global_step3_universal"
    if converter == "dslaunch":
        convert(folder / "global_step3", out)
    else:
        run = run_python(deepspeed_python, ["-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder",
                                            str(folder / "global_step3"), "--output_folder", str(out)],
                         {**env, "DS_ACCELERATOR": "cpu"}, timeout=300, cwd=tmp_path)
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    want = ds[0]["losses"][SAVE_AT:]
    for tp in (2, 1):
        got = run_world(_continue_universal, 2, tp, str(tmp_path), timeout=240)
        assert max(abs(a - b) for a, b in zip(want, got[0]["losses"], strict=True)) < 1e-6, (tp, want, got[0]["losses"])
    if converter == "dslaunch":  # and the tag itself, unconverted, loads at another degree
        got = run_world(_continue, 2, 1, str(folder), timeout=240)
        assert max(abs(a - b) for a, b in zip(want, got[0]["losses"], strict=True)) < 1e-6, (want, got[0]["losses"])
