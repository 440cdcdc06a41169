"""Checkpoints real DeepSpeed 0.19.8 wrote, loaded by dslaunch (``deepspeed_load``).

Real DeepSpeed runs ``deepspeed_job.py`` in its own venv (``.venv-conformance/deepspeed``, which
``make conformance`` builds, or the interpreter ``DSLAUNCH_DEEPSPEED_PYTHON`` names), one process
per rank on gloo: 3 steps, a save, then 10 more steps (its own continuation). dslaunch loads that
checkpoint at the same or another world size and stage and runs the same 10 steps: the mean loss
of each step equals DeepSpeed's within 1e-6, and right after the load every parameter's fp32
master and Adam moments equal DeepSpeed's at the save, bit for bit. Without the venv these tests
skip and say why.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from dslaunch.errors import CheckpointError
from dslaunch.utils.ports import free_port
from tests.deepspeed_reference import run_python, run_ranks
from tests.distributed import run_world
from tests.runtime.checkpoint import deepspeed_job

JOB = Path(deepspeed_job.__file__)
SAVE_AT, STEPS = 3, 10


@pytest.fixture(scope="session")
def deepspeed_runs(deepspeed_python: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """``run(stage, world, bf16=False)``: DeepSpeed's checkpoint folder and per-rank results,
    once per session (any op DeepSpeed builds goes to a private folder, never into its venv)."""
    base = tmp_path_factory.mktemp("deepspeed")
    cache: dict[tuple, tuple[Path, list[dict]]] = {}

    def run(stage: int, world: int, bf16: bool = False) -> tuple[Path, list[dict]]:
        key = (stage, world, bf16)
        if key not in cache:
            cache[key] = _run_deepspeed(deepspeed_python, base, base / "ext", stage, world, bf16)
        return cache[key]

    return run


def _run_deepspeed(python: Path, base: Path, ext: Path, stage: int, world: int, bf16: bool
                   ) -> tuple[Path, list[dict]]:
    name = f"z{stage}_w{world}{'_bf16' if bf16 else ''}"
    ckpt = base / name
    return ckpt, _deepspeed_job(python, base / f"{name}.json", ext, world, {
        "stage": stage, "first": 0, "steps": SAVE_AT + STEPS, "save": str(ckpt), "save_at": SAVE_AT, "bf16": bf16})


def _deepspeed_job(python: Path, out: Path, ext: Path, world: int, job: dict, script: Path = JOB) -> list[dict]:
    """Real DeepSpeed runs ``deepspeed_job.run(**job)`` (or ``script``'s ``run``) at ``world`` ranks:
    each rank's results."""
    name, args = out.stem, json.dumps(job)
    port = free_port()
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "LOCAL_SIZE": str(world), "OMP_NUM_THREADS": "1",
           "TORCH_EXTENSIONS_DIR": str(ext), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
           "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world),
           "PYTHONPATH": os.environ.get("DSLAUNCH_DEEPSPEED_PYTHONPATH", "")}  # e.g. transformers for AutoTP
    logs = [Path(f"{out}.log{r}") for r in range(world)]
    codes = run_ranks(python, [str(script), str(out), args],
                      [{**env, "RANK": str(r), "LOCAL_RANK": str(r)} for r in range(world)], logs, timeout=400)
    if None in codes:
        pytest.fail(f"DeepSpeed {name} did not finish in 400 s")
    if any(codes):
        pytest.fail(f"DeepSpeed {name} failed (exit codes {codes}):\n{logs[0].read_text(errors='replace')[-3000:]}")
    return [json.loads(Path(f"{out}.rank{r}").read_text()) for r in range(world)]


def _continue(rank: int, world: int, stage: int, load: str, bf16: bool, load_kwargs: dict, probe: bool) -> dict:
    import dslaunch

    dslaunch.init_distributed(dist_backend="gloo")
    out = deepspeed_job.run(dslaunch, rank, world, stage, first=SAVE_AT, steps=STEPS, load=load, bf16=bf16,
                            load_kwargs=load_kwargs, probe=probe)
    out["client"] = {k: v for k, v in out["client"].items() if isinstance(v, (int, str, float))}
    return out


