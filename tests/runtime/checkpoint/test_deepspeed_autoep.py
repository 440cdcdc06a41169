"""AutoEP tags in DeepSpeed 0.19.8's layout, both ways (``deepspeed_autoep``).

Real DeepSpeed (``deepspeed_autoep_job.py`` in its venv, as ``test_deepspeed_interop.py`` runs it)
trains a Mixtral-shaped block under AutoEP at ``autoep_size`` 2 over 2 ranks, saves, and continues
on its own; dslaunch loads that tag and continues with the same mean losses (within 1e-6), at the
same layout and at another ``autoep_size`` and world size. The reverse: dslaunch saves with
``checkpoint.format: "deepspeed"`` and DeepSpeed continues as dslaunch did. DeepSpeed's tag made
universal by dslaunch's ``ds-to-universal`` continues under both. The metadata checks
need no DeepSpeed: a tag dslaunch wrote, its ``ds_autoep_layers`` broken, is refused in one line
naming the file and the key.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from dslaunch.errors import CheckpointLayoutError
from dslaunch.runtime.checkpoint.deepspeed_autoep import AutoEPBlock, check_metadata
from dslaunch.runtime.checkpoint.universal import convert
from tests.distributed import run_world
from tests.runtime.checkpoint import deepspeed_autoep_job as job
from tests.runtime.checkpoint.test_deepspeed_interop import _deepspeed_job, _mean_losses

SAVE_AT, STEPS = 3, 3
SCRIPT = Path(job.__file__)


def _job(rank: int, world: int, kw: dict) -> dict:
    import dslaunch

    dslaunch.init_distributed(dist_backend="gloo")
    return job.run(dslaunch, rank, world, **kw)


def _close(want: list[float], have: list[float]) -> None:
    assert max(abs(a - b) for a, b in zip(want, have, strict=True)) < 1e-6, (want, have)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("stage", [1, 2])
def test_autoep_tags_cross_between_deepspeed_and_dslaunch(deepspeed_python: Path, tmp_path: Path,
                                                          stage: int) -> None:
    """DeepSpeed's AutoEP tag (ep 2, world 2) continues under dslaunch at ep 2 / world 2 and at
    ep 1 / world 1, and dslaunch's tag in DeepSpeed's layout continues under DeepSpeed; at ZeRO-2
    DeepSpeed's tag converted to a universal checkpoint by dslaunch continues under dslaunch (ep 1,
    world 1) and DeepSpeed (ep 2, world 2): the mean losses after each load equal the saver's own
    continuation within 1e-6."""
    saved = {"stage": stage, "first": 0, "steps": SAVE_AT + STEPS, "save_at": SAVE_AT}
    theirs = _deepspeed_job(deepspeed_python, tmp_path / "ds.json", tmp_path / "ext", 2,
                            {**saved, "save": str(tmp_path / "ds")}, script=SCRIPT)
    ours = run_world(_job, 2, {**saved, "save": str(tmp_path / "dsl"), "checkpoint": {"format": "deepspeed"}},
                     timeout=240)
    _close(_mean_losses(theirs), _mean_losses(ours))  # the same training before the checkpoints
    folder = tmp_path / "ds" / f"global_step{SAVE_AT}"
    files = sorted(f.name for f in folder.iterdir())
    assert "layer_0_expert_3_mp_rank_00_model_states.pt" in files
    assert sorted(f.name for f in (tmp_path / "dsl" / folder.name).iterdir()) == sorted([*files, "manifest.json"])
    ds_states = torch.load(folder / "mp_rank_00_model_states.pt", weights_only=False)
    our_states = torch.load(tmp_path / "dsl" / folder.name / "mp_rank_00_model_states.pt", weights_only=False)
    assert list(our_states["module"]) == list(ds_states["module"])
    assert our_states["ds_autoep_layers"] == ds_states["ds_autoep_layers"]
    assert our_states["param_shapes"] == ds_states["param_shapes"]
    resumed = {"stage": stage, "first": SAVE_AT, "steps": STEPS}
    by_us = run_world(_job, 2, {**resumed, "load": str(tmp_path / "ds")}, timeout=240)
    by_us_ep1 = run_world(_job, 1, {**resumed, "load": str(tmp_path / "ds"), "ep_size": 1}, timeout=240)
    by_them = _deepspeed_job(deepspeed_python, tmp_path / "back.json", tmp_path / "ext", 2,
                             {**resumed, "load": str(tmp_path / "dsl")}, script=SCRIPT)
    pairs = [(theirs, by_us), (theirs, by_us_ep1), (ours, by_them)]
    if stage == 2:  # DeepSpeed's tag made universal by dslaunch: both continue from it
        convert(folder, tmp_path / "ds" / "universal")
        universal = {**resumed, "load": str(tmp_path / "ds"), "checkpoint": {"load_universal": True},
                     "load_kwargs": {"tag": "universal"}}
        pairs.append((theirs, run_world(_job, 1, {**universal, "ep_size": 1}, timeout=240)))
        pairs.append((theirs, _deepspeed_job(deepspeed_python, tmp_path / "uni.json", tmp_path / "ext", 2, universal,
                                             script=SCRIPT)))
    for saver, loader in pairs:
        _close(_mean_losses(saver, skip=SAVE_AT), _mean_losses(loader))
        assert loader[0]["global_steps"] == SAVE_AT


def _save_one(rank: int, world: int, save: str) -> None:
    import dslaunch

    dslaunch.init_distributed(dist_backend="gloo")
    job.run(dslaunch, rank, world, stage=2, first=0, steps=1, ep_size=1, save=save, save_at=0,
            checkpoint={"format": "deepspeed"})


def _load_once(rank: int, world: int, load: str) -> str:
    import dslaunch

    dslaunch.init_distributed(dist_backend="gloo")
    try:
        job.run(dslaunch, rank, world, stage=2, first=1, steps=0, ep_size=1, load=load)
    except CheckpointLayoutError as exc:
        return str(exc)
    return ""


@pytest.mark.timeout(300)
def test_broken_autoep_metadata_is_refused_in_one_line(tmp_path: Path) -> None:
    """A tag whose ``ds_autoep_layers`` is not a list, lacks fields, names another block or
    another expert count: one line naming the model-states file and the key, on every rank."""
    run_world(_save_one, 1, str(tmp_path), timeout=120)
    path = next(tmp_path.glob("global_step*/mp_rank_00_model_states.pt"))
    good = torch.load(path, weights_only=False)
    entry = good["ds_autoep_layers"][0]
    cases: list[tuple[Any, str]] = [
        ("not_a_list", "malformed"), ([7], "malformed"), ([{"moe_layer_id": 0}], "missing fields"),
        ([{**entry, "module_path": "model.layers.9.mlp"}], "model.layers.9.mlp"),
        ([{**entry, "num_experts": 8, "num_local_experts": 8}], "8 experts in the checkpoint")]
    for layers, words in cases:
        torch.save({**good, "ds_autoep_layers": layers}, path)
        msg = run_world(_load_once, 1, str(tmp_path), timeout=120)[0]
        assert str(path) in msg and "ds_autoep_layers" in msg and words in msg and "\n" not in msg, msg


def test_metadata_check_matches_deepspeeds_rules() -> None:
    """``check_metadata`` (pure): DeepSpeed's required fields, duplicates, ``num_experts =
    num_local_experts * ep_size``, DeepSpeed's ZeRO-3 layout at its version 1 with its fields;
    another ``ep_size`` than the model's accepted. Each a ``RuntimeError`` too, as DeepSpeed raises."""
    block = AutoEPBlock("model.layers.0.mlp.", "gate", ("gate_up_proj", "down_proj", None), 4, 2, 2, 0)
    entry = {"moe_layer_id": 0, "module_path": "model.layers.0.mlp", "num_experts": 4, "num_local_experts": 4,
             "ep_size": 1, "expert_key_prefix": "model.layers.0.mlp.experts"}
    check_metadata([entry], [block], "f.pt")  # saved at ep 1, loaded at ep 2
    zero3 = {**entry, "checkpoint_format": "zero3_partitioned", "checkpoint_format_version": 1, "ep_rank": 0,
             "expert_data_parallel_rank": 0, "expert_data_parallel_world_size": 1, "global_expert_start": 0,
             "global_expert_end": 4}
    check_metadata([zero3], [block], "f.pt")  # DeepSpeed's ZeRO-3 layout
    bad: list[tuple[Any, str]] = [
        ([entry, {**entry, "module_path": "x"}], "duplicate moe_layer_id"),
        ([{**entry, "num_local_experts": 3}], "inconsistent"),
        ([{**zero3, "checkpoint_format_version": 2}], "checkpoint_format_version 2"),
        ([{k: v for k, v in zero3.items() if k != "ep_rank"}], r"missing fields \['ep_rank'\]"),
        ([{**entry, "checkpoint_format": "sharded"}], "checkpoint_format 'sharded'"),
        ([{**entry, "expert_key_prefix": "model.layers.0.mlp.moe"}], "expert_key_prefix"),
        ([], "lacks the model's AutoEP blocks"),
    ]
    for layers, words in bad:
        with pytest.raises(RuntimeError, match=words) as exc:
            check_metadata(layers, [block], "f.pt")
        assert str(exc.value).startswith("f.pt: ") and "ds_autoep_layers" in str(exc.value)


