"""AutoEP tags at ZeRO-3 in DeepSpeed 0.19.8's ``zero3_partitioned`` layout, both ways
(``deepspeed_autoep_zero3``).

Real DeepSpeed (``deepspeed_autoep_job.py`` in its venv) trains the Mixtral-shaped block under
AutoEP at ``autoep_size`` 2 over 2 ranks at ZeRO-3 and saves; dslaunch does the same with
``checkpoint.format: "deepspeed"``. The files agree (names, ``ds_autoep_layers`` of each rank,
``param_shapes``, ``ds_zero_partition_groups``, every tensor within 1e-6), each side continues
from the other's tag, dslaunch at another ``autoep_size`` and world size too, with
``load_optimizer_states=False`` and ``load_module_only=True`` as DeepSpeed does, and through a
universal checkpoint made by dslaunch (file for file equal to DeepSpeed's ``ds_to_universal``
output), and of the same run's tag in dslaunch's own layout (``universal_autoep``). At world 4
(expert-data groups of 2) DeepSpeed continues dslaunch's tag. The mean
losses after each load equal the reference's within 1e-6. A model with another number of experts
is refused in one line.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

from dslaunch.errors import ExpertShapeError
from dslaunch.runtime.checkpoint.deepspeed_read import read_file
from dslaunch.runtime.checkpoint.universal import convert
from tests.deepspeed_reference import run_python
from tests.distributed import run_world
from tests.runtime.checkpoint import deepspeed_autoep_job as job
from tests.runtime.checkpoint.test_deepspeed_interop import _deepspeed_job, _mean_losses

SAVE_AT, STEPS = 3, 2
SCRIPT = Path(job.__file__)
TOL = 1e-6


def _job(rank: int, world: int, kw: dict) -> dict:
    import dslaunch

    dslaunch.init_distributed(dist_backend="gloo")
    return job.run(dslaunch, rank, world, **kw)


def _close(want: list[float], have: list[float]) -> None:
    assert max(abs(a - b) for a, b in zip(want, have, strict=True)) < TOL, (want, have)


def _same(a: Any, b: Any, where: str) -> None:
    """Equal values, tensors within ``TOL`` (a ``torch.Size`` equal to a tuple; DeepSpeed's enum
    and loss scaler objects, read as stand-ins, are compared by the fields the files share)."""
    if torch.is_tensor(a):
        assert torch.is_tensor(b) and a.shape == b.shape, where
        assert a.numel() == 0 or (a.float() - b.float()).abs().max().item() < TOL, where
    elif isinstance(a, dict):
        for k in a:
            _same(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _same(x, y, f"{where}[{i}]")
    elif isinstance(a, (int, float, str, bool)) or a is None:
        assert a == b, (where, a, b)


def _compare_tags(theirs: Path, ours: Path) -> None:
    files = sorted(f.name for f in theirs.iterdir())
    assert sorted(f.name for f in ours.iterdir()) == sorted([*files, "manifest.json"])
    assert not any(f.startswith("layer_") for f in files)  # zero3_partitioned: no per-expert files
    for name in files:
        a, b = (read_file(d / name) for d in (theirs, ours))  # DeepSpeed's classes as stand-ins
        if "model_states" in name:
            assert list(b["module"]) == list(a["module"])
            assert all(v.numel() == 0 for v in b["module"].values())  # every weight in the shards
            assert b["ds_autoep_layers"] == a["ds_autoep_layers"]
            assert [dict(g) for g in b["param_shapes"]] == [{k: torch.Size(v) for k, v in g.items()}
                                                            for g in a["param_shapes"]]
        else:
            osd_a, osd_b = a["optimizer_state_dict"], b["optimizer_state_dict"]
            assert osd_b["ds_zero_partition_groups"] == osd_a["ds_zero_partition_groups"]
            _same(osd_a["fp32_flat_groups"], osd_b["fp32_flat_groups"], name)
            _same(osd_a["optimizer_state_dict"]["state"], osd_b["optimizer_state_dict"]["state"], name)


@pytest.mark.timeout(900)
def test_zero3_autoep_tags_cross_between_deepspeed_and_dslaunch(deepspeed_python: Path,
                                                                tmp_path: Path) -> None:
    """DeepSpeed's ZeRO-3 AutoEP tag (ep 2, world 2) and dslaunch's in DeepSpeed's layout agree file
    for file; each continues under the other; dslaunch continues DeepSpeed's at ep 1 / world 1
    and after weights-only loads as DeepSpeed does; dslaunch's universal conversion equals
    DeepSpeed's and continues at ep 4 / world 4 under dslaunch as the saving run did; so does its
    conversion of the run's tag in dslaunch's own layout, which DeepSpeed continues as it
    continues its own conversion."""
    ext, run = tmp_path / "ext", {"stage": 3, "first": SAVE_AT, "steps": STEPS}
    saved = {"stage": 3, "first": 0, "steps": SAVE_AT + STEPS, "save_at": SAVE_AT}
    theirs = _deepspeed_job(deepspeed_python, tmp_path / "ds.json", ext, 2, {**saved, "save": str(tmp_path / "ds")},
                            script=SCRIPT)
    ours = run_world(_job, 2, {**saved, "save": str(tmp_path / "dsl"), "checkpoint": {"format": "deepspeed"}},
                     timeout=240)
    _close(_mean_losses(theirs), _mean_losses(ours))  # the same training before the checkpoints
    tag = f"global_step{SAVE_AT}"
    _compare_tags(tmp_path / "ds" / tag, tmp_path / "dsl" / tag)
    pairs = [(theirs, run_world(_job, 2, {**run, "load": str(tmp_path / "ds")}, timeout=240)),
             (theirs, run_world(_job, 1, {**run, "load": str(tmp_path / "ds"), "ep_size": 1}, timeout=240)),
             (ours, _deepspeed_job(deepspeed_python, tmp_path / "back.json", ext, 2,
                                   {**run, "load": str(tmp_path / "dsl")}, script=SCRIPT))]
    for saver, loader in pairs:
        _close(_mean_losses(saver, skip=SAVE_AT), _mean_losses(loader))
        assert loader[0]["global_steps"] == SAVE_AT
    for kwargs in ({"load_optimizer_states": False}, {"load_module_only": True}):  # fresh Adam moments
        weights_only = {**run, "load": str(tmp_path / "ds"), "load_kwargs": kwargs}
        _close(_mean_losses(_deepspeed_job(deepspeed_python, tmp_path / "w.json", ext, 2, weights_only,
                                           script=SCRIPT)),
               _mean_losses(run_world(_job, 2, weights_only, timeout=240)))
    # universal: dslaunch's conversion of DeepSpeed's tag, file for file as DeepSpeed's own
    convert(tmp_path / "ds" / tag, tmp_path / "ds" / "universal")
    env = {**os.environ, "PYTHONPATH": "", "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    run_python(deepspeed_python, ["-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder",
                                  str(tmp_path / "ds" / tag), "--output_folder", str(tmp_path / "ref" / "universal")],
               env, timeout=300, check=True)
    _same_universal(tmp_path / "ref" / "universal", tmp_path / "ds" / "universal")
    # and of the same run's tag in dslaunch's own layout (the default format)
    own = run_world(_job, 2, {**saved, "save": str(tmp_path / "own")}, timeout=240)
    _close(_mean_losses(theirs), _mean_losses(own))
    convert(tmp_path / "own" / tag, tmp_path / "own" / "universal")
    _same_universal(tmp_path / "ref" / "universal", tmp_path / "own" / "universal")
    universal = {**run, "checkpoint": {"load_universal": True}, "load_kwargs": {"tag": "universal"}}
    # dslaunch continues exactly as the saving run did, here at ep 4 / world 4
    _close(_mean_losses(theirs, skip=SAVE_AT),
           _mean_losses(run_world(_job, 4, {**universal, "load": str(tmp_path / "ds"), "ep_size": 4}, timeout=240)))
    # DeepSpeed's ZeRO-3 universal load does not (its second loss off by ~2e-4 from its own run,
    # from its own conversion too): the reference is DeepSpeed loading its own conversion
    ref = _deepspeed_job(deepspeed_python, tmp_path / "ref.json", ext, 2, {**universal, "load": str(tmp_path / "ref")},
                         script=SCRIPT)
    assert abs(_mean_losses(ref)[0] - _mean_losses(theirs, skip=SAVE_AT)[0]) < TOL  # the weights exact
    _close(_mean_losses(ref), _mean_losses(_deepspeed_job(deepspeed_python, tmp_path / "own.json", ext, 2,
                                                          {**universal, "load": str(tmp_path / "own")}, script=SCRIPT)))


def _same_universal(ref: Path, got: Path) -> None:
    """The same ``zero/<param>/*.pt`` files, each within ``TOL`` (dense ones bare flat tensors,
    expert ones DeepSpeed's dict with every expert's rows)."""
    want = sorted(p.relative_to(ref) for p in (ref / "zero").rglob("*.pt"))
    assert want and sorted(p.relative_to(got) for p in (got / "zero").rglob("*.pt")) == want
    for rel in want:
        if rel.name != "optimizer_state.pt":
            a, b = (torch.load(d / rel, weights_only=True) for d in (ref, got))
            assert type(a) is type(b), rel
            _same(a, b, str(rel))


def _wider_model(rank: int, world: int, load: str) -> str:
    """Load ``load`` into the job's model with 8 experts instead of 4; the refusal's text."""
    import dslaunch

    dslaunch.init_distributed(dist_backend="gloo")
    job.EXPERTS, job._Config.num_local_experts = 8, 8
    try:
        job.run(dslaunch, rank, world, stage=3, first=SAVE_AT, steps=0, load=load,
                checkpoint={"load_universal": True} if load.endswith("u") else None,
                load_kwargs={"tag": "universal"} if load.endswith("u") else None)
    except ExpertShapeError as exc:
        assert isinstance(exc, ValueError) and isinstance(exc, RuntimeError)
        return str(exc)
    return ""


@pytest.mark.timeout(300)
def test_expert_count_mismatch_is_refused_in_one_line(tmp_path: Path) -> None:
    """A ZeRO-3 AutoEP tag of 4 experts (dslaunch's, in DeepSpeed's layout) and its universal
    conversion, loaded into a model of 8 experts at ep 2: one line with DeepSpeed's words
    (``target_local_experts=4, checkpoint_local_experts=2``), naming the file, on every rank."""
    run_world(_job, 2, {"stage": 3, "first": 0, "steps": SAVE_AT, "save_at": SAVE_AT - 1,
                        "save": str(tmp_path / "t"), "checkpoint": {"format": "deepspeed"}}, timeout=200)
    convert(tmp_path / "t" / f"global_step{SAVE_AT - 1}", tmp_path / "u" / "universal")
    for folder in ("t", "u"):
        for msg in run_world(_wider_model, 2, str(tmp_path / folder), timeout=200):
            assert "target_local_experts=4, checkpoint_local_experts=2" in msg and "\n" not in msg, msg
            assert str(tmp_path / folder) in msg, msg


@pytest.mark.timeout(600)
def test_zero3_autoep_tag_with_expert_data_groups_continues_under_deepspeed(deepspeed_python: Path,
                                                                           tmp_path: Path) -> None:
    """At world 4, ep 2 each expert weight is cut over an expert-data group of 2 (global ranks
    ``{0, 2}`` and ``{1, 3}`` in ``ds_zero_partition_groups``): DeepSpeed loads dslaunch's tag
    (its load refuses any other placement record) and continues as dslaunch did (within 1e-6)."""
    ours = run_world(_job, 4, {"stage": 3, "first": 0, "steps": SAVE_AT + STEPS, "save_at": SAVE_AT,
                               "save": str(tmp_path / "dsl"), "checkpoint": {"format": "deepspeed"}}, timeout=300)
    record = read_file(tmp_path / "dsl" / f"global_step{SAVE_AT}" / "zero_pp_rank_1_mp_rank_00_optim_states.pt")
    groups = record["optimizer_state_dict"]["ds_zero_partition_groups"]
    assert [(g["partition_ranks"], g["partition_rank"], g["families"]) for g in groups] == [
        ([0, 1, 2, 3], 1, ["replicated"]), ([1, 3], 0, ["autoep_expert"])]
    theirs = _deepspeed_job(deepspeed_python, tmp_path / "back.json", tmp_path / "ext", 4,
                            {"stage": 3, "first": SAVE_AT, "steps": STEPS, "load": str(tmp_path / "dsl")}, script=SCRIPT)
    _close(_mean_losses(ours, skip=SAVE_AT), _mean_losses(theirs))