def _dslaunch(stage: int, world: int, load: Path, bf16: bool = False, probe: bool = True,
              **load_kwargs: Any) -> list[dict]:
    return run_world(_continue, world, stage, str(load), bf16, load_kwargs, probe, timeout=240)


def _mean_losses(results: list[dict], skip: int = 0) -> list[float]:
    per_rank = [r["losses"][skip:] for r in results]
    return [sum(step) / len(step) for step in zip(*per_rank, strict=True)]


@pytest.mark.timeout(900)
@pytest.mark.parametrize(("ds_stage", "ds_world", "stage", "world", "bf16"), [
    (1, 2, 1, 2, False), (1, 2, 1, 1, False), (2, 2, 2, 2, False), (2, 2, 2, 1, False), (3, 2, 3, 2, False),
    (3, 2, 3, 1, False),
    (2, 2, 3, 2, False),  # another stage
    (0, 2, 0, 2, False), (0, 2, 2, 1, False),  # no ZeRO: the client optimizer's own state dict
    (3, 4, 3, 4, False), (3, 4, 1, 2, False),
    (2, 2, 2, 2, True), (2, 2, 3, 1, True),  # bf16_zero_pp_rank_* files, fp32 masters in them
])
def test_dslaunch_continues_deepspeed(deepspeed_runs: Any, ds_stage: int, ds_world: int, stage: int,
                                      world: int, bf16: bool) -> None:
    folder, ds = deepspeed_runs(ds_stage, ds_world, bf16)
    got = _dslaunch(stage, world, folder, bf16)
    want = _mean_losses(ds, skip=SAVE_AT)
    have = _mean_losses(got)
    # bf16 at another world size sums other bf16 partial results: only the loaded state is exact
    if not bf16 or world == ds_world:
        assert max(abs(a - b) for a, b in zip(want, have, strict=True)) < 1e-6, (want, have)
    first = got[0]
    assert first["path"] == str(folder / "global_step3" / ("zero_pp_rank_0_mp_rank_00_model_states.pt"
                                                           if ds_stage == 3 else "mp_rank_00_model_states.pt"))
    assert (first["global_steps"], first["global_samples"], first["skipped_steps"]) == (3, 24, 0)
    assert first["client"]["note"] == "from the job" and first["client"]["step"] == SAVE_AT
    if ds_stage and stage:  # masters and moments as DeepSpeed had them at the save, bit for bit
        assert first["state"] == ds[0]["state"]


@pytest.mark.timeout(600)
def test_flags_mean_what_deepspeeds_mean(deepspeed_runs: Any) -> None:
    folder, ds = deepspeed_runs(2, 2)
    module_only = _dslaunch(2, 1, folder, probe=False, load_module_only=True)[0]
    assert module_only["global_steps"] == 0 and module_only["lr"] == [0.0]  # no counters, no scheduler
    assert "note" in module_only["client"]
    no_optim = _dslaunch(2, 2, folder, probe=False, load_optimizer_states=False)
    # counters and the scheduler (WarmupLR at its 3rd step: log(3) / log(20) of the way up) loaded
    assert no_optim[0]["global_steps"] == 3 and no_optim[0]["lr"] == pytest.approx([0.01 * math.log(3) / math.log(20)])
    # fresh moments: the first step differs from DeepSpeed's continuation, the weights do not
    want = _mean_losses(ds, skip=SAVE_AT)
    assert abs(_mean_losses(no_optim)[0] - want[0]) < 1e-6  # the same weights give the same first loss
    assert abs(_mean_losses(no_optim)[1] - want[1]) > 1e-6  # a fresh Adam takes another step