@pytest.mark.parametrize(("data_first", "order"), [(False, [0, 2, 1, 3]), (True, [0, 1, 2, 3])])
def test_expert_fragments_join_in_deepspeeds_rank_order(tmp_path: Path, data_first: bool, order: list[int]) -> None:
    """``autoep_universal.consolidate_autoep_zero12_expert_states``: 4 data-parallel ranks' fragments
    at ep 2 become the whole weight in expert order (expert-data peers every ``ep``-th rank, or
    neighbours with ``use_data_before_expert_parallelism``), DeepSpeed's universal file around it;
    a fragment of the wrong size is refused naming the parameter."""
    from dslaunch.checkpoint.autoep_universal import (
        _zero12_fragment_path,
        consolidate_autoep_zero12_expert_states,
    )
    from dslaunch.errors import CheckpointError

    name, temp, out = "model.layers.0.mlp.experts.w1", tmp_path / "tmp", tmp_path / "universal"
    (temp / name / "0").mkdir(parents=True)
    for i, key in enumerate(("fp32", "exp_avg", "exp_avg_sq")):
        for r in range(4):
            torch.save(torch.tensor([10.0 * i + r]), _zero12_fragment_path(temp, name, key, r))
    for r in range(4):
        torch.save(torch.tensor(7), _zero12_fragment_path(temp, name, "step", r))
    info = {name: {"num_experts": 4, "num_local_experts": 2, "ep_size": 2}}
    consolidate_autoep_zero12_expert_states(temp, out, info, {name: (2, 1)}, 4, 1, data_first)
    for i, key in enumerate(("fp32", "exp_avg", "exp_avg_sq")):
        got = torch.load(out / "zero" / name / f"{key}.pt", weights_only=True)
        assert got["is_expert_param"] and got["ep_num_experts"] == 4 and got["cat_dim"] == 0
        assert torch.equal(got["param"], torch.tensor([10.0 * i + r for r in order]).view(4, 1))
    assert int(torch.load(out / "zero" / name / "step.pt", weights_only=True)) == 7
    torch.save(torch.tensor([1.0, 2.0]), _zero12_fragment_path(temp, name, "exp_avg", 3))
    with pytest.raises(CheckpointError, match=f"exp_avg fragments of {name} for expert rank 1"):
        consolidate_autoep_zero12_expert_states(temp, out, info, {name: (2, 1)}, 4, 1, data_first)