def _load_once(rank: int, world: int, load: str, checkpoint: dict | None = None) -> str:
    """Load ``load`` once into a fresh ZeRO-2 engine (``checkpoint``: the config's block); the
    one-line error, or "loaded"."""
    import dslaunch

    dslaunch.init_distributed(dist_backend="gloo")
    net = deepspeed_job.model()
    config = deepspeed_job.config(2, world, checkpoint=checkpoint)
    engine, *_ = dslaunch.initialize(model=net, optimizer=torch.optim.AdamW(net.parameters()), config=config)
    try:
        engine.load_checkpoint(load)
    except CheckpointError as exc:
        return str(exc)
    return "loaded"


@pytest.mark.timeout(600)
def test_broken_deepspeed_checkpoints_name_the_file(deepspeed_runs: Any, tmp_path: Path) -> None:
    folder, _ = deepspeed_runs(2, 2)
    broken = tmp_path / "ck"
    shutil.copytree(folder, broken)
    optim = broken / "global_step3" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    optim.write_bytes(optim.read_bytes()[:1000])
    msg = run_world(_load_once, 1, str(broken))[0]
    assert str(optim) in msg and "truncated" in msg, msg
    torch.save({"something": "else"}, optim)
    msg = run_world(_load_once, 1, str(broken))[0]
    assert str(optim) in msg and "'optimizer_state_dict' is missing" in msg, msg
    optim.unlink()
    msg = run_world(_load_once, 1, str(broken))[0]
    assert "zero_pp_rank_1_mp_rank_00_optim_states.pt" in msg and "2 data-parallel ranks" in msg, msg
    model = broken / "global_step3" / "mp_rank_00_model_states.pt"
    model.write_bytes(b"not a checkpoint")
    msg = run_world(_load_once, 1, str(broken))[0]
    assert str(model) in msg, msg
    assert "\n" not in msg


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))


def _names(rank: int, world: int, stage: int, load: str) -> list[str]:
    import dslaunch

    dslaunch.init_distributed(dist_backend="gloo")
    net = deepspeed_job.model()
    engine, *_ = dslaunch.initialize(model=net, optimizer=torch.optim.AdamW(net.parameters()),
                                     config=deepspeed_job.config(stage, world))
    return [engine._get_ckpt_name(load, "global_step3"), engine._get_zero_ckpt_name(load, "global_step3"),
            engine._get_optimizer_ckpt_name(load, "global_step3", 0),
            engine._get_ckpt_name(load, "global_step3", mp_placeholder="*")]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("stage", [2, 3])
def test_checkpoint_name_helpers_name_deepspeeds_files(deepspeed_runs: Any, stage: int) -> None:
    folder, _ = deepspeed_runs(stage, 2)
    for rank, (model, zero, optim, pattern) in enumerate(run_world(_names, 2, stage, str(folder))):
        assert Path(model).is_file() and Path(zero).is_file(), (model, zero)
        assert Path(zero).name == f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"
        assert optim == str(folder / "global_step3" / "expp_rank_0_mp_rank_00_optim_states.pt")
        assert pattern.endswith("mp_rank_*_model_states.pt")


# ---- dslaunch writes DeepSpeed's format ("checkpoint": {"format": "deepspeed"}) -----------------
# ZeRO-3 in several sub-groups (DeepSpeed's default sub_group_size holds the whole tiny model in one)
ZERO = {3: {"sub_group_size": 40}}


def _save_as_deepspeed(rank: int, world: int, stage: int, save: str, bf16: bool) -> dict:
    import dslaunch

    dslaunch.init_distributed(dist_backend="gloo")
    return deepspeed_job.run(dslaunch, rank, world, stage, first=0, steps=SAVE_AT + STEPS, save=save, save_at=SAVE_AT,
                             bf16=bf16, checkpoint={"format": "deepspeed"}, zero=ZERO.get(stage))


@pytest.fixture(scope="module")
def dslaunch_writes(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """``run(stage, bf16)``: dslaunch trains at world 2, saves DeepSpeed's format before step
    ``SAVE_AT`` and goes on (its own continuation); the folder and per-rank results, once each."""
    base = tmp_path_factory.mktemp("dslaunch-ds-format")
    cache: dict[tuple, tuple[Path, list[dict]]] = {}

    def run(stage: int, bf16: bool) -> tuple[Path, list[dict]]:
        if (stage, bf16) not in cache:
            folder = base / f"z{stage}{'_bf16' if bf16 else ''}"
            cache[stage, bf16] = folder, run_world(_save_as_deepspeed, 2, stage, str(folder), bf16, timeout=240)
        return cache[stage, bf16]

    return run


@pytest.mark.timeout(900)
@pytest.mark.parametrize(("stage", "bf16"), [(1, False), (2, True), (3, False)])
def test_deepspeed_continues_dslaunch(deepspeed_python: Path, dslaunch_writes: Any, tmp_path: Path, stage: int,
                                      bf16: bool) -> None:
    folder, ours = dslaunch_writes(stage, bf16)
    tag = folder / "global_step3"
    assert (folder / "latest").read_text() == "global_step3"
    assert json.loads((tag / "manifest.json").read_text())["body"]["meta"]["format"] == "deepspeed"
    for f in tag.glob("*.pt"):  # DeepSpeed unpickles these without dslaunch: no class of ours in them
        assert not [g for g in torch.serialization.get_unsafe_globals_in_checkpoint(str(f))
                    if not g.startswith(("deepspeed.", "torch.", "collections.", "builtins."))], f
    # probe False: DeepSpeed's safe_get_full_* fail before its first step after a load
    theirs = _deepspeed_job(deepspeed_python, tmp_path / "continue.json", tmp_path / "ext", 2,
                            {"stage": stage, "first": SAVE_AT, "steps": STEPS, "load": str(folder), "bf16": bf16,
                             "probe": False, "zero": ZERO.get(stage)})
    want, have = _mean_losses(ours, skip=SAVE_AT), _mean_losses(theirs)
    assert max(abs(a - b) for a, b in zip(want, have, strict=True)) < 1e-6, (want, have)
    first = theirs[0]
    assert (first["global_steps"], first["global_samples"], first["skipped_steps"]) == (3, 24, 0)
    # DeepSpeed's get_last_lr() reads 0 until its first step after a load: the losses show the scheduler's state


@pytest.mark.timeout(600)
def test_zero_to_fp32_reads_dslaunch_written_folders(deepspeed_python: Path, dslaunch_writes: Any,
                                                     tmp_path: Path) -> None:
    runs = {stage: dslaunch_writes(stage, False) for stage in (1, 3)}
    # one interpreter for both folders: importing DeepSpeed is most of the time
    run_python(deepspeed_python, ["-c", "import sys, torch; "
                                  "from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint as g; "
                                  "[torch.save(dict(g(a)), b) for a, b in zip(sys.argv[1::2], sys.argv[2::2])]",
                                  *[str(x) for stage, (folder, _) in runs.items() for x in (folder, tmp_path / f"z{stage}.pt")]],
               {**os.environ, "PYTHONPATH": "", "DS_ACCELERATOR": "cpu"}, timeout=300, check=True)
    for stage, (_, ours) in runs.items():
        weights = torch.load(tmp_path / f"z{stage}.pt", weights_only=True)
        names = [n for n in ours[0]["state"] if ":" not in n]
        assert sorted(weights) == sorted(names)
        for n in names:
            assert weights[n].reshape(-1).tolist() == ours[0]["state"][n], (stage, n)
        # dslaunch's own zero-to-fp32 gives the same (stage 3: the masters from every rank's file)
        from dslaunch.runtime.checkpoint.export import get_fp32_state_dict_from_zero_checkpoint

        exported = get_fp32_state_dict_from_zero_checkpoint(runs[stage][0])
        assert {n: exported[n].reshape(-1).tolist() for n in names} == {n: ours[0]["state"][n] for n in names}


# ---- universal checkpoints (DeepSpeed's ds_to_universal layout) -----------------------------------
DSLAUNCH = Path(sys.executable).with_name("dslaunch")


def _continue_universal(rank: int, world: int, stage: int, load: str) -> dict:
    import dslaunch

    dslaunch.init_distributed(dist_backend="gloo")
    return deepspeed_job.run(dslaunch, rank, world, stage, first=SAVE_AT, steps=STEPS, load=load, probe=False,
                             checkpoint={"load_universal": True})


@pytest.mark.timeout(900)
def test_universal_round_trip(deepspeed_python: Path, deepspeed_runs: Any, dslaunch_writes: Any,
                              tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": "", "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    # DeepSpeed's ds_to_universal of its ZeRO-3 world-2 save -> dslaunch at world 1, ZeRO-1
    folder, ds = deepspeed_runs(3, 2)
    uni = tmp_path / "from_deepspeed" / "global_step3_universal"
    run_python(deepspeed_python, ["-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder",
                                  str(folder / "global_step3"), "--output_folder", str(uni)], env, timeout=300, check=True)
    got = run_world(_continue_universal, 1, 1, str(uni.parent), timeout=240)
    want, have = _mean_losses(ds, skip=SAVE_AT), _mean_losses(got)
    assert max(abs(a - b) for a, b in zip(want, have, strict=True)) < 1e-6, (want, have)
    assert got[0]["global_steps"] == 3
    # dslaunch's ds-to-universal of its own DeepSpeed-format world-2 save -> real DeepSpeed at world 1
    folder, ours = dslaunch_writes(3, False)
    out = tmp_path / "from_dslaunch" / "global_step3_universal"
    done = subprocess.run([str(DSLAUNCH), "ds-to-universal", "--input_folder", str(folder / "global_step3"),
                           "--output_folder", str(out)], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert (out.parent / "latest_universal").read_text() == out.name
    theirs = _deepspeed_job(deepspeed_python, tmp_path / "universal.json", tmp_path / "ext", 1,
                            {"stage": 3, "first": SAVE_AT, "steps": STEPS, "load": str(out.parent), "probe": False,
                             "checkpoint": {"load_universal": True}})
    want, have = _mean_losses(ours, skip=SAVE_AT), _mean_losses(theirs)
    assert max(abs(a - b) for a, b in zip(want, have, strict=True)) < 1e-6, (want, have)


def _save_own_layout(rank: int, world: int, save: str) -> dict:
    import dslaunch

    dslaunch.init_distributed(dist_backend="gloo")
    return deepspeed_job.run(dslaunch, rank, world, 2, first=0, steps=SAVE_AT + STEPS, save=save, save_at=SAVE_AT)


@pytest.mark.timeout(600)
def test_ds_to_universal_converts_dslaunchs_own_layout(tmp_path: Path) -> None:
    from types import SimpleNamespace

    from dslaunch.checkpoint.ds_to_universal import main as convert_to_universal

    ours = run_world(_save_own_layout, 2, str(tmp_path / "ck"), timeout=240)  # ZeRO-2 at world 2, manifest
    # DeepSpeed's module and its parsed arguments, as its tests and Megatron's scripts call it
    convert_to_universal(SimpleNamespace(
        input_folder=str(tmp_path / "ck" / "global_step3"), output_folder=str(tmp_path / "uni" / "global_step3_universal"),
        num_extract_workers=1, num_merge_workers=1, keep_temp_folder=False, strict=True, inject_missing_state=False))
    got = run_world(_continue_universal, 1, 3, str(tmp_path / "uni"), timeout=240)  # ZeRO-3 at world 1
    want, have = _mean_losses(ours, skip=SAVE_AT), _mean_losses(got)
    assert max(abs(a - b) for a, b in zip(want, have, strict=True)) < 1e-6, (want, have)
    assert (got[0]["global_steps"], got[0]["global_samples"]) == (3, 24)


UNIVERSAL = {"load_universal": True}


@pytest.mark.timeout(600)
def test_bad_universal_input_names_the_file(dslaunch_writes: Any, tmp_path: Path) -> None:
    from dslaunch.runtime.checkpoint.universal import convert

    folder, _ = dslaunch_writes(3, False)
    neither = tmp_path / "neither"
    neither.mkdir()
    with pytest.raises(CheckpointError, match="neither a DeepSpeed checkpoint tag folder") as exc:
        convert(neither, tmp_path / "out")
    assert str(neither) in str(exc.value)
    out = convert(folder / "global_step3", tmp_path / "uni" / "global_step3_universal")
    bias = out / "zero" / "0.bias" / "fp32.pt"
    good = bias.read_bytes()
    torch.save({"param": torch.zeros(4)}, bias)
    msg = run_world(_load_once, 1, str(out.parent), UNIVERSAL)[0]
    assert str(bias) in msg and "(4,)" in msg and "(10,)" in msg, msg
    bias.write_bytes(good)
    (out / "zero" / "2.weight" / "exp_avg.pt").unlink()
    msg = run_world(_load_once, 1, str(out.parent), UNIVERSAL)[0]
    assert str(out / "zero" / "2.weight" / "exp_avg.pt") in msg and "missing" in msg, msg
    msg = run_world(_load_once, 1, str(folder), UNIVERSAL)[0]  # a plain DeepSpeed-format save_dir
    assert "latest_universal" in msg and "ds-to-universal" in msg, msg
    assert all("\n" not in m for m in (msg, str(exc.value)))


def _moe_job(rank: int, world: int, job: dict) -> dict:
    import dslaunch

    dslaunch.init_distributed(dist_backend="gloo")
    out = deepspeed_job.run(dslaunch, rank, world, **job)
    out.pop("client", None)
    return out


@pytest.mark.timeout(1500)
def test_moe_checkpoints_cross_between_deepspeed_and_dslaunch(deepspeed_python: Path, tmp_path: Path) -> None:
    """An MoE model (4 experts at ep 2, world 2, ZeRO-1): DeepSpeed's tag (a file per global expert,
    the experts' partitions over their expert-data group) continues under dslaunch, and the same
    layout written by dslaunch continues under DeepSpeed: the 4 mean losses after the load equal
    the saver's own continuation within 1e-6."""
    steps = 4
    job = {"stage": 1, "ep_size": 2, "probe": False}
    saved = {**job, "first": 0, "steps": SAVE_AT + steps, "save_at": SAVE_AT}
    theirs = _deepspeed_job(deepspeed_python, tmp_path / "ds.json", tmp_path / "ext", 2,
                            {**saved, "save": str(tmp_path / "ds")})
    ours = run_world(_moe_job, 2, {**saved, "save": str(tmp_path / "dsl"), "checkpoint": {"format": "deepspeed"}},
                     timeout=240)
    files = sorted(f.name for f in (tmp_path / "ds" / "global_step3").iterdir())
    assert "layer_0_expert_3_mp_rank_00_model_states.pt" in files
    ours_files = sorted(f.name for f in (tmp_path / "dsl" / "global_step3").iterdir())
    assert ours_files == sorted([*files, "manifest.json"])  # dslaunch's manifest beside DeepSpeed's files
    resumed = {**job, "first": SAVE_AT, "steps": steps}
    by_us = run_world(_moe_job, 2, {**resumed, "load": str(tmp_path / "ds")}, timeout=240)
    by_them = _deepspeed_job(deepspeed_python, tmp_path / "back.json", tmp_path / "ext", 2,
                             {**resumed, "load": str(tmp_path / "dsl")})
    for saver, loader in ((theirs, by_us), (ours, by_them)):
        want, have = _mean_losses(saver, skip=SAVE_AT), _mean_losses(loader)
        assert max(abs(a - b) for a, b in zip(want, have, strict=True)) < 1e-6, (want, have)