def _expert_files_back(rank: int, world: int, save: str) -> dict:
    import dslaunch
    from dslaunch.runtime.moe.autoep_state import local_layout

    dslaunch.init_distributed(dist_backend="gloo")
    engine, _, _, _ = dslaunch.initialize(model=job.Net(), config=job.config(1, world, 2,
                                                                             {"format": "deepspeed"}))
    engine.save_checkpoint(save, tag="t")
    layers = torch.load(Path(save) / "t" / "mp_rank_00_model_states.pt", weights_only=False)["ds_autoep_layers"]
    got: dict = {}
    engine.load_moe_state_dict(save, "t", got, False, model=engine.module, autoep_layers=layers)
    with local_layout(engine.module):
        want = {k: v for k, v in engine.module.state_dict().items() if ".experts." in k}
    return {"same": sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want),
            "names": sorted(got)}


@pytest.mark.timeout(300)
def test_load_moe_state_dict_reads_this_ranks_experts(tmp_path: Path) -> None:
    """DeepSpeed's ``DeepSpeedEngine.load_moe_state_dict`` on a tag dslaunch wrote in DeepSpeed's
    layout (ep 2, world 2): each rank gets its own experts' fused weights, equal to its module's;
    ``_get_expert_ckpt_name`` names DeepSpeed's files (the mpu's model-parallel rank, or the one
    given); ``autoep_layers`` that are not a list are refused as DeepSpeed refuses them."""
    from dslaunch.runtime.engine import DeepSpeedEngine

    for got in run_world(_expert_files_back, 2, str(tmp_path), timeout=200):
        assert got["same"] and got["names"] == ["model.layers.0.mlp.experts.down_proj",
                                                "model.layers.0.mlp.experts.gate_up_proj"], got

    class MPU:
        def get_model_parallel_rank(self) -> int:
            return 3

    assert DeepSpeedEngine._get_expert_ckpt_name("/x", 1, 2, "t", MPU()) == "/x/t/layer_1_expert_2_mp_rank_03_model_states.pt"
    assert DeepSpeedEngine._get_expert_ckpt_name("/x", -1, 2, "t", MPU(), checkpoint_mp_rank=0) == \
        "/x/t/expert_2_mp_rank_00_model_states.pt"
    DeepSpeedEngine.load_moe_state_dict("/x", "t", {}, False, model=torch.nn.Linear(1, 1), mpu=MPU())  # nothing to do
    for layers, words in (("not_a_list", "malformed"), ([{"moe_layer_id": 0}], "missing fields")):
        with pytest.raises(RuntimeError, match=words):
            DeepSpeedEngine.load_moe_state_dict("/x", "t", {}, False, model=torch.nn.Linear(1, 1), autoep_layers=layers)
